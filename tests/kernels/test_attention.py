"""causal_attention against an explicit float64 softmax(QK^T)V with a bottom-right causal mask."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import attention as attn_mod
from prefillonly.kernels.attention import causal_attention, resolve_backend

from ..reference import attention_float64 as reference


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (37, 37), (1, 40), (13, 50), (31, 32)])
def test_matches_reference_fp32(hq, hkv, lq, lk):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q, k, v = (torch.randn(h, n, 16, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    got = causal_attention(q, k, v, scale=0.25)
    assert got.shape == q.shape
    assert (got.double() - reference(q, k, v, 0.25)).abs().max() < 1e-5


def test_suffix_queries_over_long_keys_use_several_blocks(monkeypatch):
    """Queries a suffix of many keys: split into query blocks whose masks stay small."""
    monkeypatch.setattr(attn_mod, "_MASK_ELEMENTS", 64 * 300)  # forces blocks of 64 queries
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 201, 8, generator=g), torch.randn(2, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g)
    assert (attn_mod._suffix_attention_masked(q, k, v, 0.3).double() - reference(q, k, v, 0.3)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_merged_and_masked_suffix_paths_agree(dtype, tol):
    """The CPU fast path (two flash calls merged by log-sum-exp) and the masked fallback."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 45, 32, generator=g), torch.randn(3, 130, 32, generator=g), torch.randn(3, 130, 32, generator=g)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want = reference(q.float(), k.float(), v.float(), 0.2)
    for path in (attn_mod._suffix_attention_merged, attn_mod._suffix_attention_masked):
        assert (path(q, k, v, 0.2).double() - want).abs().max() < tol


def test_bf16_close_to_reference():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(6, 70, 64, generator=g), torch.randn(2, 90, 64, generator=g), torch.randn(2, 90, 64, generator=g)
    got = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
    assert (got.double() - reference(q, k, v, 0.125)).abs().max() < 0.05


def test_bad_shapes_and_backends_are_clear_errors():
    with pytest.raises(ValueError, match="bad attention shapes"):
        causal_attention(torch.zeros(4, 10, 8), torch.zeros(4, 5, 8), torch.zeros(4, 5, 8), 1.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("magic", torch.device("cpu"))
    from prefillonly.kernels import cpu_ext

    assert resolve_backend("auto", torch.device("cpu")) == ("cpu_flash" if cpu_ext.load_attention() is not None else "sdpa")


@pytest.mark.parametrize("lq,lk", [(37, 37), (100, 100), (45, 130), (1, 60)])
def test_inplace_attention_equals_reference_and_overwrites_q(lq, lk):
    from prefillonly.kernels.attention import causal_attention_inplace

    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = torch.randn(6, lq, 16, generator=g), torch.randn(2, lk, 16, generator=g), torch.randn(2, lk, 16, generator=g)
    want = reference(q, k, v, 0.25)
    buf = q.clone()
    out = causal_attention_inplace(buf, k, v, 0.25, block=16)  # several blocks
    assert out.data_ptr() == buf.data_ptr()
    assert (out.double() - want).abs().max() < 1e-5


def test_auto_backend_on_cpu_is_the_faster_of_the_kernel_and_sdpa():
    from prefillonly.kernels.attention import AttentionShape, choose_cpu_backend

    shape = AttentionShape(torch.bfloat16, 64, 9, 3)
    assert choose_cpu_backend(shape, {"cpu_flash": 0.5, "sdpa": 1.0}.get) == "cpu_flash"
    assert choose_cpu_backend(shape, {"cpu_flash": 0.5, "sdpa": 0.2}.get) == "sdpa"  # as on a Xeon with AMX (bf16)
    # the real timing on this host: one of the two, and it really ran both (both are correct backends)
    assert resolve_backend("auto", torch.device("cpu"), shape) in ("cpu_flash", "sdpa")
    assert resolve_backend("cpu_flash", torch.device("cpu"), shape) == "cpu_flash"  # explicit: never timed


def test_auto_backend_on_cpu_is_timed_once_per_shape_in_a_process(monkeypatch):
    """Two engines of one process attend alike: the second asks the first's timing, not its own."""
    from prefillonly.kernels import attention

    timed = []
    monkeypatch.setattr(attention, "_cpu_choices", {})
    monkeypatch.setattr(attention, "_time_backend", lambda backend, shape: timed.append(backend) or len(timed))
    shape, other = attention.AttentionShape(torch.float32, 64, 4, 2), attention.AttentionShape(torch.float32, 32, 4, 2)
    first = attention.choose_cpu_backend(shape)
    assert first == "cpu_flash" and timed == ["cpu_flash", "sdpa"]  # the first timed is the faster here
    monkeypatch.setattr(attention, "_time_backend", lambda backend, shape: {"cpu_flash": 9.0, "sdpa": 1.0}[backend])
    assert attention.choose_cpu_backend(shape) == first  # not timed again
    assert attention.choose_cpu_backend(other) == "sdpa"  # another shape: its own timing
