"""Hybrid-prefill executor: one forward pass over a prompt, logits for the last position only.

Per layer (DESIGN.md §2):
  A. per token chunk: RMSNorm -> fused QKV matmul -> (q/k norm) -> RoPE, written into the
     layer's full-length Q/K/V buffers;
  B. attention over the whole sequence at once (kernels.causal_attention);
  C. per token chunk: o_proj + residual add, RMSNorm, fused gate/up matmul, SwiGLU, down_proj
     + residual add, in place on the residual stream.
Only the residual stream [S, d], one layer's Q/K/V/attention output and one chunk's
temporaries are alive at once; K/V of a layer dies when its attention is done unless the
caller asked to capture a prefix of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.prefix_kv import PrefixKV
from .kernels import add_linear_, causal_attention, linear_into, rms_norm, rope_into, silu_mul_
from .model_spec import ModelSpec
from .rope import RotaryTable
from .weights import ModelWeights


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [vocab] float32, next-token logits after the last prompt position
    captured: PrefixKV | None  # K/V of the requested capture range, if any


class HybridPrefillExecutor:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, dtype: torch.dtype, device: torch.device, attention_backend: str = "sdpa"):
        self.spec = spec
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.attention_backend = attention_backend
        self.rotary = RotaryTable(spec, device)
        self.scale = spec.head_dim ** -0.5

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        chunk_size: int | None,
        prefix: PrefixKV | None = None,
        capture: tuple[int, int] | None = None,
    ) -> ForwardOutput:
        """Run the new tokens `token_ids` ([S] int64) after an optional cached `prefix`.

        chunk_size None (or >= S) means no chunking. `capture=(start, end)` returns the K/V of
        absolute positions [start, end) (prefix positions included) for the prefix cache.
        """
        spec, dt, dev = self.spec, self.dtype, self.device
        s = int(token_ids.shape[0])
        p = prefix.length if prefix is not None else 0
        total = p + s
        chunk = s if not chunk_size or chunk_size >= s else int(chunk_size)
        hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qw, kw = spec.q_width, spec.kv_width

        # full-length buffers of the request, reused by every layer
        hidden = self.weights.embed.index_select(0, token_ids.to(dev))  # [S, d] residual stream
        q_buf = torch.empty(hq, s, hd, dtype=dt, device=dev)
        k_buf = torch.empty(hkv, total, hd, dtype=dt, device=dev)
        v_buf = torch.empty(hkv, total, hd, dtype=dt, device=dev)
        # one chunk's temporaries, reused by every chunk
        qkv = torch.empty(chunk, spec.qkv_width, dtype=dt, device=dev)
        o_rows = torch.empty(chunk, qw, dtype=dt, device=dev)
        gate_up = torch.empty(chunk, 2 * spec.intermediate_size, dtype=dt, device=dev)
        rope = [self.rotary.cos_sin(p + c0, p + min(s, c0 + chunk), dt) for c0 in range(0, s, chunk)]

        captured = PrefixKV([], []) if capture else None
        for li, layer in enumerate(self.weights.layers):
            if prefix is not None:
                k_buf[:, :p].copy_(prefix.keys[li])
                v_buf[:, :p].copy_(prefix.values[li])
            # A. per-token: norm, QKV, RoPE -> full-length Q/K/V
            for ci, c0 in enumerate(range(0, s, chunk)):
                c1 = min(s, c0 + chunk)
                n = c1 - c0
                x = rms_norm(hidden[c0:c1], layer.input_norm, spec.rms_norm_eps)
                out = linear_into(qkv[:n], x, layer.wqkv, layer.bqkv)
                q = out[:, :qw].view(n, hq, hd).transpose(0, 1)
                k = out[:, qw : qw + kw].view(n, hkv, hd).transpose(0, 1)
                v = out[:, qw + kw :].view(n, hkv, hd).transpose(0, 1)
                if layer.q_norm is not None:
                    q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)
                    k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)
                cos, sin = rope[ci]
                rope_into(q_buf[:, c0:c1], q, cos, sin)
                rope_into(k_buf[:, p + c0 : p + c1], k, cos, sin)
                v_buf[:, p + c0 : p + c1].copy_(v)
            if captured is not None:
                start, end = capture
                captured.keys.append(k_buf[:, start:end].clone())
                captured.values.append(v_buf[:, start:end].clone())
            # B. attention over the whole sequence (queries are the last S of `total` keys)
            attn = causal_attention(q_buf, k_buf, v_buf, self.scale, self.attention_backend)  # [Hq, S, hd]
            # C. per-token: o_proj + residual, norm, SwiGLU MLP + residual
            for c0 in range(0, s, chunk):
                c1 = min(s, c0 + chunk)
                n = c1 - c0
                h = hidden[c0:c1]
                o_rows[:n].view(n, hq, hd).copy_(attn[:, c0:c1].transpose(0, 1))
                add_linear_(h, o_rows[:n], layer.wo, layer.bo)
                x = rms_norm(h, layer.post_norm, spec.rms_norm_eps)
                act = silu_mul_(linear_into(gate_up[:n], x, layer.w_gate_up, layer.b_gate_up))
                add_linear_(h, act, layer.w_down, layer.b_down)
            del attn

        last = rms_norm(hidden[-1:], self.weights.final_norm, spec.rms_norm_eps)  # [1, d]
        logits = (last @ self.weights.lm_head.t()).float()[0]  # [vocab]: one row, never S x vocab
        return ForwardOutput(logits=logits, captured=captured)
