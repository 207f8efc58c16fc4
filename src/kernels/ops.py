"""Per-token fused ops of the hybrid-prefill layer loop (torch implementations).

Each writes into a caller-provided buffer where it can, so that one chunk's temporaries are
reused across chunks and layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics in float32 as transformers' LlamaRMSNorm."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def linear_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """out = x @ w.T (+ b), written into `out` ([rows, w.shape[0]])."""
    if b is None:
        return torch.matmul(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def add_linear_(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """acc += x @ w.T (+ b), in place: the residual add of o_proj and down_proj."""
    acc.addmm_(x, w.t())
    if b is not None:
        acc.add_(b)
    return acc


def rope_into(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE: dst = src * cos + rotate_half(src) * sin.

    src, dst: [heads, tokens, head_dim] (any strides); cos, sin: [tokens, head_dim / 2].
    dst must not overlap src.
    """
    half = src.shape[-1] // 2
    x1, x2 = src[..., :half], src[..., half:]
    d1, d2 = dst[..., :half], dst[..., half:]
    torch.mul(x1, cos, out=d1)
    d1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=d2)
    d2.addcmul_(x1, sin)


def silu_mul_(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU in place: gate_up [rows, 2F] -> returns view [rows, F] = silu(gate) * up."""
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :f], gate_up[:, f:]
    F.silu(gate, inplace=True)
    return gate.mul_(up)
