"""Causal attention over a whole sequence (hybrid prefill never chunks attention).

This module holds the kernels and the choice among the configured backends; which kernel runs a
model's attention is decided once, by the attention path its KernelBackend picks
(kernels/attention_paths.py): the compiled kernel (`cpu_flash_attention`, output over Q), the
Triton kernel's batch launch (gpu_attention.BatchAttention: every sequence of the step at once), or
the torch paths, `causal_attention` (a new output tensor) or `causal_attention_inplace` (written
over Q: the memory-saving path, chosen per step). Queries may be a suffix of
the keys (cached prefix K/V followed by fresh K/V): query i sits at key position i + (Lk - Lq)
and sees keys 0..i + (Lk - Lq) (bottom-right-aligned causal mask).
No S x S mask is ever built (docs/design.md §13).

Backends:
  "cpu_flash"  our compiled flash-attention kernel (cpu_attention.cpp): whole prompts and
               cached-prefix suffixes in one pass, float32 / bfloat16, head_dim a multiple of 16
               up to 256; bf16 on the CPU's bf16 dot product where it has one (AVX512_BF16,
               self-checked), else float32 FMAs; it writes its output over Q (no second
               [Hq, S, D] tensor). Models it does not cover (other dtypes or head dims) run on sdpa.
  "triton"     our Triton-language kernel (gpu_attention.py), CUDA (or CPU under Triton's
               interpreter): the whole batch in one launch, cached prefixes read in place from
               the prefix pool's blocks, output over Q; bfloat16 / float16, head_dim a power of
               two 16..256. Models it does not cover run on sdpa.
  "sdpa"       torch scaled_dot_product_attention (CPU and CUDA).
  "flash_attn" flash-attn's flash_attn_func, CUDA only, when the package is importable
               (its causal mask is bottom-right aligned when Lq != Lk).
  "auto"       on CPU the faster of cpu_flash and sdpa for the model's attention shape, timed at
               start (choose_cpu_backend; cpu_flash where the kernel is built and no shape is given:
               on a Xeon with AMX torch's bf16 SDPA runs on AMX tiles, 2.2x our kernel there);
               triton on CUDA when the triton package imports (PREFILLONLY_TRITON_KERNELS=0
               turns it off), else flash_attn where available; else sdpa.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from . import cpu_ext, gpu_support

BACKENDS = ("auto", "sdpa", "flash_attn", "cpu_flash", "triton")
log = logging.getLogger("prefillonly")

# Bound on one query block's mask (elements) on the Lq != Lk path: the masked SDPA path
# materialises a [block, Lk] mask, so blocks keep it small at any key length.
_MASK_ELEMENTS = 1 << 22


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


_cpu_choices: dict[tuple, str] = {}  # choose_cpu_backend's timed pick per (shape, threads) in a process


@dataclass(frozen=True)
class AttentionShape:
    """What the timed choice of a CPU backend measures: the model's heads and dtype."""

    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int


def resolve_backend(backend: str, device: torch.device, shape: AttentionShape | None = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cpu":
            if cpu_ext.load_attention() is None:
                return "sdpa"
            if shape is not None and cpu_flash_covers(device, shape.dtype, shape.head_dim):
                return choose_cpu_backend(shape)
            return "cpu_flash"
        if device.type == "cuda" and gpu_support.runs_on(device):
            return "triton"
        return "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if backend == "flash_attn" and not (device.type == "cuda" and flash_attn_available()):
        raise ValueError("attention backend 'flash_attn' needs CUDA and the flash-attn package")
    if backend == "cpu_flash" and (device.type != "cpu" or cpu_ext.load_attention() is None):
        why = "it runs on CPU only" if device.type != "cpu" else cpu_ext.why_attention_unavailable()
        raise ValueError(f"attention backend 'cpu_flash' is unavailable: {why}")
    if backend == "triton" and not gpu_support.runs_on(device):
        why = ("PREFILLONLY_TRITON_KERNELS=0" if gpu_support.disabled_by_env() else
               "the triton package does not import" if gpu_support.triton_version() is None else
               "it runs on CUDA, or on CPU only under TRITON_INTERPRET=1")
        raise ValueError(f"attention backend 'triton' is unavailable: {why}")
    return backend


def choose_cpu_backend(shape: AttentionShape, time_of=None) -> str:
    """cpu_flash or sdpa, whichever attends faster on this CPU at the model's shape: a whole
    1,024-token prompt plus a 256-token suffix over a 1,024-token cached prefix, best of 3
    (~0.1 s at start). Measured, not assumed: the compiled kernel is 1.3-2.9x SDPA on AMD Zen4
    and AVX2 hosts, but torch's bf16 SDPA uses AMX tiles on Intel Xeons that have them.
    Timed once per process for a shape and thread count, as the GEMM library is (kernels/linear.py):
    two engines in one process then attend alike, where two close timings could otherwise pick
    differently under load and their float32 answers differ by rounding.
    `time_of(backend)` is injectable for tests."""
    key, timed_here = (shape, torch.get_num_threads()), time_of is None
    if timed_here and key in _cpu_choices:
        return _cpu_choices[key]
    time_of = time_of or (lambda backend: _time_backend(backend, shape))
    seconds = {b: time_of(b) for b in ("cpu_flash", "sdpa")}
    chosen = min(seconds, key=seconds.get)
    log.info("prefillonly: CPU attention backend %s (%s: cpu_flash %.1f ms, sdpa %.1f ms at head_dim %d, %d/%d heads)",
             chosen, str(shape.dtype).removeprefix("torch."), seconds["cpu_flash"] * 1e3, seconds["sdpa"] * 1e3,
             shape.head_dim, shape.q_heads, shape.kv_heads)
    if timed_here:
        _cpu_choices[key] = chosen
    return chosen


def _time_backend(backend: str, shape: AttentionShape, reps: int = 3) -> float:
    g = torch.Generator().manual_seed(3)
    make = lambda heads, n: torch.randn(heads, n, shape.head_dim, generator=g).to(shape.dtype)  # noqa: E731
    cases = [(make(shape.q_heads, 1024), make(shape.kv_heads, 1024), make(shape.kv_heads, 1024)),
             (make(shape.q_heads, 256), make(shape.kv_heads, 1280), make(shape.kv_heads, 1280))]
    scale = shape.head_dim ** -0.5
    total = 0.0
    attend = cpu_flash_attention if backend == "cpu_flash" else causal_attention  # the two candidates of choose_cpu_backend
    for q, k, v in cases:
        attend(q, k, v, scale)  # first call: scratch, page faults, lazy set-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            attend(q, k, v, scale)
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def cpu_flash_covers(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the compiled CPU kernel takes a model's attention of this dtype and head size (asked
    once, when its KernelBackend is built: the executor's Q/K/V always have the model's)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and head_dim % 16 == 0 and head_dim <= 256 and cpu_ext.load_attention() is not None)


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                        isa: str | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The compiled kernel: q [Hq, Lq, D], k/v [Hkv, Lk, D] -> out [Hq, Lq, D] (new, or the
    given `out`, which may be q itself). `isa` forces a kernel variant (cpu_ext.attention_isa:
    the CPU's best for q's dtype, or PREFILLONLY_CPU_ATTENTION_ISA). window > 0: a query at t sees
    keys (t - window, t] only (the keys before are never loaded); softcap > 0: scaled scores s
    become softcap * tanh(s / softcap)."""
    kernel = cpu_ext.load_attention()
    if kernel is None:
        raise RuntimeError(f"CPU flash attention unavailable: {cpu_ext.why_attention_unavailable()}")
    if out is None:
        out = torch.empty_like(q)
    with torch.profiler.record_function("prefillonly::cpu_flash_attention"):  # else profiles miss it (not an aten op)
        kernel.flash_attention(q, k, v, out, float(scale), isa or cpu_ext.attention_isa(q.dtype), 0, 0, int(window), float(softcap))
    return out


def cpu_flash_scratch_bytes(head_dim: int, group: int, kv_heads: int, keys: int, dtype: torch.dtype) -> int:
    """What one kernel call over `keys` keys allocates besides its output: per-thread Q/O/score
    tiles (and one K/V block, or on the bf16 pair path V packed in key pairs, as large as V)."""
    kernel = cpu_ext.load_attention()
    return kernel.scratch_bytes(head_dim, group, kv_heads, keys, torch.get_num_threads(), cpu_ext.attention_isa(dtype), 0, 0)


def _check_shapes(q, k) -> None:
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if lk < lq or hq % hkv:
        raise ValueError(f"bad attention shapes q={tuple(q.shape)} k={tuple(k.shape)}")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "sdpa",
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The torch paths: q: [Hq, Lq, D]; k, v: [Hkv, Lk, D] with Lk >= Lq and Hq % Hkv == 0. Returns
    [Hq, Lq, D]. backend: "flash_attn" runs flash-attn's kernel, any other SDPA (the compiled and
    Triton kernels are attention paths of their own: attention_paths.py). window > 0: a query at t
    sees keys (t - window, t] only; softcap > 0: soft-capped scores (the explicit banded path)."""
    _check_shapes(q, k)
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    if (window and window < lk) or softcap:
        return banded_attention(q, k, v, scale, window=window, softcap=softcap)
    if backend == "flash_attn":
        return _flash_attn(q, k, v, scale)
    gqa = hq != hkv
    if lq == lk:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0]
    if q.device.type == "cpu" and CPU_FLASH_WITH_LSE is not None:
        return _suffix_attention_merged(q, k, v, scale)
    return _suffix_attention_masked(q, k, v, scale)


# torch's CPU flash-attention op, which also returns each row's log-sum-exp (and takes GQA).
CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

INPLACE_QUERY_BLOCK = 512  # queries per step of causal_attention_inplace (its temporaries scale with it)


def inplace_attention_supported(device: torch.device) -> bool:
    return device.type == "cpu" and CPU_FLASH_WITH_LSE is not None


def causal_attention_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             block: int = INPLACE_QUERY_BLOCK, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """causal_attention on SDPA, written over q (CPU).

    A query block's output depends only on its own queries, so it can replace them: the
    request then never holds a second [Hq, Lq, D] tensor (the attention output). The compiled
    kernel does this at no cost (each task reads its queries before it writes them). On SDPA it
    goes one query block at a time, ~20% more attention time (two flash calls per block plus the
    merge), so the engine uses it there only when a prompt would not fit its budget otherwise.
    """
    _check_shapes(q, k)
    if (window and window < k.shape[1]) or softcap:
        return banded_attention(q, k, v, scale, window=window, softcap=softcap, out=q)
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
    merged by their log-sum-exp, instead of the masked path (about 2x slower per FLOP)."""
    return suffix_attention_with_lse(q, k, v, scale)[0].to(q.dtype)


def suffix_attention_with_lse(q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries = the last Lq of Lk positions, on CPU's flash op: (output [Hq, Lq, D] float32, each
    row's log-sum-exp [Hq, Lq]).

    part 1: every query sees all P = Lk - Lq prefix keys (no mask);
    part 2: the new keys, a square causal block (top-left == bottom-right when square).
    """
    p = k.shape[1] - q.shape[1]
    o_new, lse_new = CPU_FLASH_WITH_LSE(q[None], k[None, :, p:], v[None, :, p:], 0.0, True, scale=scale)
    if p == 0:
        return o_new[0].float(), lse_new[0].float()
    o_pre, lse_pre = CPU_FLASH_WITH_LSE(q[None], k[None, :, :p], v[None, :, :p], 0.0, False, scale=scale)
    return merge_partials(o_pre[0], lse_pre[0], o_new[0], lse_new[0])


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Two attention outputs of the same queries over disjoint key sets ([H, L, D], their
    log-sum-exps [H, L]) -> the output over both keys (float32) and its log-sum-exp."""
    lse = torch.logaddexp(lse1.float(), lse2.float())
    out = o1.float().mul_((lse1 - lse).exp_()[..., None])
    out.addcmul_(o2.float(), (lse2 - lse).exp_()[..., None])
    return out, lse


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


def _banded_block(hq: int, lq: int, lk: int, window: int) -> tuple[int, int]:
    """(queries per block, the most keys one block sees) of banded_attention. A block of b queries
    sees at most b + span - 1 keys: b (b + span) scores per head, all heads within _MASK_ELEMENTS
    (b <= budget / 2 span keeps b span small, b <= sqrt(budget / 2) b^2); one query always fits."""
    span = min(lk, window) if window else lk
    budget = max(2 * span, _MASK_ELEMENTS // hq)
    if not window:
        block = max(1, min(lq, budget // lk))
        return block, lk
    block = max(1, min(lq, budget // (2 * span), math.isqrt(budget // 2)))
    return block, min(lk, block + span - 1)


def banded_scratch_bytes(hq: int, hkv: int, head_dim: int, lq: int, lk: int, window: int) -> int:
    """What one banded_attention call allocates besides its output, at its largest block: Q as
    float32, K and V as float32 and repeated to every query head, the scores and their softmax,
    the mask, the block's float32 result and its cast."""
    block, keys = _banded_block(hq, lq, lk, window)
    return (4 * hq * block * head_dim * 3 + 2 * 4 * (hkv + hq) * keys * head_dim + 2 * 4 * hq * block * keys
            + block * keys)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with a sliding window and/or soft-capped scores where no kernel takes
    them (the explicit path: scores, cap, banded mask, float32 softmax), in query blocks over only
    the keys each block can see, so its temporaries stay bounded whatever the length (never an
    S x S matrix; banded_scratch_bytes says how much). Same contract as cpu_flash_attention; `out` may be q."""
    _check_shapes(q, k)
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    offset, g = lk - lq, hq // hkv
    out = torch.empty_like(q) if out is None else out
    block, _ = _banded_block(hq, lq, lk, window)
    for i0 in range(0, lq, block):
        i1 = min(lq, i0 + block)
        first = max(0, offset + i0 - window + 1) if window else 0
        end = offset + i1
        kb = k[:, first:end].float().repeat_interleave(g, 0)
        vb = v[:, first:end].float().repeat_interleave(g, 0)
        scores = q[:, i0:i1].float() @ kb.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        qpos = torch.arange(offset + i0, offset + i1, device=q.device)[:, None]
        kpos = torch.arange(first, end, device=q.device)[None, :]
        hidden = kpos > qpos
        if window:
            hidden |= qpos - kpos >= window
        out[:, i0:i1] = (scores.masked_fill_(hidden, float("-inf")).softmax(-1) @ vb).to(q.dtype)
    return out


def _flash_attn(q, k, v, scale):  # pragma: no cover - needs CUDA + flash-attn
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], softmax_scale=scale, causal=True)
    return out[0].transpose(0, 1)
