"""The kernels one engine runs, chosen once at start and asked by everyone after.

A KernelBackend fixes, for one model's dtype, device and head size:
  attention       the attention backend (kernels/attention.py's BACKENDS, "auto" resolved: timed on
                  CPU where it is timed);
  attention_path  the object that runs the model's attention under it (kernels/attention_paths.py,
                  the first of ATTENTION_PATHS that takes the model): "triton" (the whole batch in
                  one launch, output over Q, prefixes read from the pool in place), "cpu_flash" (the
                  compiled kernel, output over Q) or "torch" (SDPA / flash-attn / the banded path);
                  the executor attends with it and memory.py counts by it;
  linear, gemm    the GEMM backend (kernels/linear.py, "auto" timed on layer 0's weights) and the
                  one function its calls go through (the weights are packed for it at load);
  score_head      how the LM head computes the logits that become scores (kernels/score_head.py:
                  float32 from the model dtype's operands, self-checked);
  ops             the per-token op family (kernels/ops.py: compiled CPU, Triton or torch);
  self_check      where Triton kernels would run (CUDA): their start-up check against torch
                  (kernels/gpu_selfcheck.py); a kernel that failed it runs as torch (`on_torch`,
                  or the attention backend moved off "triton").
The executor computes with it and the memory prediction (memory.py) counts by it, asking it the
memory facts of each choice (the path's scratch, the GEMMs' and the score head's call bytes), so
the two can never disagree about which path a forward takes; neither tests a name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .attention import AttentionShape, flash_attn_available, resolve_backend
from .attention_paths import AttentionPath, CpuFlashAttention, TorchAttention, TritonAttention
from .linear import allocates_output, call_bytes as linear_call_bytes, gemm, resolve_linear_backend
from .ops import TorchOps, ops_for
from . import score_head as score_heads
from .gpu_selfcheck import ModelShapes, SelfCheck, run_self_check

# The attention paths, tried in order at construction: the first whose `build` takes the model
# runs its attention. A new attention backend is a class of attention_paths.AttentionPath's shape
# and its entry here; TorchAttention takes every model, so it stays last.
ATTENTION_PATHS: tuple[type[AttentionPath], ...] = (TritonAttention, CpuFlashAttention, TorchAttention)


@dataclass(frozen=True)
class KernelBackend:
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    attention: str = "sdpa"  # a concrete attention backend (not "auto")
    linear: str = "aten"  # a concrete linear backend (not "auto")
    score_head: str = ""  # a score head (kernels/score_head.py); "": the default for the dtype (score_heads.choose)
    on_torch: frozenset[str] = frozenset()  # Triton per-token kernels that failed their self-check: torch runs them
    self_check: SelfCheck | None = field(default=None, compare=False)  # None: no Triton kernel to check here
    attention_path: AttentionPath = field(init=False, compare=False)
    gemm: Callable = field(init=False, compare=False)  # (out, x, w, b) -> y: kernels.linear.gemm(linear)
    ops: TorchOps = field(init=False, compare=False)

    def __post_init__(self) -> None:
        device = torch.device(self.device)
        object.__setattr__(self, "device", device)
        built = (p.build(self.attention, device, self.dtype, self.head_dim) for p in ATTENTION_PATHS)
        object.__setattr__(self, "attention_path", next(p for p in built if p is not None))
        object.__setattr__(self, "gemm", gemm(self.linear))
        object.__setattr__(self, "ops", ops_for(device, self.dtype, self.on_torch))
        if not self.score_head:
            object.__setattr__(self, "score_head", score_heads.choose(device, self.dtype))

    @classmethod
    def choose(cls, device: torch.device, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int,
               attention: str = "auto", linear: str = "auto",
               projections: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
               head_dtype: str = "float32", model: ModelShapes | None = None) -> KernelBackend:
        """Resolve the configured backends for this model: an explicit one is checked (ValueError
        naming why it cannot run here), "auto" chosen (timed: attention at the model's heads,
        the GEMMs on `projections`, one layer's plain (weight, bias) pairs); the score head for
        `head_dtype` (self-checked). Where Triton kernels would run, each is checked against torch
        at `model`'s shapes first and one that fails runs as torch instead (gpu_selfcheck.py)."""
        resolved = resolve_backend(attention, device, AttentionShape(dtype, head_dim, q_heads, kv_heads))
        linear, head = resolve_linear_backend(linear, device, dtype, projections), score_heads.choose(device, dtype, head_dtype)
        unchecked = cls(device, dtype, head_dim, resolved, linear, head)
        triton_attention, triton_ops = unchecked.attention_path.name == "triton", unchecked.ops.name == "triton"
        if not (triton_attention or triton_ops):
            return unchecked
        model = model or ModelShapes(q_heads * head_dim, 4 * q_heads * head_dim)
        check = run_self_check(device, dtype, head_dim, q_heads, kv_heads, model, triton_attention, triton_ops)
        if triton_attention and check.attention_failed:
            resolved = "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
        return cls(device, dtype, head_dim, resolved, linear, head, check.failed_ops, check)

    @property
    def writes_over_q(self) -> bool:
        """Whether attention's output always replaces Q (the compiled and Triton kernels: free there)."""
        return self.attention_path.writes_over_q

    @property
    def linear_outputs(self) -> bool:
        """Whether the workspace holds the projections' outputs (False: the linear backend allocates them)."""
        return not allocates_output(self.linear)

    def norm_scratch(self, qk_norm: bool) -> bool:
        """Whether the workspace needs RMSNorm's float32 scratch for a model with (or without) q/k norms."""
        return self.ops.needs_norm_scratch(qk_norm)

    def linear_call_bytes(self, rows: int, out_features: int) -> int:
        """What one projection's call over `rows` rows allocates beyond the workspace (memory.py)."""
        return linear_call_bytes(self.linear, rows, out_features, self.dtype, self.device)

    def score_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 logits of normed rows x and the LM head w, on the score head."""
        return score_heads.logits(self.score_head, x, w, self.gemm)

    def score_head_bytes(self, rows: int, hidden: int, vocab: int) -> int:
        """The tensors one score-head call over `rows` rows allocates (its float32 logits and what the
        head adds on the way: score_head.call_bytes)."""
        return score_heads.call_bytes(self.score_head, rows, hidden, vocab, self.dtype.itemsize)

    def score_head_library_bytes(self, rows: int, vocab: int) -> int:
        """What that call allocates inside a GEMM library, unseen by torch (score_head.library_bytes)."""
        return score_heads.library_bytes(self.score_head, rows, vocab, self.dtype, self.device)

    @property
    def rope_dtype(self) -> torch.dtype:
        return self.ops.rope_table_dtype(self.dtype)
