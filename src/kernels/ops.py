"""Per-token fused ops of the hybrid-prefill layer loop.

Every op writes into a caller-provided buffer, so that one chunk's temporaries are allocated
once per request and reused by every chunk and layer: the request's memory is then exactly
the workspace (see workspace.py) plus attention's output, which memory.py predicts.

On CPU (float32 / bfloat16) RMSNorm, RoPE and SwiGLU run as one compiled pass each
(cpu_ops.cpp via cpu_ext); on CUDA (bfloat16 / float16) as Triton-language kernels
(gpu_ops.py; gpu_support says when); elsewhere, or when neither applies, as torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext, gpu_support


def compiled_ops(t: torch.Tensor):
    """The compiled CPU kernels when they apply to tensors like `t`, else None."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_ext.load()


def rms_norm_needs_scratch(device: torch.device, dtype: torch.dtype, qk_norm: bool) -> bool:
    """Whether rms_norm_into will use its float32 scratch: only on the torch path (no kernel
    here, or Qwen3's per-head q/k norms, which are 3-d views, on the compiled CPU path; the
    Triton path norms them inside rope_qkv_into). The workspace leaves the scratch out otherwise,
    so the memory prediction counts no buffer that is never touched."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if _gpu_ops(probe) is not None:
        return False
    return qk_norm or compiled_ops(probe) is None


def rope_table_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype rope_into wants its cos/sin tables in: float32 for the compiled and Triton kernels."""
    probe = torch.empty(0, device=device, dtype=dtype)
    return torch.float32 if compiled_ops(probe) is not None or gpu_support.applies(probe) else dtype


def _gpu_ops(t: torch.Tensor):
    """gpu_ops when its kernels take tensors like `t` and no compiled CPU kernel does (those
    keep precedence), else None: the one rule every wrapper below follows."""
    if compiled_ops(t) is None and gpu_support.applies(t):
        from . import gpu_ops  # imported where chosen: it imports triton, absent on most CPU hosts

        return gpu_ops
    return None


def _gpu_rows(*ts: torch.Tensor):
    """gpu_ops when its kernels take these 2-d row tensors, else None."""
    if all(t.dim() == 2 and t.stride(-1) == 1 for t in ts):
        return _gpu_ops(ts[0])
    return None


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
    fused = _gpu_rows(x, out)
    if fused is not None:
        return fused.rms_norm(out, x, weight32, eps)
    h = scratch32.copy_(x)
    inv_rms = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # sqrt(sum x^2)
    inv_rms.square_().div_(h.shape[-1]).add_(eps).rsqrt_()
    h.mul_(inv_rms)
    return torch.mul(h, weight32, out=out)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight32: torch.Tensor, eps: float, out: torch.Tensor,
                  scratch32: torch.Tensor) -> torch.Tensor:
    """h += delta, then out = RMSNorm(h) * weight (one pass on the Triton path): the residual
    add of o_proj followed by the post-attention norm."""
    fused = _gpu_rows(h, delta, out)
    if fused is not None:
        return fused.add_rms_norm(h, delta, weight32, eps, out)
    h.add_(delta)
    return rms_norm_into(out, h, weight32, eps, scratch32)


def rope_into(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE: dst = src * cos + rotate_half(src) * sin.

    src, dst: [heads, tokens, head_dim] (any strides, unit stride in head_dim for the compiled
    kernel); cos, sin: [tokens, head_dim / 2] (see rope_table_dtype). dst must not overlap src.
    """
    kernels = compiled_ops(src)
    if kernels is not None and cos.dtype == torch.float32 and src.stride(-1) == 1 and dst.stride(-1) == 1:
        kernels.rope(src.transpose(0, 1), dst, cos, sin)
        return
    _rope_torch(dst, src, cos, sin)


def _rope_torch(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    cos, sin = cos.to(src.dtype), sin.to(src.dtype)
    half = src.shape[-1] // 2
    x1, x2 = src[..., :half], src[..., half:]
    d1, d2 = dst[..., :half], dst[..., half:]
    torch.mul(x1, cos, out=d1)
    d1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=d2)
    d2.addcmul_(x1, sin)


def rope_qkv_into(q_dst: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, heads: int, kv_heads: int, qk_norm: tuple | None, scratch32: torch.Tensor) -> None:
    """The fused QKV rows of one piece ([n, (heads + 2 kv_heads) * hd]) into the workspace:
    q_dst [heads, n, hd] and k_dst [kv_heads, n, hd] rotated, v_dst copied. qk_norm =
    (q weight32, k weight32, eps): Qwen3's per-head RMSNorm of q and k first (on the torch path
    in place in qkv, through scratch32 [n, >= heads * hd] float32). One pass on the Triton path.
    cos/sin narrower than hd / 2 (a partial rotary factor, Phi-4-mini): only the leading 2 x their
    width dims of each head rotate, the rest are copied (torch ops: the fused kernels rotate whole heads)."""
    partial = 2 * cos.shape[-1] < q_dst.shape[-1]
    fused = None if partial else _gpu_ops(qkv)
    if fused is not None and cos.dtype == torch.float32:
        fused.rope_qkv(q_dst, k_dst, v_dst, qkv, cos, sin, heads, kv_heads, qk_norm)
        return
    n, hd = qkv.shape[0], q_dst.shape[-1]
    qw, kw = heads * hd, kv_heads * hd
    q = qkv[:, :qw].view(n, heads, hd)
    k = qkv[:, qw : qw + kw].view(n, kv_heads, hd)
    if qk_norm is not None:
        wq, wk, eps = qk_norm
        rms_norm_into(q, q, wq, eps, scratch32[:n, :qw].view(n, heads, hd))
        rms_norm_into(k, k, wk, eps, scratch32[:n, :kw].view(n, kv_heads, hd))
    if partial:
        rd = 2 * cos.shape[-1]
        for dst, src in ((q_dst, q.transpose(0, 1)), (k_dst, k.transpose(0, 1))):
            _rope_torch(dst[..., :rd], src[..., :rd], cos, sin)
            dst[..., rd:].copy_(src[..., rd:])
    else:
        rope_into(q_dst, q.transpose(0, 1), cos, sin)
        rope_into(k_dst, k.transpose(0, 1), cos, sin)
    v_dst.copy_(qkv[:, qw + kw :].view(n, kv_heads, hd).transpose(0, 1))


def gated_activation_into(out: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """out [rows, F] = act(gate) * up for gate_up [rows, 2F] = [gate | up]: silu (SwiGLU, compiled
    where it can be) or gelu_tanh (GeGLU, Gemma: in place on the gate, in its dtype as transformers)."""
    if activation == "silu":
        return swiglu_into(out, gate_up)
    if activation != "gelu_tanh":
        raise ValueError(f"unknown gated activation {activation!r}")
    f = gate_up.shape[-1] // 2
    gate = torch.ops.aten.gelu_(gate_up[:, :f], approximate="tanh")
    return torch.mul(gate, gate_up[:, f:], out=out)


def swiglu_into(out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """out [rows, F] = silu(gate) * up, where gate_up [rows, 2F] = [gate | up] (gate is
    overwritten, on the torch path). Writing a contiguous `out` lets down_proj read it without a copy."""
    kernels = compiled_ops(gate_up)
    if kernels is not None and gate_up.stride(-1) == 1 and out.stride(-1) == 1:
        kernels.swiglu(gate_up, out)
        return out
    fused = _gpu_rows(gate_up, out)
    if fused is not None:
        return fused.swiglu(out, gate_up)
    f = gate_up.shape[-1] // 2
    gate = F.silu(gate_up[:, :f], inplace=True)
    return torch.mul(gate, gate_up[:, f:], out=out)
