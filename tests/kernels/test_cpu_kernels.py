"""The compiled CPU kernels (src/kernels/cpu_*.cpp) against float64 references and against the
torch implementations they replace, on fresh random inputs of odd sizes and strided layouts, on
every ISA path this CPU can run. A path the CPU lacks is reported as skipped (not run), never as
passed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefillonly.kernels import cpu_ext, ops

# what each path of cpu_ops.cpp needs of the CPU (its __builtin_cpu_supports checks)
ISA_FLAGS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma")}


@pytest.fixture(scope="module")
def kernels():
    module = cpu_ext.load()
    # This machine class has gcc and the set-up installs ninja: a build failure is a defect here.
    assert module is not None, f"compiled CPU kernels failed to build: {cpu_ext.why_unavailable()}"
    return module


def _require(kernels, isa: str) -> None:
    if isa not in kernels.supported_isas():
        missing = [f for f in ISA_FLAGS[isa] if f not in cpu_ext._cpu_flags()] or list(ISA_FLAGS[isa])
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {isa} path was not run")


@pytest.fixture(params=sorted(ISA_FLAGS))
def isa(request, kernels):
    """Runs the test with every op's default ("auto") forced to one path, so the compiled op family
    (which calls the module without an isa) goes through it."""
    _require(kernels, request.param)
    kernels.set_default_isa(request.param)
    assert kernels.active_isa() == request.param
    yield request.param
    kernels.set_default_isa(cpu_ext._isa())


@pytest.fixture
def both_paths(kernels):
    for name in ISA_FLAGS:
        _require(kernels, name)


def _compiled(kernels) -> ops.CompiledCpuOps:
    chosen = ops.ops_for("cpu", torch.float32)
    assert isinstance(chosen, ops.CompiledCpuOps) and chosen.kernels is kernels  # the engine's choice on this host
    return chosen


# bf16 tolerances: the kernels round once, so they must be as close to float64 as one bf16 rounding
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 8), (7, 37), (130, 576), (3, 1000)])
def test_rms_norm_matches_float64(kernels, isa, dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    base = torch.randn(rows, n + 5, generator=g).to(dtype)  # row stride n + 5: a column slice, as the executor passes
    x = base[:, :n]
    w = 1 + 0.3 * torch.randn(n, generator=g)
    want = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    out = torch.empty(rows, n, dtype=dtype)
    _compiled(kernels).rms_norm_into(out, x, w, 1e-5, torch.empty(rows, n))
    assert _rel_err(out, want) < TOL[dtype]
    _compiled(kernels).rms_norm_into(x, x, w, 1e-5, torch.empty(rows, n))  # in place
    assert torch.equal(x, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,d", [(1, 1, 8), (13, 3, 24), (130, 9, 64), (5, 2, 128)])
def test_rope_matches_float64(kernels, isa, dtype, tokens, heads, d):
    g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + d)
    rows = torch.randn(tokens, heads * d + 16, generator=g).to(dtype)  # a slice of a fused QKV row
    src = rows[:, : heads * d].view(tokens, heads, d).transpose(0, 1)  # [heads, tokens, d], as the executor passes
    angles = torch.rand(tokens, d // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = src.double()[..., : d // 2], src.double()[..., d // 2 :]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    dst = torch.empty(heads, tokens + 3, d, dtype=dtype)[:, 2 : 2 + tokens]  # a window of the full-length Q
    _compiled(kernels).rope_into(dst, src, cos.float(), sin.float())
    assert _rel_err(dst, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,f", [(1, 8), (9, 37), (64, 1536)])
def test_swiglu_matches_float64(kernels, isa, dtype, rows, f):
    g = torch.Generator().manual_seed(rows * 10 + f)
    gate_up = (3 * torch.randn(rows, 2 * f, generator=g)).to(dtype)
    gate, up = gate_up.double()[:, :f], gate_up.double()[:, f:]
    want = gate * torch.sigmoid(gate) * up
    out = torch.empty(rows, f, dtype=dtype)
    _compiled(kernels).swiglu_into(out, gate_up)
    assert _rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ops_equal_the_torch_fallbacks(kernels, isa, dtype):
    """The same inputs through both op families (the torch one runs where no compiler is)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(33, 96, generator=g).to(dtype), 1 + 0.2 * torch.randn(96, generator=g)
    src = torch.randn(33, 4, 32, generator=g).to(dtype).transpose(0, 1)
    angles = torch.rand(33, 16, generator=g) * 6
    gate_up = torch.randn(33, 2 * 50, generator=g).to(dtype)

    def run(family):
        norm, rot, act = torch.empty(33, 96, dtype=dtype), torch.empty(4, 33, 32, dtype=dtype), torch.empty(33, 50, dtype=dtype)
        family.rms_norm_into(norm, x, w, 1e-6, torch.empty(33, 96))
        table = family.rope_table_dtype(dtype)
        family.rope_into(rot, src, angles.cos().to(table), angles.sin().to(table))
        family.swiglu_into(act, gate_up.clone())
        return norm, rot, act

    compiled = run(_compiled(kernels))
    assert ops.TorchOps().rope_table_dtype(dtype) == dtype
    fallback = run(ops.TorchOps())
    tol = 1e-5 if dtype == torch.float32 else 0.05  # the torch path rounds to bf16 between its passes
    for a, b in zip(compiled, fallback):
        assert (a.double() - b.double()).abs().max() < tol * max(1.0, b.double().abs().max().item())


# -- run-time ISA dispatch ------------------------------------------------------------------------


def test_build_does_not_depend_on_the_host_isa(kernels, monkeypatch):
    """One module name and one set of flags whatever the CPU's flags: an image built on one host
    loads the same file on any other, and nothing is compiled for the builder's ISA."""
    builds = []

    class Fake:
        def supported_isas(self):
            return ["avx2"]

        def set_default_isa(self, name):
            pass

    def fake_build(name, sources, flags):
        builds.append((name, tuple(sources), tuple(flags)))
        return Fake(), None

    monkeypatch.setattr(cpu_ext, "_build", fake_build)
    for flags in ({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}, {"avx2", "fma"}, {"sse2"}, set()):
        monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda flags=flags: set(flags))
        monkeypatch.setattr(cpu_ext, "_state", {})
        assert cpu_ext.load() is not None
    assert len(set(builds)) == 1, builds
    name, _, flags = builds[0]
    assert name == cpu_ext.OPS_MODULE and "avx" not in name
    assert not [f for f in flags if f.startswith(("-m", "-DCPU_CAPABILITY"))], flags
    # the real build: that name, and no ISA flags in the compile rule torch wrote for it
    so = Path(kernels.__file__)
    assert so.stem == cpu_ext.OPS_MODULE
    ninja = (so.parent / "build.ninja").read_text()
    cflags = [ln for ln in ninja.splitlines() if ln.startswith("cflags")]
    assert cflags and not any(tok.startswith(("-mavx", "-march", "-mfma", "-DCPU_CAPABILITY")) for tok in cflags[0].split()), cflags


def test_a_cpu_without_avx2_gets_the_torch_ops(monkeypatch):
    class NoIsa:
        def supported_isas(self):
            return []

    monkeypatch.setattr(cpu_ext, "_build", lambda name, sources, flags: (NoIsa(), None))
    monkeypatch.setattr(cpu_ext, "_state", {})
    assert cpu_ext.load() is None
    assert cpu_ext.why_unavailable() == "the CPU has neither AVX2+FMA nor AVX-512"
    assert type(ops.ops_for("cpu", torch.float32)) is ops.TorchOps  # the engine then takes the torch ops


def test_the_environment_forces_the_default_path(kernels, monkeypatch):
    seen = []

    class Fake:
        def supported_isas(self):
            return ["avx512", "avx2"]

        def set_default_isa(self, name):
            seen.append(name)

    monkeypatch.setattr(cpu_ext, "_build", lambda name, sources, flags: (Fake(), None))
    for forced in ("avx2", "auto"):
        monkeypatch.setattr(cpu_ext, "OPS_ISA", forced)
        monkeypatch.setattr(cpu_ext, "_state", {})
        cpu_ext.load()
    assert seen == ["avx2", "auto"]
    assert set(kernels.compiled_isas()) == set(ISA_FLAGS)
    assert kernels.supported_isas() == [i for i in kernels.compiled_isas() if i in kernels.supported_isas()]  # best first
    if cpu_ext._isa() == "auto" and kernels.supported_isas():
        assert kernels.active_isa() == kernels.supported_isas()[0]


@pytest.mark.parametrize("name", sorted(ISA_FLAGS))
def test_forcing_a_path_the_cpu_lacks_raises(kernels, name):
    if name in kernels.supported_isas():
        pytest.skip(f"this CPU has {', '.join(ISA_FLAGS[name])}: no missing {name} path to force")
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=f"lacks the {name} instructions"):
        kernels.rms_norm(x, torch.empty_like(x), torch.ones(16), 1e-5, name)


def test_an_unknown_path_raises(kernels):
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="unknown ISA 'sse9'"):
        kernels.swiglu(x, torch.empty(2, 8), "sse9")
    kernels.set_default_isa("sse9")
    try:
        with pytest.raises(RuntimeError, match="unknown ISA 'sse9'"):
            _compiled(kernels).rms_norm_into(torch.empty_like(x), x, torch.ones(16), 1e-5, torch.empty_like(x))
    finally:
        kernels.set_default_isa(cpu_ext._isa())


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max difference in units of the dtype's last place at each element's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.double().abs(), b.double().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return ((a.double() - b.double()).abs() / (eps * scale)).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paths_agree(kernels, both_paths, dtype):
    """AVX2 and AVX-512 on the same inputs: RoPE does the same float32 operations per element
    (bit-equal); RMSNorm sums its squares in another order and SwiGLU's reciprocal starts from
    another hardware estimate (a few float32 ulps, so at most one bf16 rounding apart)."""
    results = {}
    for name in ISA_FLAGS:
        outs = []
        for rows, n in ((3, 1), (5, 8), (7, 37), (4, 1000)):
            x = torch.randn(rows, n + 3, generator=torch.Generator().manual_seed(n)).to(dtype)[:, :n]
            w = 1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
            out = torch.empty(rows, n, dtype=dtype)
            kernels.rms_norm(x, out, w, 1e-5, name)
            outs.append(("rms_norm", out))
        for tokens, heads, d in ((3, 2, 8), (13, 3, 24), (9, 4, 64), (5, 2, 128)):
            gen = torch.Generator().manual_seed(d)
            src = torch.randn(tokens, heads, d, generator=gen).to(dtype)
            angles = torch.rand(tokens, d // 2, generator=gen) * 6.3
            dst = torch.empty(heads, tokens, d, dtype=dtype)
            kernels.rope(src, dst, angles.cos(), angles.sin(), name)
            outs.append(("rope", dst))
        for rows, f in ((2, 1), (3, 8), (9, 37), (4, 1000)):
            gate_up = (4 * torch.randn(rows, 2 * f, generator=torch.Generator().manual_seed(f))).to(dtype)
            out = torch.empty(rows, f, dtype=dtype)
            kernels.swiglu(gate_up, out, name)
            outs.append(("swiglu", out))
        results[name] = outs
    for (op, a), (_, b) in zip(results["avx2"], results["avx512"]):
        if op == "rope":
            assert torch.equal(a, b), op
        else:
            assert _ulps_apart(a, b) <= (8 if dtype == torch.float32 else 1), op


def test_silu_at_extreme_inputs(kernels, isa):
    special = torch.tensor([100.0, -100.0, 1e4, -1e4, 0.0, -0.0, 88.0, -88.0, 87.5, -87.5, 1e-30, -1e-30, 3e38, -3e38])
    f = special.numel() + 23  # a tail on both paths
    gate = torch.cat([special, torch.linspace(-90, 90, 23)])
    for dtype in (torch.float32, torch.bfloat16):
        g = gate.to(dtype)
        out = torch.empty(1, f, dtype=dtype)
        kernels.swiglu(torch.cat([g, torch.ones(f, dtype=dtype)])[None], out, isa)
        out = out[0].double()
        assert torch.isfinite(out).all(), out
        gd = g.double()
        for big in (100.0, 1e4, 3e38):
            i = (gate == big).nonzero()[0, 0]
            assert out[i] == gd[i], (big, out[i])  # silu(a) = a once e^-a is below a's last place
            j = (gate == -big).nonzero()[0, 0]
            assert out[j] <= 0 and out[j] > -1e-30, (-big, out[j])  # -0 or a tiny negative number
        assert out[4] == 0 and out[5] == 0
        want = gd * torch.sigmoid(gd)
        assert ((out - want).abs() <= TOL[dtype] * want.abs() + 1e-35).all(), (out - want).abs().max()


def test_silu_float32_accuracy_over_its_range(kernels, isa):
    """The exponential (a range-reduced polynomial) keeps float32 SwiGLU within a few ulps."""
    gate = torch.linspace(-87, 60, 200_003)
    out = torch.empty(1, gate.numel())
    kernels.swiglu(torch.cat([gate, torch.ones_like(gate)])[None], out, isa)
    want = gate.double() * torch.sigmoid(gate.double())
    rel = ((out[0].double() - want).abs() / want.abs().clamp_min(1e-37)).max().item()
    assert rel < 1e-6, rel


def test_bf16_rounding_matches_torch(kernels, isa):
    """bf16 rows give exactly the float32 path's result rounded by torch (nearest even), on whole
    vectors and tails; NaN stays NaN. SwiGLU's bf16 rows take a shorter exponential polynomial
    (4e-6 relative, far below bf16's 2^-9 rounding): within one bf16 ulp of it there."""
    g = torch.Generator().manual_seed(5)
    x16 = torch.randn(6, 37, generator=g).bfloat16()
    x16[2, 5] = float("nan")
    w = 1 + 0.3 * torch.randn(37, generator=g)
    out16, out32 = torch.empty(6, 37, dtype=torch.bfloat16), torch.empty(6, 37)
    kernels.rms_norm(x16, out16, w, 1e-5, isa)
    kernels.rms_norm(x16.float(), out32, w, 1e-5, isa)
    assert torch.isnan(out16[2]).all()
    torch.testing.assert_close(out16, out32.bfloat16(), rtol=0, atol=0, equal_nan=True)

    gate_up = (5 * torch.randn(4, 2 * 77, generator=g)).bfloat16()  # 2W-wide blocks, a W block and a tail
    gate_up[1, 3] = float("nan")
    s16, s32 = torch.empty(4, 77, dtype=torch.bfloat16), torch.empty(4, 77)
    kernels.swiglu(gate_up, s16, isa)
    kernels.swiglu(gate_up.float(), s32, isa)
    assert torch.isnan(s16[1, 3]) and torch.isnan(s32[1, 3])
    s16[1, 3] = s32[1, 3] = 0
    assert _ulps_apart(s16, s32.bfloat16()) <= 1

    src = torch.randn(7, 3, 24, generator=g).bfloat16()
    angles = torch.rand(7, 12, generator=g) * 6.3
    r16, r32 = torch.empty(3, 7, 24, dtype=torch.bfloat16), torch.empty(3, 7, 24)
    kernels.rope(src, r16, angles.cos(), angles.sin(), isa)
    kernels.rope(src.float(), r32, angles.cos(), angles.sin(), isa)
    assert torch.equal(r16, r32.bfloat16())
