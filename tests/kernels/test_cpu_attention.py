"""The compiled CPU flash-attention kernel (src/kernels/cpu_attention.cpp) against an explicit
float64 softmax(QK^T)V with a bottom-right causal mask, and against torch SDPA, for every ISA
path this CPU can run. A path the CPU lacks is reported as skipped (not run), never as passed."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import cpu_ext
from prefillonly.kernels.attention import banded_attention, causal_attention, cpu_flash_attention, resolve_backend
from prefillonly.kernels.backend import KernelBackend

from ..reference import attention_float64 as reference


@pytest.fixture(scope="module")
def kernel():
    module = cpu_ext.load_attention()
    # every x86-64 host this suite runs on has gcc and at least AVX2: a build failure is a defect
    assert module is not None, f"CPU flash attention unavailable: {cpu_ext.why_attention_unavailable()}"
    return module


# Every variant of the kernel and the CPU flags it needs (cpu_attention.cpp's IsaEntry table):
# the float32-FMA paths, the bf16 pair path with its dot product emulated (runs on any host with
# the base ISA, so the pair layout is tested everywhere) and with the native instruction.
VARIANT_FLAGS = {"avx2": "avx2+fma", "avx512": "avx512f/bw/dq/vl", "avx2_pairs": "avx2+fma",
                 "avx512_pairs": "avx512f/bw/dq/vl", "avx512_bf16": "avx512_bf16"}
PAIR_PATHS = ("avx2_pairs", "avx512_pairs", "avx512_bf16")


def _variant(request, kernel):
    if request.param not in kernel.supported_isas():
        pytest.skip(f"this CPU lacks {VARIANT_FLAGS[request.param]}: the {request.param} path was not run")
    return request.param


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, kernel):
    """The float32-FMA paths (float32 and bfloat16 inputs)."""
    return _variant(request, kernel)


@pytest.fixture(params=list(VARIANT_FLAGS))
def any_isa(request, kernel):
    """Every variant, float32-FMA and pair paths."""
    return _variant(request, kernel)


@pytest.fixture(params=list(PAIR_PATHS))
def pair_isa(request, kernel):
    """The bf16 pair dot-product paths (bfloat16 inputs only)."""
    return _variant(request, kernel)


def inputs(hkv, group, lq, prefix, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lk = prefix + lq
    q = torch.randn(hkv * group, lq, d, generator=g).to(dtype)
    k = torch.randn(hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(hkv, lk, d, generator=g).to(dtype)
    return q, k, v


# (group, head_dim, queries, cached prefix): GQA ratios 1/3/8, head_dim 64/128, queries
# 1/7/64/513, prefixes 0/1/63/2048, chosen so every value meets the others at least once.
CASES = [(1, 64, 1, 0), (3, 64, 7, 0), (8, 128, 64, 1), (3, 64, 513, 0), (1, 128, 7, 63), (3, 64, 64, 2048),
         (8, 64, 1, 2048), (3, 128, 513, 63), (1, 64, 64, 1), (8, 128, 7, 2048)]


@pytest.mark.parametrize("group,d,lq,prefix", CASES)
def test_float32_within_1e5_of_float64(isa, group, d, lq, prefix):
    q, k, v = inputs(2, group, lq, prefix, d, torch.float32, seed=lq * 7 + prefix + d)
    got = cpu_flash_attention(q, k, v, d ** -0.5, isa=isa)
    assert (got.double() - reference(q, k, v, d ** -0.5)).abs().max().item() < 1e-5


@pytest.mark.parametrize("group,d,lq,prefix", CASES)
def test_bfloat16_error_within_1p5x_sdpa(isa, group, d, lq, prefix):
    q, k, v = inputs(2, group, lq, prefix, d, torch.bfloat16, seed=lq * 11 + prefix + d)
    want = reference(q, k, v, d ** -0.5)
    ours = (cpu_flash_attention(q, k, v, d ** -0.5, isa=isa).double() - want).abs().max().item()
    sdpa = (causal_attention(q, k, v, d ** -0.5, backend="sdpa").double() - want).abs().max().item()
    half_ulp = 2.0 ** -9 * want.abs().max().item()  # rounding the output to bf16 alone costs this much
    assert ours <= max(1.5 * sdpa, half_ulp), f"ours {ours:.2e} vs sdpa {sdpa:.2e}"


# Shapes that stress the pair layout: odd key counts (a key pair padded with zero), odd key-block
# ends, odd prefixes, 1 and 7 queries, head_dim 64 and 128, GQA 1/3/8, and a last block of one key.
PAIR_CASES = [(1, 64, 1, 0), (3, 64, 7, 0), (8, 128, 1, 1), (3, 64, 7, 64), (1, 128, 65, 0), (3, 64, 37, 29),
              (8, 64, 7, 2047), (3, 128, 130, 63), (1, 64, 513, 1), (3, 64, 1, 64 * 5)]


@pytest.mark.parametrize("group,d,lq,prefix", PAIR_CASES)
def test_pair_path_error_within_1p5x_sdpa(pair_isa, group, d, lq, prefix):
    q, k, v = inputs(2, group, lq, prefix, d, torch.bfloat16, seed=lq * 13 + prefix + d + group)
    want = reference(q, k, v, d ** -0.5)
    ours = (cpu_flash_attention(q, k, v, d ** -0.5, isa=pair_isa).double() - want).abs().max().item()
    sdpa = (causal_attention(q, k, v, d ** -0.5, backend="sdpa").double() - want).abs().max().item()
    half_ulp = 2.0 ** -9 * want.abs().max().item()
    assert ours <= max(1.5 * sdpa, half_ulp), f"ours {ours:.2e} vs sdpa {sdpa:.2e}"


@pytest.mark.parametrize("group,d,lq,prefix", PAIR_CASES[::3])
def test_native_pair_path_equals_its_portable_reference(kernel, group, d, lq, prefix):
    """The native instruction against the emulation of its documented semantics, same layout and
    rounding: they may differ only by float32 accumulation order (within 2 bf16 ulps)."""
    if "avx512_bf16" not in kernel.supported_isas():
        pytest.skip("this CPU lacks avx512_bf16: the native pair path was not run")
    q, k, v = inputs(2, group, lq, prefix, d, torch.bfloat16, seed=lq + prefix * 3 + d)
    native = cpu_flash_attention(q, k, v, d ** -0.5, isa="avx512_bf16").float()
    portable = cpu_flash_attention(q, k, v, d ** -0.5, isa="avx512_pairs").float()
    assert (native - portable).abs().max().item() <= 2.0 ** -7 * portable.abs().max().item()


def test_emulated_pair_paths_agree_across_isas(kernel):
    """The AVX2 and AVX-512 emulations do the same float32 operations in the same order: equal."""
    if not {"avx2_pairs", "avx512_pairs"} <= set(kernel.supported_isas()):
        pytest.skip("this CPU lacks avx512f/bw/dq/vl: only one emulated pair path runs here")
    q, k, v = inputs(3, 3, 45, 70, 64, torch.bfloat16, seed=21)
    assert torch.equal(cpu_flash_attention(q, k, v, 0.125, isa="avx2_pairs"), cpu_flash_attention(q, k, v, 0.125, isa="avx512_pairs"))


# Sliding windows (a query at t sees keys (t - window, t]): windows 1, 7, 64 and longer than the
# keys; prompts longer than the window with and without a cached prefix, prefixes crossing the
# window's edge and far longer than it (whole key blocks skipped), odd counts, GQA 1/3/8.
# (group, head_dim, queries, cached prefix, window)
WINDOW_CASES = [(1, 64, 37, 0, 1), (3, 64, 130, 0, 7), (8, 128, 65, 63, 64), (3, 64, 200, 100, 64), (1, 64, 7, 2048, 64),
                (3, 128, 513, 0, 1000), (8, 64, 1, 300, 7), (3, 64, 64, 61, 7), (1, 128, 129, 1, 64)]
SOFTCAPS = [0.0, 2.0, 50.0]  # 2.0 caps most scores of these inputs hard; 50 (Gemma 2's) barely


@pytest.mark.parametrize("group,d,lq,prefix,window", WINDOW_CASES)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_window_and_softcap_float32_within_1e5_of_float64(isa, group, d, lq, prefix, window, softcap):
    q, k, v = inputs(2, group, lq, prefix, d, torch.float32, seed=lq + prefix * 5 + window)
    want = reference(q, k, v, d ** -0.5, window=window, softcap=softcap)
    got = cpu_flash_attention(q, k, v, d ** -0.5, isa=isa, window=window, softcap=softcap)
    assert (got.double() - want).abs().max().item() < 1e-5
    fallback = banded_attention(q, k, v, d ** -0.5, window=window, softcap=softcap)
    assert (fallback.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("group,d,lq,prefix,window", WINDOW_CASES[::2])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_window_and_softcap_bfloat16_on_every_path(any_isa, group, d, lq, prefix, window, softcap):
    """bf16 on the float32-FMA and the pair paths: error within 1.5x the explicit path's own
    (bf16 inputs, float32 math, bf16 output) or half a bf16 ulp of the output."""
    q, k, v = inputs(2, group, lq, prefix, d, torch.bfloat16, seed=lq * 3 + prefix + window)
    want = reference(q, k, v, d ** -0.5, window=window, softcap=softcap)
    ours = (cpu_flash_attention(q, k, v, d ** -0.5, isa=any_isa, window=window, softcap=softcap).double() - want).abs().max().item()
    explicit = (banded_attention(q, k, v, d ** -0.5, window=window, softcap=softcap).double() - want).abs().max().item()
    half_ulp = 2.0 ** -9 * want.abs().max().item()
    assert ours <= max(1.5 * explicit, half_ulp), f"ours {ours:.2e} vs explicit {explicit:.2e}"


def keys_before_every_window_are_never_read(isa: str, dtype: torch.dtype) -> None:
    """Keys no query's window reaches are not loaded at all: NaNs there change nothing."""
    window, prefix, lq = 64, 1000, 50
    q, k, v = inputs(2, 3, lq, prefix, 64, dtype, seed=4)
    want = cpu_flash_attention(q, k, v, 0.125, isa=isa, window=window)
    unread = (prefix - window + 1) // 2 * 2  # the first key a query sees, rounded down to a key pair
    k[:, :unread], v[:, :unread] = float("nan"), float("nan")
    got = cpu_flash_attention(q, k, v, 0.125, isa=isa, window=window)
    assert torch.equal(got, want)


def test_keys_before_every_window_are_never_read(any_isa):
    keys_before_every_window_are_never_read(any_isa, torch.bfloat16)


def test_keys_before_every_window_are_never_read_float32(isa):
    keys_before_every_window_are_never_read(isa, torch.float32)


def test_window_as_long_as_the_keys_is_plain_causal(isa):
    q, k, v = inputs(2, 3, 40, 30, 64, torch.float32, seed=8)
    plain = cpu_flash_attention(q, k, v, 0.125, isa=isa)
    assert torch.equal(cpu_flash_attention(q, k, v, 0.125, isa=isa, window=70), plain)
    assert torch.equal(cpu_flash_attention(q, k, v, 0.125, isa=isa, window=10_000), plain)


def test_the_kernel_refuses_a_negative_window(kernel):
    q, k, v = inputs(1, 1, 4, 0, 64, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="window and softcap"):
        kernel.flash_attention(q, k, v, torch.empty_like(q), 0.1, "auto", 0, 0, -1, 0.0)


def test_banded_fallback_bounds_its_blocks_and_writes_over_q():
    """One query block of the fallback never holds an S x S score matrix; over q it equals the
    out-of-place result."""
    q, k, v = inputs(2, 3, 600, 0, 64, torch.float32, seed=3)
    want = banded_attention(q, k, v, 0.125, window=16)
    buf = q.clone()
    assert torch.equal(banded_attention(buf, k, v, 0.125, window=16, out=buf), want)


def test_pair_path_refuses_float32(kernel):
    q, k, v = inputs(1, 1, 4, 0, 64, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="bfloat16 inputs only"):
        kernel.flash_attention(q, k, v, torch.empty_like(q), 0.1, "avx2_pairs", 0, 0)


def writes_over_q_reading_strided_kv(isa: str, dtype: torch.dtype, prefix: int, seed: int) -> None:
    """The executor's layout: K/V are views of a longer buffer (a head stride larger than the
    rows), and the output goes over Q itself; the result equals the plain call's exactly."""
    q, k, v = inputs(3, 3, 45, prefix, 64, dtype, seed=seed)
    keys = 45 + prefix
    big_k, big_v = torch.zeros(3, 200, 64, dtype=dtype), torch.zeros(3, 200, 64, dtype=dtype)
    big_k[:, :keys], big_v[:, :keys] = k, v
    want = cpu_flash_attention(q, k, v, 0.125, isa=isa)
    buf = q.clone()
    out = cpu_flash_attention(buf, big_k[:, :keys], big_v[:, :keys], 0.125, out=buf, isa=isa)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, want)


def test_pair_path_writes_over_q_and_reads_strided_kv(pair_isa):
    writes_over_q_reading_strided_kv(pair_isa, torch.bfloat16, prefix=71, seed=6)  # odd: pairs end mid-buffer


@pytest.mark.parametrize("block_k", [1, 7, 64])
def test_pair_path_any_key_block(pair_isa, block_k):
    """Odd key blocks are rounded up to even ones (pairs never straddle blocks): same result."""
    q, k, v = inputs(2, 3, 20, 33, 64, torch.bfloat16, seed=block_k)
    want = reference(q, k, v, 0.125)
    out = torch.empty_like(q)
    cpu_ext.load_attention().flash_attention(q, k, v, out, 0.125, pair_isa, block_k, 0)
    assert (out.double() - want).abs().max().item() <= 2.0 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_over_q_and_reads_strided_kv(isa, dtype):
    writes_over_q_reading_strided_kv(isa, dtype, prefix=70, seed=5)


@pytest.mark.parametrize("inplace", [False, True])
def test_the_cpu_flash_path_runs_the_kernel_over_q(kernel, inplace):
    q, k, v = inputs(2, 3, 30, 40, 64, torch.bfloat16, seed=9)
    want = cpu_flash_attention(q, k, v, 0.125)
    buf = q.clone()
    path = KernelBackend(torch.device("cpu"), torch.bfloat16, 64, "cpu_flash").attention_path
    assert path.attend(buf, k, v, 0.125, inplace).data_ptr() == buf.data_ptr()  # over q whatever the step asks
    assert torch.equal(buf, want)


def test_exp2_polynomial_error(isa, kernel):
    """The kernel's 2^x for x <= 0: relative error under 3e-7 where 2^x is a normal float above
    2^-125, exactly 0 below that and for -inf (masked scores)."""
    x = torch.cat([-torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 125,
                   torch.tensor([0.0, -0.5, -1.0, -124.99])]).float()
    y = kernel.exp2_nonpositive(x, isa).double()
    want = torch.exp2(x.double())
    assert ((y - want).abs() / want).max().item() < 3e-7
    assert kernel.exp2_nonpositive(torch.tensor([float("-inf"), -125.5, -300.0]), isa).eq(0).all()


def test_auto_picks_the_kernel_and_falls_back_where_it_does_not_apply(kernel):
    assert resolve_backend("auto", torch.device("cpu")) == "cpu_flash"
    # head_dim 24 (not a multiple of 16) and float64 go to SDPA under the same backend name, decided
    # once for the model: its KernelBackend's path is torch's
    for d, dtype in ((24, torch.float32), (64, torch.float64)):
        q, k, v = inputs(2, 3, 9, 20, d, dtype, seed=d)
        path = KernelBackend(torch.device("cpu"), dtype, d, "cpu_flash").attention_path
        got = path.attend(q, k, v, 0.3)
        assert path.name == "torch" and torch.equal(got, causal_attention(q, k, v, 0.3, "sdpa"))
        assert (got.double() - reference(q, k, v, 0.3)).abs().max().item() < 1e-5


def test_bad_calls_are_clear_errors(kernel):
    q, k, v = inputs(2, 2, 8, 0, 64, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="unknown ISA"):
        kernel.flash_attention(q, k, v, torch.empty_like(q), 0.1, "sse9", 0, 0)
    with pytest.raises(RuntimeError, match="Lk >= Lq"):
        kernel.flash_attention(q, k[:, :4], v[:, :4], torch.empty_like(q), 0.1, "auto", 0, 0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernel.flash_attention(q, k.bfloat16(), v, torch.empty_like(q), 0.1, "auto", 0, 0)
    for isa in kernel.compiled_isas():
        if isa not in kernel.supported_isas():
            with pytest.raises(RuntimeError, match="lacks"):
                kernel.flash_attention(q, k, v, torch.empty_like(q), 0.1, isa, 0, 0)


# The variants an AVX512-BF16 CPU runs: the choice is tested against these flags on any host, and a
# variant this CPU lacks is answered by one it has with the same semantics (the native dot product
# by its emulation, tested equal above where both run; the AVX-512 emulation by the AVX2 one,
# bit-equal; the AVX-512 FMA path by the AVX2 one).
BF16_HOST = ["avx512_bf16", "avx512", "avx2", "avx512_pairs", "avx2_pairs"]
STAND_INS = {"avx512_bf16": "avx512_pairs", "avx512_pairs": "avx2_pairs", "avx512": "avx2"}


def _runner_of(kernel, corrupt: str | None = None):
    """run(isa, q, k, v) on the real kernel; `corrupt`'s output is perturbed (a native path that
    computes wrong numbers, as one written for an ISA could on a host that misreports it)."""
    def run(isa, q, k, v):
        real = isa
        while real not in kernel.supported_isas():
            real = STAND_INS[real]
        out = cpu_flash_attention(q, k, v, q.shape[-1] ** -0.5, isa=real)
        return out + 0.25 if isa == corrupt else out
    return run


def _host_without_native(kernel):
    return [isa for isa in kernel.supported_isas() if isa not in cpu_ext.NATIVE_ATTENTION]


def test_self_check_trusts_a_native_path_that_agrees(kernel):
    assert cpu_ext.choose_isa(BF16_HOST, torch.bfloat16, _runner_of(kernel)) == "avx512_bf16"
    assert cpu_ext.choose_isa(BF16_HOST, torch.float32, _runner_of(kernel)) == "avx512"  # fp32 never takes the pair path


def test_self_check_mismatch_falls_back_with_a_warning(kernel, caplog):
    with caplog.at_level("WARNING", logger=cpu_ext.log.name):
        chosen = cpu_ext.choose_isa(BF16_HOST, torch.bfloat16, _runner_of(kernel, corrupt="avx512_bf16"))
    assert chosen == "avx512"
    assert any("avx512_bf16" in r.getMessage() and "disagrees" in r.getMessage() for r in caplog.records)


def test_self_check_catches_non_finite_output(kernel):
    run = _runner_of(kernel)
    bad = lambda isa, q, k, v: run(isa, q, k, v) * (float("nan") if isa == "avx512_bf16" else 1.0)  # noqa: E731
    assert "non-finite" in cpu_ext.self_check_mismatch("avx512_bf16", "avx512_pairs", bad)


def test_without_native_flags_bf16_takes_the_fma_path(kernel):
    supported = _host_without_native(kernel)
    assert cpu_ext.choose_isa(supported, torch.bfloat16, _runner_of(kernel)) in ("avx512", "avx2")
    assert cpu_ext.choose_isa(["avx2", "avx2_pairs"], torch.bfloat16, _runner_of(kernel)) == "avx2"


def test_auto_variant_in_this_process(kernel):
    """What the engine runs here: the native pair path exactly when the CPU has it (and it passed
    its self-check, which it must on a real CPU), else the best float32-FMA path."""
    best_fma = next(isa for isa in ("avx512", "avx2") if isa in kernel.supported_isas())
    want = "avx512_bf16" if "avx512_bf16" in kernel.supported_isas() else best_fma
    assert cpu_ext.attention_isa(torch.bfloat16) == want
    assert cpu_ext.attention_isa(torch.float32) == best_fma


def test_scratch_bytes_count_the_packed_values(kernel):
    """The pair path also allocates V in key pairs (as large as V): the memory prediction's term."""
    base = kernel.scratch_bytes(64, 3, 3, 0, 2, "avx2", 0, 0)
    for isa in ("avx2_pairs",) + (("avx512_pairs",) if "avx512_pairs" in kernel.supported_isas() else ()):
        fixed = kernel.scratch_bytes(64, 3, 3, 0, 2, isa, 0, 0)
        assert kernel.scratch_bytes(64, 3, 3, 1001, 2, isa, 0, 0) - fixed == 4 * 3 * 501 * 64
    assert kernel.scratch_bytes(64, 3, 3, 1001, 2, "avx2", 0, 0) == base
