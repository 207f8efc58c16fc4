"""Per-token fused ops of the hybrid-prefill layer loop.

Every op writes into a caller-provided buffer, so that one chunk's temporaries are allocated
once per request and reused by every chunk and layer: the request's memory is then exactly
the workspace (see workspace.py) plus attention's output, which memory.py predicts.

On CPU (float32 / bfloat16) RMSNorm, RoPE and SwiGLU run as one compiled pass each
(cpu_ops.cpp via cpu_ext); elsewhere, or when the kernels cannot be built, as torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext


def compiled_ops(t: torch.Tensor):
    """The compiled CPU kernels when they apply to tensors like `t`, else None."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_ext.load()


def rms_norm_needs_scratch(device: torch.device, dtype: torch.dtype, qk_norm: bool) -> bool:
    """Whether rms_norm_into will use its float32 scratch: only on the torch path (no compiled
    kernel here, or Qwen3's per-head q/k norms, which are 3-d views). The workspace leaves the
    scratch out otherwise, so the memory prediction counts no buffer that is never touched."""
    return qk_norm or compiled_ops(torch.empty(0, device=device, dtype=dtype)) is None


def rope_table_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype rope_into wants its cos/sin tables in: float32 for the compiled kernel."""
    return torch.float32 if compiled_ops(torch.empty(0, device=device, dtype=dtype)) is not None else dtype


def rms_norm_into(out: torch.Tensor, x: torch.Tensor, weight32: torch.Tensor, eps: float, scratch32: torch.Tensor) -> torch.Tensor:
    """out = RMSNorm(x) * weight, statistics in float32 (as transformers' LlamaRMSNorm).

    x, out: [..., n] (out may be x itself); weight32: [n] float32; scratch32: float32 buffer
    of x's shape. Two elementwise passes instead of the ~6 of a composite RMSNorm, which on
    CPU in bf16 cost more than the layer's matmuls; one with the compiled kernel (2-D rows).
    """
    kernels = compiled_ops(x)
    if kernels is not None and x.dim() == 2 and x.stride(-1) == 1 and out.stride(-1) == 1:
        kernels.rms_norm(x, out, weight32, eps)
        return out
    h = scratch32.copy_(x)
    inv_rms = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # sqrt(sum x^2)
    inv_rms.square_().div_(h.shape[-1]).add_(eps).rsqrt_()
    h.mul_(inv_rms)
    return torch.mul(h, weight32, out=out)


def linear_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """out = x @ w.T (+ b), written into `out` ([rows, w.shape[0]])."""
    if b is None:
        return torch.matmul(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def add_linear_(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tmp: torch.Tensor) -> torch.Tensor:
    """acc += x @ w.T (+ b) through the preallocated `tmp` ([rows, w.shape[0]]): the residual
    adds of o_proj and down_proj, without a hidden temporary."""
    acc.add_(linear_into(tmp, x, w, b))
    return acc


def rope_into(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE: dst = src * cos + rotate_half(src) * sin.

    src, dst: [heads, tokens, head_dim] (any strides, unit stride in head_dim for the compiled
    kernel); cos, sin: [tokens, head_dim / 2] (see rope_table_dtype). dst must not overlap src.
    """
    kernels = compiled_ops(src)
    if kernels is not None and cos.dtype == torch.float32 and src.stride(-1) == 1 and dst.stride(-1) == 1:
        kernels.rope(src.transpose(0, 1), dst, cos, sin)
        return
    cos, sin = cos.to(src.dtype), sin.to(src.dtype)
    half = src.shape[-1] // 2
    x1, x2 = src[..., :half], src[..., half:]
    d1, d2 = dst[..., :half], dst[..., half:]
    torch.mul(x1, cos, out=d1)
    d1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=d2)
    d2.addcmul_(x1, sin)


def swiglu_into(out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """out [rows, F] = silu(gate) * up, where gate_up [rows, 2F] = [gate | up] (gate is
    overwritten, on the torch path). Writing a contiguous `out` lets down_proj read it without a copy."""
    kernels = compiled_ops(gate_up)
    if kernels is not None and gate_up.stride(-1) == 1 and out.stride(-1) == 1:
        kernels.swiglu(gate_up, out)
        return out
    f = gate_up.shape[-1] // 2
    gate = F.silu(gate_up[:, :f], inplace=True)
    return torch.mul(gate, gate_up[:, f:], out=out)
