"""Per-token fused ops of the hybrid-prefill layer loop, as three families chosen once per engine.

Every op writes into a caller-provided buffer, so that one chunk's temporaries are allocated
once per request and reused by every chunk and layer: the request's memory is then exactly
the workspace (see workspace.py) plus attention's output, which memory.py predicts.

  TorchOps        torch ops: any device and dtype (the reference the others are tested against);
  CompiledCpuOps  CPU float32 / bfloat16: RMSNorm, RoPE and SwiGLU as one compiled pass each
                  (cpu_ops.cpp via cpu_ext);
  TritonOps       CUDA bfloat16 / float16 (gpu_support says when): Triton-language kernels
                  (gpu_ops.py), RMSNorm fused with the residual add, RoPE with the q/k norm.

`ops_for(device, dtype)` is the one choice (the compiled CPU kernels keep precedence over the
Triton interpreter on CPU); the engine makes it once, at start (kernels/backend.py). A faster
family still takes its torch path for a call whose layout its kernel does not take (a 3-d view,
a non-unit inner stride, a partial rotary factor): those checks are per call, the family is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext, gpu_support


def _rows(*ts: torch.Tensor) -> bool:
    """Whether these are 2-d row tensors with unit inner stride (what the fused row kernels take)."""
    return all(t.dim() == 2 and t.stride(-1) == 1 for t in ts)


class TorchOps:
    """The torch-op implementations: any device, any dtype."""

    name = "torch"

    def needs_norm_scratch(self, qk_norm: bool) -> bool:
        """Whether rms_norm_into uses its float32 scratch for this model (the workspace plans it
        only then, so the memory prediction counts no buffer that is never touched)."""
        return True

    def rope_table_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype rope_into wants its cos/sin tables in."""
        return dtype

    def rms_norm_into(self, out: torch.Tensor, x: torch.Tensor, weight32: torch.Tensor, eps: float,
                      scratch32: torch.Tensor) -> torch.Tensor:
        """out = RMSNorm(x) * weight, statistics in float32 (as transformers' LlamaRMSNorm).

        x, out: [..., n] (out may be x itself); weight32: [n] float32; scratch32: float32 buffer
        of x's shape. Two elementwise passes instead of the ~6 of a composite RMSNorm, which on
        CPU in bf16 cost more than the layer's matmuls.
        """
        h = scratch32.copy_(x)
        inv_rms = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # sqrt(sum x^2)
        inv_rms.square_().div_(h.shape[-1]).add_(eps).rsqrt_()
        h.mul_(inv_rms)
        return torch.mul(h, weight32, out=out)

    def add_rms_norm_(self, h: torch.Tensor, delta: torch.Tensor, weight32: torch.Tensor, eps: float, out: torch.Tensor,
                      scratch32: torch.Tensor) -> torch.Tensor:
        """h += delta, then out = RMSNorm(h) * weight: the residual add of o_proj followed by the
        post-attention norm."""
        h.add_(delta)
        return self.rms_norm_into(out, h, weight32, eps, scratch32)

    def rope_into(self, dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE: dst = src * cos + rotate_half(src) * sin.

        src, dst: [heads, tokens, head_dim] (any strides); cos, sin: [tokens, head_dim / 2]
        (see rope_table_dtype). dst must not overlap src.
        """
        cos, sin = cos.to(src.dtype), sin.to(src.dtype)
        half = src.shape[-1] // 2
        x1, x2 = src[..., :half], src[..., half:]
        d1, d2 = dst[..., :half], dst[..., half:]
        torch.mul(x1, cos, out=d1)
        d1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=d2)
        d2.addcmul_(x1, sin)

    def rope_qkv_into(self, q_dst: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, qkv: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, qk_norm: tuple | None,
                      scratch32: torch.Tensor) -> None:
        """The fused QKV rows of one piece ([n, (heads + 2 kv_heads) * hd]) into the workspace:
        q_dst [heads, n, hd] and k_dst [kv_heads, n, hd] rotated, v_dst copied. qk_norm =
        (q weight32, k weight32, eps): Qwen3's per-head RMSNorm of q and k first (in place in qkv,
        through scratch32 [n, >= heads * hd] float32). cos/sin narrower than hd / 2 (a partial
        rotary factor, Phi-4-mini): only the leading 2 x their width dims of each head rotate, the
        rest are copied."""
        n, hd = qkv.shape[0], q_dst.shape[-1]
        qw, kw = heads * hd, kv_heads * hd
        q = qkv[:, :qw].view(n, heads, hd)
        k = qkv[:, qw : qw + kw].view(n, kv_heads, hd)
        if qk_norm is not None:
            wq, wk, eps = qk_norm
            self.rms_norm_into(q, q, wq, eps, scratch32[:n, :qw].view(n, heads, hd))
            self.rms_norm_into(k, k, wk, eps, scratch32[:n, :kw].view(n, kv_heads, hd))
        if _partial_rotary(cos, q_dst):
            rd = 2 * cos.shape[-1]
            for dst, src in ((q_dst, q.transpose(0, 1)), (k_dst, k.transpose(0, 1))):
                TorchOps.rope_into(self, dst[..., :rd], src[..., :rd], cos, sin)
                dst[..., rd:].copy_(src[..., rd:])
        else:
            self.rope_into(q_dst, q.transpose(0, 1), cos, sin)
            self.rope_into(k_dst, k.transpose(0, 1), cos, sin)
        v_dst.copy_(qkv[:, qw + kw :].view(n, kv_heads, hd).transpose(0, 1))

    def gated_activation_into(self, out: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """out [rows, F] = act(gate) * up for gate_up [rows, 2F] = [gate | up]: silu (SwiGLU) or
        gelu_tanh (GeGLU, Gemma: in place on the gate, in its dtype as transformers)."""
        if activation == "silu":
            return self.swiglu_into(out, gate_up)
        if activation != "gelu_tanh":
            raise ValueError(f"unknown gated activation {activation!r}")
        f = gate_up.shape[-1] // 2
        gate = torch.ops.aten.gelu_(gate_up[:, :f], approximate="tanh")
        return torch.mul(gate, gate_up[:, f:], out=out)

    def swiglu_into(self, out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """out [rows, F] = silu(gate) * up, where gate_up [rows, 2F] = [gate | up] (gate is
        overwritten). Writing a contiguous `out` lets down_proj read it without a copy."""
        f = gate_up.shape[-1] // 2
        gate = F.silu(gate_up[:, :f], inplace=True)
        return torch.mul(gate, gate_up[:, f:], out=out)


def _partial_rotary(cos: torch.Tensor, q_dst: torch.Tensor) -> bool:
    return 2 * cos.shape[-1] < q_dst.shape[-1]


class CompiledCpuOps(TorchOps):
    """The compiled CPU kernels (float32 / bfloat16 on an AVX2 or AVX-512 CPU): one pass each."""

    name = "compiled"

    def __init__(self, kernels):
        self.kernels = kernels  # the cpu_ext module

    def needs_norm_scratch(self, qk_norm: bool) -> bool:
        return qk_norm  # Qwen3's per-head q/k norms are 3-d views: the torch path

    def rope_table_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def rms_norm_into(self, out, x, weight32, eps, scratch32):
        if _rows(x, out):
            self.kernels.rms_norm(x, out, weight32, eps)
            return out
        return super().rms_norm_into(out, x, weight32, eps, scratch32)

    def rope_into(self, dst, src, cos, sin):
        if cos.dtype == torch.float32 and src.stride(-1) == 1 and dst.stride(-1) == 1:
            self.kernels.rope(src.transpose(0, 1), dst, cos, sin)
            return
        super().rope_into(dst, src, cos, sin)

    def swiglu_into(self, out, gate_up):
        if gate_up.stride(-1) == 1 and out.stride(-1) == 1:
            self.kernels.swiglu(gate_up, out)
            return out
        return super().swiglu_into(out, gate_up)


class TritonOps(TorchOps):
    """The Triton-language kernels (CUDA bfloat16 / float16; CPU only under the interpreter)."""

    name = "triton"

    def __init__(self, on_torch: frozenset[str] = frozenset()):
        """on_torch: the kernels (gpu_selfcheck.OP_KERNELS names) that failed the start-up
        self-check and run as TorchOps for this engine's life."""
        from . import gpu_ops  # imported where chosen: it imports triton, absent on most CPU hosts

        self.kernels = gpu_ops
        self.on_torch = on_torch

    def needs_norm_scratch(self, qk_norm: bool) -> bool:
        # the q/k norms run inside rope_qkv; RMSNorm's own kernel needs no scratch either
        return (qk_norm and "rope_qkv" in self.on_torch) or bool({"rms_norm", "add_rms_norm"} & self.on_torch)

    def rope_table_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def rms_norm_into(self, out, x, weight32, eps, scratch32):
        if _rows(x, out) and "rms_norm" not in self.on_torch:
            return self.kernels.rms_norm(out, x, weight32, eps)
        return super().rms_norm_into(out, x, weight32, eps, scratch32)

    def add_rms_norm_(self, h, delta, weight32, eps, out, scratch32):
        if _rows(h, delta, out) and "add_rms_norm" not in self.on_torch:
            return self.kernels.add_rms_norm(h, delta, weight32, eps, out)
        return super().add_rms_norm_(h, delta, weight32, eps, out, scratch32)

    def rope_qkv_into(self, q_dst, k_dst, v_dst, qkv, cos, sin, heads, kv_heads, qk_norm, scratch32):
        if not _partial_rotary(cos, q_dst) and cos.dtype == torch.float32 and "rope_qkv" not in self.on_torch:
            self.kernels.rope_qkv(q_dst, k_dst, v_dst, qkv, cos, sin, heads, kv_heads, qk_norm)
            return
        super().rope_qkv_into(q_dst, k_dst, v_dst, qkv, cos, sin, heads, kv_heads, qk_norm, scratch32)

    def swiglu_into(self, out, gate_up):
        if _rows(gate_up, out) and "swiglu" not in self.on_torch:
            return self.kernels.swiglu(out, gate_up)
        return super().swiglu_into(out, gate_up)


def ops_for(device: torch.device | str, dtype: torch.dtype, on_torch: frozenset[str] = frozenset()) -> TorchOps:
    """The fastest op family for tensors of this device and dtype: the compiled CPU kernels where
    they take them, else the Triton kernels where they run (but `on_torch`, the ones that failed
    their self-check), else the torch ops."""
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        kernels = cpu_ext.load()
        if kernels is not None:
            return CompiledCpuOps(kernels)
    if dtype in gpu_support.KERNEL_DTYPES and gpu_support.runs_on(device):
        return TritonOps(on_torch)
    return TorchOps()
