"""The LM head of the rows whose logits become scores: float32 logits from the model's own operands.

In bfloat16 a GEMM writes its output in bf16: at a logit of ~16 one bf16 step is 0.0625-0.125, so
distinct documents reranked collapse onto the same score (SmolLM2, 64 documents: 45 tied). Our
product is the probability, so every row that becomes one (the last row of a scored prompt or item,
log-likelihood spans, prompt-logprob rows) gets its logits from the bf16 normed rows and the bf16
weight with float32 sums and a float32 output; the body of the model stays in its dtype.

Heads (EngineConfig.head_dtype "float32", the default; "model" keeps the model dtype's GEMM and casts
after it, as before, for an A/B):
  "linear"     the layers' GEMM (kernels.linear): float32 models (already float32), or head_dtype "model".
  "cpu_amx"    CPU bf16 on AMX-BF16 tiles (Intel Xeon from Sapphire Rapids on; cpu_score_head_amx.h): the
               same sums on TDPBF16PS, the weight read in place as "cpu_pairs" reads it, x packed in
               k pairs per call; 3-6x "cpu_pairs" on many rows (oneDNN's bf16 GEMM runs on these tiles).
  "cpu_pairs"  CPU bf16: our compiled kernel (cpu_score_head.h) on the plain [vocab, hidden] weight:
               exact bf16 products summed in float32, no weight copy, no library buffer, and the same
               bits for a row whichever rows share the call (batch-invariant). Measured against
               MKL's bf16 x bf16 -> f32 GEMM (the one library call with a float32 output that torch
               ships): MKL packs the weight on every call and, below AVX512-BF16, converts the whole
               weight to float32 inside the call (114 MiB unseen by torch at SmolLM2's head).
  "out_dtype"  CUDA: torch.mm(x, w.T, out_dtype=float32), cuBLAS with a float32 output.
  "upcast"     anywhere else, and where the above fail their self-check: blocks of the weight
               converted to float32 (exact) and a float32 GEMM; slower, never wrong.
Each is checked once per process against float64 on small odd shapes before it is used.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import cpu_ext
from .linear import call_scratch_bytes, linear

HEAD_DTYPES = ("float32", "model")
HEADS = ("linear", "cpu_amx", "cpu_pairs", "out_dtype", "upcast")
_PAIR_HEADS = ("cpu_amx", "cpu_pairs")  # the compiled CPU kernels: they read whole bf16 pairs of each row
log = logging.getLogger("prefillonly")

_UPCAST_BLOCK_ROWS = 4096  # weight rows converted to float32 at a time by the upcast head (memory.py counts one block)


def choose(device: torch.device, dtype: torch.dtype, head_dtype: str = "float32") -> str:
    """The head for a model of `dtype` on `device` (see the module's docstring); each candidate is
    self-checked once per process, the first that passes is kept."""
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"unknown head_dtype {head_dtype!r}; choose one of {', '.join(HEAD_DTYPES)}")
    if dtype.itemsize >= 4 or head_dtype == "model":  # float32 (or float64) logits already
        return "linear"
    for head in _candidates(device.type, dtype):
        problem = _self_check(head, str(device), dtype)  # on the device itself (cuda:1 is not cuda:0)
        if problem is None:
            return head
        log.warning("prefillonly: score head %s failed its self-check (%s); trying the next", head, problem)
    return "upcast"


def _candidates(device_type: str, dtype: torch.dtype) -> list[str]:
    module = cpu_ext.load_attention() if device_type == "cpu" and dtype == torch.bfloat16 else None
    if module is not None:
        return ["cpu_amx", "cpu_pairs"] if module.amx_bf16() else ["cpu_pairs"]
    if device_type == "cuda":
        return ["out_dtype"]
    return []


@functools.lru_cache(maxsize=16)
def _self_check(head: str, device: str, dtype: torch.dtype) -> str | None:
    """None when `head` computes x @ w.T as float64 does to float32 summation error on small shapes
    (odd rows and vocabularies, a k with a tail, rows that are views), else what differed."""
    g = torch.Generator().manual_seed(46)
    try:
        for rows, k, vocab in ((1, 64, 37), (5, 98, 301), (9, 576, 130)):
            x = torch.randn(rows, k + 2, generator=g).to(dtype)[:, 1:-1]  # a view with a row stride of its own
            w = torch.randn(vocab, k, generator=g).to(dtype)
            got = logits(head, x.to(device), w.to(device)).double().cpu()
            want = x.double() @ w.double().t()
            bound = 1e-5 * (x.double().abs() @ w.double().abs().t()).max().item()
            err = (got - want).abs().max().item()
            if got.dtype != torch.float64 or not err <= bound:
                return f"max difference {err:.3g} over {bound:.3g} at {rows} x {k} x {vocab}"
    except (RuntimeError, TypeError, NotImplementedError) as e:  # an op the device or torch build lacks
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def logits(head: str, x: torch.Tensor, w: torch.Tensor, gemm=linear) -> torch.Tensor:
    """[rows, vocab] float32 logits of normed rows x [rows, hidden] (model dtype) and the LM head w
    ([vocab, hidden] plain; packed only for the "linear" head) on `head`; `gemm`: the "linear"
    head's GEMM (an engine's own, KernelBackend.gemm, whose layout its packed head has)."""
    if head == "linear":
        return gemm(None, x, w, None).float()
    if head in _PAIR_HEADS and not _in_pairs(w):
        head = "upcast"  # an odd hidden size (or a weight view off its pairs): exact all the same
    if head in _PAIR_HEADS:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        if not _in_pairs(x):
            x = x.clone(memory_format=torch.contiguous_format)  # a new, aligned tensor (a 1-row view counts as contiguous)
        isa = "amx_bf16" if head == "cpu_amx" else cpu_ext.attention_isa(torch.bfloat16)
        cpu_ext.load_attention().score_head(x, w, out, isa)
        return out
    if head == "out_dtype":
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    if head == "upcast":
        return _upcast_logits(x, w)
    raise ValueError(f"unknown score head {head!r}")


def _in_pairs(t: torch.Tensor) -> bool:
    """Whether the compiled kernels can read bf16 matrix `t` as 32-bit pairs: unit stride in a row of
    even length, an even row stride, 4-byte aligned."""
    return t.stride(1) == 1 and t.shape[1] % 2 == 0 and t.stride(0) % 2 == 0 and t.data_ptr() % 4 == 0


def _upcast_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float32, the weight converted _UPCAST_BLOCK_ROWS rows at a time (bf16 -> float32
    is exact: only the float32 sums round)."""
    xf = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for a in range(0, w.shape[0], _UPCAST_BLOCK_ROWS):
        torch.matmul(xf, w[a : a + _UPCAST_BLOCK_ROWS].float().t(), out=out[:, a : a + _UPCAST_BLOCK_ROWS])
    return out


def packs_weight(head: str) -> bool:
    """Whether the LM head's weight may be packed for the linear backend (only the "linear" head
    reads it through kernels.linear; the others read the plain [vocab, hidden] rows)."""
    return head == "linear"


def library_bytes(head: str, rows: int, vocab: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """What one call over `rows` rows allocates inside a GEMM library, unseen by torch: only the
    "linear" head goes through one (kernels.linear.call_scratch_bytes); the others allocate tensors."""
    return call_scratch_bytes(rows, vocab, dtype, device) if head == "linear" else 0


def call_bytes(head: str, rows: int, hidden: int, vocab: int, element_size: int) -> int:
    """Bytes one call over `rows` rows allocates: its float32 logits, and what it adds on the way
    (the model-dtype output before its cast on "linear" where that is not float32 already; the
    float32 rows and one float32 weight block on "upcast"; x packed in pairs, 16 rows at a time, on
    "cpu_amx"; an odd hidden size runs the pair heads as "upcast": `logits`)."""
    if head in _PAIR_HEADS and hidden % 2:
        head = "upcast"
    out = 4 * rows * vocab
    if head == "linear":
        return out + (element_size * rows * vocab if element_size != 4 else 0)
    if head == "upcast":
        return out + 4 * rows * hidden + 4 * min(vocab, _UPCAST_BLOCK_ROWS) * hidden
    if head == "cpu_amx":
        return out + 2 * 16 * -(-rows // 16) * hidden
    return out
