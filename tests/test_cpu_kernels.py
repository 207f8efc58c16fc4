"""The compiled CPU kernels (src/kernels/cpu_*.cpp) against float64 references and against the
torch implementations they replace, on fresh random inputs of odd sizes and strided layouts."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import cpu_ext, ops


@pytest.fixture(scope="module")
def kernels():
    module = cpu_ext.load()
    # This machine class has gcc and the set-up installs ninja: a build failure is a defect here.
    assert module is not None, f"compiled CPU kernels failed to build: {cpu_ext.why_unavailable()}"
    return module


@pytest.fixture
def torch_ops(monkeypatch):
    """Forces the torch fallbacks of kernels/ops.py (as PREFILLONLY_CPU_KERNELS=0 does)."""
    monkeypatch.setattr(cpu_ext, "_state", {"module": None, "error": "forced off by the test"})


# bf16 tolerances: the kernels round once, so they must be as close to float64 as one bf16 rounding
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 8), (7, 37), (130, 576), (3, 1000)])
def test_rms_norm_matches_float64(kernels, dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    base = torch.randn(rows, n + 5, generator=g).to(dtype)  # row stride n + 5: a column slice, as the executor passes
    x = base[:, :n]
    w = 1 + 0.3 * torch.randn(n, generator=g)
    want = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    out = torch.empty(rows, n, dtype=dtype)
    ops.rms_norm_into(out, x, w, 1e-5, torch.empty(rows, n))
    assert _rel_err(out, want) < TOL[dtype]
    ops.rms_norm_into(x, x, w, 1e-5, torch.empty(rows, n))  # in place
    assert torch.equal(x, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,d", [(1, 1, 8), (13, 3, 24), (130, 9, 64), (5, 2, 128)])
def test_rope_matches_float64(kernels, dtype, tokens, heads, d):
    g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + d)
    rows = torch.randn(tokens, heads * d + 16, generator=g).to(dtype)  # a slice of a fused QKV row
    src = rows[:, : heads * d].view(tokens, heads, d).transpose(0, 1)  # [heads, tokens, d], as the executor passes
    angles = torch.rand(tokens, d // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = src.double()[..., : d // 2], src.double()[..., d // 2 :]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    dst = torch.empty(heads, tokens + 3, d, dtype=dtype)[:, 2 : 2 + tokens]  # a window of the full-length Q
    ops.rope_into(dst, src, cos.float(), sin.float())
    assert _rel_err(dst, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,f", [(1, 8), (9, 37), (64, 1536)])
def test_swiglu_matches_float64(kernels, dtype, rows, f):
    g = torch.Generator().manual_seed(rows * 10 + f)
    gate_up = (3 * torch.randn(rows, 2 * f, generator=g)).to(dtype)
    gate, up = gate_up.double()[:, :f], gate_up.double()[:, f:]
    want = gate * torch.sigmoid(gate) * up
    out = torch.empty(rows, f, dtype=dtype)
    ops.swiglu_into(out, gate_up)
    assert _rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ops_equal_the_torch_fallbacks(kernels, monkeypatch, dtype):
    """The same inputs through both implementations (the fallback runs where no compiler is)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(33, 96, generator=g).to(dtype), 1 + 0.2 * torch.randn(96, generator=g)
    src = torch.randn(33, 4, 32, generator=g).to(dtype).transpose(0, 1)
    angles = torch.rand(33, 16, generator=g) * 6
    gate_up = torch.randn(33, 2 * 50, generator=g).to(dtype)

    def run():
        norm, rot, act = torch.empty(33, 96, dtype=dtype), torch.empty(4, 33, 32, dtype=dtype), torch.empty(33, 50, dtype=dtype)
        ops.rms_norm_into(norm, x, w, 1e-6, torch.empty(33, 96))
        cos, sin = angles.cos().to(ops.rope_table_dtype(torch.device("cpu"), dtype)), angles.sin().to(ops.rope_table_dtype(torch.device("cpu"), dtype))
        ops.rope_into(rot, src, cos, sin)
        ops.swiglu_into(act, gate_up.clone())
        return norm, rot, act

    compiled = run()
    monkeypatch.setattr(cpu_ext, "_state", {"module": None, "error": "forced off"})
    assert ops.rope_table_dtype(torch.device("cpu"), dtype) == dtype
    fallback = run()
    tol = 1e-5 if dtype == torch.float32 else 0.05  # the torch path rounds to bf16 between its passes
    for a, b in zip(compiled, fallback):
        assert (a.double() - b.double()).abs().max() < tol * max(1.0, b.double().abs().max().item())
