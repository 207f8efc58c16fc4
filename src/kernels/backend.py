"""The kernels one engine runs, chosen once at start and asked by everyone after.

A KernelBackend fixes, for one model's dtype, device and head size:
  attention       the attention backend (kernels/attention.py's BACKENDS, "auto" resolved: timed on
                  CPU where it is timed);
  attention_path  what actually runs the model's attention: "triton" (the whole batch in one
                  launch, output over Q, prefixes read from the pool in place), "cpu_flash" (the
                  compiled kernel, output over Q) or "torch" (SDPA / flash-attn / the banded path);
  linear          the GEMM backend (kernels/linear.py, "auto" timed on layer 0's weights);
  score_head      how the LM head computes the logits that become scores (kernels/score_head.py:
                  float32 from the model dtype's operands, self-checked);
  ops             the per-token op family (kernels/ops.py: compiled CPU, Triton or torch).
The executor computes with it and the memory prediction (memory.py) counts by it, so the two can
never disagree about which path a forward takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import (AttentionShape, causal_attention, causal_attention_inplace, cpu_flash_attention, cpu_flash_covers,
                        resolve_backend, triton_covers)
from .linear import allocates_output, resolve_linear_backend
from .ops import TorchOps, ops_for
from . import score_head as score_heads


@dataclass(frozen=True)
class KernelBackend:
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    attention: str = "sdpa"  # a concrete attention backend (not "auto")
    linear: str = "aten"  # a concrete linear backend (not "auto")
    score_head: str = ""  # a score head (kernels/score_head.py); "": the default for the dtype (score_heads.choose)
    attention_path: str = field(init=False)
    ops: TorchOps = field(init=False, compare=False)

    def __post_init__(self) -> None:
        device = torch.device(self.device)
        object.__setattr__(self, "device", device)
        if triton_covers(self.attention, device, self.dtype, self.head_dim):
            path = "triton"
        elif cpu_flash_covers(self.attention, device, self.dtype, self.head_dim):
            path = "cpu_flash"
        else:
            path = "torch"
        object.__setattr__(self, "attention_path", path)
        object.__setattr__(self, "ops", ops_for(device, self.dtype))
        if not self.score_head:
            object.__setattr__(self, "score_head", score_heads.choose(device, self.dtype))

    @classmethod
    def choose(cls, device: torch.device, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int,
               attention: str = "auto", linear: str = "auto",
               projections: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
               head_dtype: str = "float32") -> KernelBackend:
        """Resolve the configured backends for this model: an explicit one is checked (ValueError
        naming why it cannot run here), "auto" chosen (timed: attention at the model's heads,
        the GEMMs on `projections`, one layer's plain (weight, bias) pairs); the score head for
        `head_dtype` (self-checked)."""
        resolved = resolve_backend(attention, device, AttentionShape(dtype, head_dim, q_heads, kv_heads))
        return cls(device, dtype, head_dim, resolved, resolve_linear_backend(linear, device, dtype, projections),
                   score_heads.choose(device, dtype, head_dtype))

    @property
    def writes_over_q(self) -> bool:
        """Whether attention's output always replaces Q (the compiled and Triton kernels: free there)."""
        return self.attention_path != "torch"

    @property
    def linear_outputs(self) -> bool:
        """Whether the workspace holds the projections' outputs (False: the linear backend allocates them)."""
        return not allocates_output(self.linear)

    def norm_scratch(self, qk_norm: bool) -> bool:
        """Whether the workspace needs RMSNorm's float32 scratch for a model with (or without) q/k norms."""
        return self.ops.needs_norm_scratch(qk_norm)

    def score_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 logits of normed rows x and the LM head w, on the score head."""
        return score_heads.logits(self.score_head, x, w)

    @property
    def rope_dtype(self) -> torch.dtype:
        return self.ops.rope_table_dtype(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, inplace: bool, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """One sequence's causal attention on the compiled or torch paths (q [Hq, Lq, D], k/v
        [Hkv, Lk, D]): over q where the kernel writes there or `inplace` asks, else a new tensor.
        The Triton path attends the whole batch at once (gpu_attention.BatchAttention)."""
        if self.attention_path == "cpu_flash":
            return cpu_flash_attention(q, k, v, scale, out=q, window=window, softcap=softcap)
        if inplace:
            return causal_attention_inplace(q, k, v, scale, backend=self.attention, window=window, softcap=softcap)
        return causal_attention(q, k, v, scale, self.attention, window=window, softcap=softcap)
