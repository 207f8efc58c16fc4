"""Fused per-token kernels of the layer loop in the Triton language (CUDA; CPU under the interpreter).

Each is one pass over a chunk's rows, statistics and arithmetic in float32, one rounding to the
output dtype (the torch ops they replace take 2-6 passes):
  rms_norm      out = RMSNorm(x) * w
  add_rms_norm  h += delta (rounded to h's dtype, as torch's add_), then out = RMSNorm(h) * w
  rope_qkv      the fused QKV rows of one piece -> Q and K rotated (after Qwen3's per-head q/k
                norm when given) and V copied, written head-major into the workspace segments
  swiglu        out = silu(gate) * up from the fused [gate | up] rows
The wrappers in ops.py choose these when gpu_support.applies(); see there for the contracts.
"""

# no `from __future__ import annotations` here: triton < 3.3 reads tl.constexpr from real annotations
import torch
import triton
import triton.language as tl

from .gpu_support import interpreting


@triton.jit
def _rms_norm_kernel(X, Delta, Out, W, s_x, s_d, s_o, rows, n, eps, ADD: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # x stride passes 2^31 on long chunks
    cols = tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (cols < n)[None, :]
    x = tl.load(X + r[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    if ADD:  # the residual add, rounded to the stream's dtype before the norm reads it back
        delta = tl.load(Delta + r[:, None] * s_d + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(X + r[:, None] * s_x + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / n + eps)
    w = tl.load(W + cols, mask=cols < n, other=0.0)
    tl.store(Out + r[:, None] * s_o + cols[None, :], (xf * inv[:, None] * w[None, :]).to(Out.dtype.element_ty), mask=mask)


def _row_tiles(rows: int, n: int) -> tuple[int, int]:
    """(rows per program, padded width): one row of a wide hidden state per program, several
    narrow rows per program (~4K elements a program, fewer launches of tiny programs)."""
    block = triton.next_power_of_2(n)
    return max(1, min(64, 4096 // block)), block


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"expected rows with unit stride, got shape {tuple(t.shape)} strides {t.stride()}")
    return t


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight32: torch.Tensor, eps: float) -> torch.Tensor:
    """x, out [rows, n] (out may be x); weight32 [n] float32."""
    rows, n = _rows(x).shape
    _rows(out)
    if rows:
        per, block = _row_tiles(rows, n)
        _rms_norm_kernel[(triton.cdiv(rows, per),)](x, x, out, weight32, x.stride(0), 0, out.stride(0), rows, n, eps,
                                                    ADD=False, ROWS=per, BLOCK=block)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight32: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """h += delta; out = RMSNorm(h) * weight32. h, delta, out: [rows, n]."""
    rows, n = _rows(h).shape
    _rows(delta), _rows(out)
    if rows:
        per, block = _row_tiles(rows, n)
        _rms_norm_kernel[(triton.cdiv(rows, per),)](h, delta, out, weight32, h.stride(0), delta.stride(0), out.stride(0),
                                                    rows, n, eps, ADD=True, ROWS=per, BLOCK=block)
    return out


@triton.jit
def _rope_qkv_kernel(QKV, Cos, Sin, Qd, Kd, Vd, QW, KW,
                     s_row, s_cos, s_qh, s_qt, s_kh, s_kt, n, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                     QK_NORM: tl.constexpr, BT: tl.constexpr):
    """Program (token block, head): heads [0, HQ) are Q, [HQ, HQ + HKV) K, then V."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # 64-bit offsets: x strides pass 2^31
    head = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, HALF_P2)
    mask = (t < n)[:, None] & (c < HALF)[None, :]
    is_q = head < HQ
    is_v = head >= HQ + HKV
    col = head * 2 * HALF  # the fused row is [q heads | k heads | v heads]
    src = QKV + t[:, None] * s_row + col + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if is_v:
        dst = Vd + (head - HQ - HKV) * s_kh + t[:, None] * s_kt + c[None, :]
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)
    else:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if QK_NORM:  # Qwen3: per-head RMSNorm of q / k before RoPE, rounded as the torch path does
            inv = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)
            w = tl.where(is_q, QW, KW)
            w1 = tl.load(w + c, mask=c < HALF, other=0.0)
            w2 = tl.load(w + HALF + c, mask=c < HALF, other=0.0)
            a = (a * inv[:, None] * w1[None, :]).to(x1.dtype).to(tl.float32)
            b = (b * inv[:, None] * w2[None, :]).to(x1.dtype).to(tl.float32)
        cos = tl.load(Cos + t[:, None] * s_cos + c[None, :], mask=mask, other=0.0)
        sin = tl.load(Sin + t[:, None] * s_cos + c[None, :], mask=mask, other=0.0)
        if is_q:
            dst = Qd + head * s_qh + t[:, None] * s_qt + c[None, :]
        else:
            dst = Kd + (head - HQ) * s_kh + t[:, None] * s_kt + c[None, :]
        tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(dst + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rope_qkv(q_dst: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, heads: int, kv_heads: int, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """qkv [n, (heads + 2 kv_heads) * hd] fused rows -> q_dst [heads, n, hd], k_dst / v_dst
    [kv_heads, n, hd] (unit stride in hd; k and v with the same strides). cos, sin: [n, hd/2]
    float32. qk_norm = (q weight32, k weight32, eps) applies Qwen3's per-head norms first."""
    n = _rows(qkv).shape[0]
    hd = q_dst.shape[-1]
    if k_dst.stride() != v_dst.stride() or q_dst.stride(-1) != 1 or k_dst.stride(-1) != 1:
        raise ValueError("rope_qkv: k and v destinations need the same strides, all unit stride in head_dim")
    if cos.dtype != torch.float32 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("rope_qkv: cos/sin must be float32 with the same layout")
    if n == 0:
        return
    qw, kw, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    bt = 64 if interpreting() else 16  # fewer programs where each costs Python time
    _rope_qkv_kernel[(triton.cdiv(n, bt), heads + 2 * kv_heads)](
        qkv, cos, sin, q_dst, k_dst, v_dst, qw, kw,
        qkv.stride(0), cos.stride(0), q_dst.stride(0), q_dst.stride(1), k_dst.stride(0), k_dst.stride(1), n, eps,
        HQ=heads, HKV=kv_heads, HALF=hd // 2, HALF_P2=triton.next_power_of_2(hd // 2), QK_NORM=qk_norm is not None, BT=bt)


@triton.jit
def _swiglu_kernel(GU, Out, s_gu, s_o, rows, f, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # rows x 2F passes 2^31 above ~75K rows at 8B
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (cols < f)[None, :]
    at = GU + r[:, None] * s_gu + cols[None, :]
    g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(at + f, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + r[:, None] * s_o + cols[None, :], (g / (1.0 + tl.exp(-g)) * u).to(Out.dtype.element_ty), mask=mask)


def swiglu(out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """out [rows, F] = silu(gate) * up, gate_up [rows, 2F] = [gate | up] (left unchanged)."""
    rows, f2 = _rows(gate_up).shape
    _rows(out)
    if rows:
        per, block = _row_tiles(rows, min(f2 // 2, 1024))
        _swiglu_kernel[(triton.cdiv(rows, per), triton.cdiv(f2 // 2, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), rows, f2 // 2, ROWS=per, BLOCK=block)
    return out
