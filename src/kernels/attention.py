"""Causal attention over a whole sequence (hybrid prefill never chunks attention).

One entry point, `causal_attention`, used by the executor for every layer. Queries may be a
suffix of the keys (cached prefix K/V followed by fresh K/V): query i sits at key position
i + (Lk - Lq) and sees keys 0..i + (Lk - Lq) (bottom-right-aligned causal mask).
No S x S mask is ever built (DESIGN.md §8b).

Backends:
  "sdpa"       torch scaled_dot_product_attention (CPU and CUDA).
  "flash_attn" flash-attn's flash_attn_func, CUDA only, when the package is importable
               (its causal mask is bottom-right aligned when Lq != Lk).
  "auto"       flash_attn where available on CUDA, else sdpa.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

BACKENDS = ("auto", "sdpa", "flash_attn")

# Bound on one query block's mask (elements) on the Lq != Lk path: the masked SDPA path
# materialises a [block, Lk] mask, so blocks keep it small at any key length.
_MASK_ELEMENTS = 1 << 22


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if backend == "flash_attn" and not (device.type == "cuda" and flash_attn_available()):
        raise ValueError("attention backend 'flash_attn' needs CUDA and the flash-attn package")
    return backend


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "sdpa") -> torch.Tensor:
    """q: [Hq, Lq, D]; k, v: [Hkv, Lk, D] with Lk >= Lq and Hq % Hkv == 0. Returns [Hq, Lq, D]."""
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if lk < lq or hq % hkv:
        raise ValueError(f"bad attention shapes q={tuple(q.shape)} k={tuple(k.shape)}")
    if backend == "flash_attn":
        return _flash_attn(q, k, v, scale)
    gqa = hq != hkv
    if lq == lk:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0]
    if q.device.type == "cpu" and _CPU_FLASH_WITH_LSE is not None:
        return _suffix_attention_merged(q, k, v, scale)
    return _suffix_attention_masked(q, k, v, scale)


# torch's CPU flash-attention op, which also returns each row's log-sum-exp (and takes GQA).
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

INPLACE_QUERY_BLOCK = 512  # queries per step of causal_attention_inplace (its temporaries scale with it)


def inplace_attention_supported(device: torch.device) -> bool:
    return device.type == "cpu" and _CPU_FLASH_WITH_LSE is not None


def causal_attention_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             block: int = INPLACE_QUERY_BLOCK) -> torch.Tensor:
    """causal_attention, written over q one query block at a time (CPU).

    A query block's output depends only on its own queries, so it can replace them: the
    request then never holds a second [Hq, Lq, D] tensor (the attention output), only one
    block's temporaries. Costs ~20% more attention time (two flash calls per block plus the
    merge), so the engine uses it only when a prompt would not fit its memory budget otherwise.
    """
    lq = q.shape[1]
    p = k.shape[1] - lq
    for i0 in range(0, lq, block):
        i1 = min(lq, i0 + block)
        qb = q[:, i0:i1]
        if p + i0 == 0:  # the first block of an uncached prompt: plain square causal
            o = F.scaled_dot_product_attention(qb[None], k[None, :, :i1], v[None, :, :i1], is_causal=True, scale=scale,
                                               enable_gqa=q.shape[0] != k.shape[0])[0]
        else:
            o = _suffix_attention_merged(qb, k[:, : p + i1], v[:, : p + i1], scale)
        qb.copy_(o)
        del o
    return q


def _suffix_attention_merged(q, k, v, scale):
    """Queries = the last Lq of Lk positions, on CPU: two fast unmasked/causal flash calls
    merged by their log-sum-exp, instead of the masked path (about 2x slower per FLOP).

    part 1: every query sees all P = Lk - Lq prefix keys (no mask);
    part 2: the new keys, a square causal block (top-left == bottom-right when square).
    """
    p = k.shape[1] - q.shape[1]
    o_new, lse_new = _CPU_FLASH_WITH_LSE(q[None], k[None, :, p:], v[None, :, p:], 0.0, True, scale=scale)
    o_pre, lse_pre = _CPU_FLASH_WITH_LSE(q[None], k[None, :, :p], v[None, :, :p], 0.0, False, scale=scale)
    m = torch.maximum(lse_pre, lse_new)
    w_pre, w_new = (lse_pre - m).exp_(), (lse_new - m).exp_()
    total = w_pre + w_new
    out = o_pre[0].float().mul_((w_pre / total)[0, :, :, None])
    out.addcmul_(o_new[0].float(), (w_new / total)[0, :, :, None])
    return out.to(q.dtype)


def _suffix_attention_masked(q, k, v, scale):
    """Queries = the last Lq of Lk positions: query blocks, each over the keys it can see,
    with a bottom-right causal mask of at most _MASK_ELEMENTS elements."""
    hq, lq, _ = q.shape
    lk = k.shape[1]
    gqa = hq != k.shape[0]
    offset = lk - lq
    out = torch.empty_like(q)
    block = max(1, min(lq, _MASK_ELEMENTS // lk))
    for i0 in range(0, lq, block):
        i1 = min(lq, i0 + block)
        visible = offset + i1
        mask = causal_lower_right(i1 - i0, visible)
        out[:, i0:i1] = F.scaled_dot_product_attention(
            q[None, :, i0:i1], k[None, :, :visible], v[None, :, :visible], attn_mask=mask, scale=scale, enable_gqa=gqa
        )[0]
    return out


def _flash_attn(q, k, v, scale):  # pragma: no cover - needs CUDA + flash-attn
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], softmax_scale=scale, causal=True)
    return out[0].transpose(0, 1)
