"""The compiled CPU flash-attention kernel (src/kernels/cpu_attention.cpp) against an explicit
float64 softmax(QK^T)V with a bottom-right causal mask, and against torch SDPA, for every ISA
path this CPU can run. A path the CPU lacks is reported as skipped (not run), never as passed."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import cpu_ext
from prefillonly.kernels.attention import causal_attention, causal_attention_inplace, cpu_flash_attention, resolve_backend

from .reference import attention_float64 as reference


@pytest.fixture(scope="module")
def kernel():
    module = cpu_ext.load_attention()
    # every x86-64 host this suite runs on has gcc and at least AVX2: a build failure is a defect
    assert module is not None, f"CPU flash attention unavailable: {cpu_ext.why_attention_unavailable()}"
    return module


def isa_params():
    return [pytest.param(isa, id=isa) for isa in ("avx2", "avx512")]


@pytest.fixture(params=isa_params())
def isa(request, kernel):
    if request.param not in kernel.supported_isas():
        pytest.skip(f"this CPU lacks {request.param}: that path was not run")
    return request.param


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_over_q_and_reads_strided_kv(isa, dtype):
    """The executor's layout: K/V are views of a longer buffer (a head stride larger than the
    rows), and the output goes over Q itself."""
    q, k, v = inputs(3, 3, 45, 70, 64, dtype, seed=5)
    big_k, big_v = torch.zeros(3, 200, 64, dtype=dtype), torch.zeros(3, 200, 64, dtype=dtype)
    big_k[:, :115], big_v[:, :115] = k, v
    want = cpu_flash_attention(q, k, v, 0.125, isa=isa)
    buf = q.clone()
    out = cpu_flash_attention(buf, big_k[:, :115], big_v[:, :115], 0.125, out=buf, isa=isa)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, want)


def test_inplace_entry_point_uses_the_kernel_over_q(kernel):
    q, k, v = inputs(2, 3, 30, 40, 64, torch.bfloat16, seed=9)
    want = cpu_flash_attention(q, k, v, 0.125)
    buf = q.clone()
    assert causal_attention_inplace(buf, k, v, 0.125, backend="cpu_flash").data_ptr() == buf.data_ptr()
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
    # head_dim 24 (not a multiple of 16) and float64 go to SDPA under the same backend name
    for d, dtype in ((24, torch.float32), (64, torch.float64)):
        q, k, v = inputs(2, 3, 9, 20, d, dtype, seed=d)
        got = causal_attention(q, k, v, 0.3, backend="cpu_flash")
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
