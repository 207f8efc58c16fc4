"""Hybrid-prefill executor: one forward pass over a prompt, logits for the last position only.

Per layer (DESIGN.md §2):
  A. per token chunk: RMSNorm -> fused QKV matmul -> (q/k norm) -> RoPE, written into the
     layer's full-length Q/K/V buffers;
  B. attention over the whole sequence at once (kernels.causal_attention);
  C. per token chunk: o_proj + residual add, RMSNorm, fused gate/up matmul, SwiGLU, down_proj
     + residual add, in place on the residual stream.
Only the residual stream [S, d], one layer's Q/K/V/attention output and one chunk's
temporaries are alive at once (workspace.py lists them); K/V of a layer is overwritten by the
next layer unless the caller asked to capture a prefix of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.prefix_kv import CaptureSink, KVSink, PrefixKV, PrefixSource, Sinks
from .kernels.ops import rms_norm_needs_scratch, rope_table_dtype
from .kernels import add_linear_, causal_attention, causal_attention_inplace, linear_into, rms_norm_into, rope_into, swiglu_into
from .kernels.attention import cpu_flash_applies
from .model_spec import ModelSpec
from .rope import RotaryTable
from .weights import ModelWeights
from .workspace import allocate, plan_workspace


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
        self.rope_dtype = rope_table_dtype(device, dtype)
        self.tokens_computed = 0  # prompt tokens run through the layers, all requests (a counter)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        chunk_size: int | None,
        prefix: PrefixSource | None = None,
        sink: KVSink | None = None,
        capture: tuple[int, int] | None = None,
        inplace_attention: bool = False,
    ) -> ForwardOutput:
        """Run the new tokens `token_ids` ([S] int64, S >= 1) after an optional cached `prefix`.

        chunk_size None (or >= S) means no chunking. `sink` is offered each layer's K/V (the
        prefix cache keeps its blocks); `capture=(start, end)` returns the K/V of absolute
        positions [start, end) (prefix positions included) as a PrefixKV. inplace_attention
        writes attention's output over Q block by block (less memory, slower; CPU only). The
        compiled CPU kernel always writes over Q: it costs nothing there.
        """
        spec = self.spec
        p = prefix.length if prefix is not None else 0
        capture_sink = CaptureSink(*capture) if capture else None
        sink = Sinks(sink, capture_sink) if (sink is not None or capture_sink is not None) else None
        plan = plan_workspace(spec, int(token_ids.shape[0]), chunk_size, self.dtype, p,
                              fp32_scratch=rms_norm_needs_scratch(self.device, self.dtype, spec.qk_norm))
        ws = allocate(plan, self.device)
        torch.index_select(self.weights.embed, 0, token_ids.to(self.device), out=ws["hidden"])
        chunks = [(c0, min(plan.new_tokens, c0 + plan.chunk)) for c0 in range(0, plan.new_tokens, plan.chunk)]
        rope = [self.rotary.cos_sin(p + c0, p + c1, self.rope_dtype) for c0, c1 in chunks]
        inplace_attention = inplace_attention or cpu_flash_applies(self.attention_backend, ws["q"])

        for li, layer in enumerate(self.weights.layers):
            if prefix is not None and p:
                prefix.load(li, ws["k"][:, :p], ws["v"][:, :p])
            for (c0, c1), (cos, sin) in zip(chunks, rope):
                self._qkv_chunk(layer, ws, p, c0, c1, cos, sin)
            if sink is not None:
                sink.store(li, ws["k"], ws["v"])
            if inplace_attention:
                attn = causal_attention_inplace(ws["q"], ws["k"], ws["v"], self.scale, backend=self.attention_backend)  # == ws["q"]
            else:
                attn = causal_attention(ws["q"], ws["k"], ws["v"], self.scale, self.attention_backend)  # [Hq, S, hd]
            for c0, c1 in chunks:
                self._mlp_chunk(layer, ws, attn, c0, c1)
            del attn

        hidden = ws["hidden"]
        last = torch.empty(1, spec.hidden_size, dtype=self.dtype, device=self.device)
        rms_norm_into(last, hidden[-1:], self.weights.final_norm, spec.rms_norm_eps, ws["scratch32"][:1, : spec.hidden_size])
        logits = (last @ self.weights.lm_head.t()).float()[0]  # [vocab]: one row, never S x vocab
        self.tokens_computed += plan.new_tokens
        return ForwardOutput(logits=logits, captured=capture_sink.captured if capture_sink else None)

    def _qkv_chunk(self, layer, ws, p, c0, c1, cos, sin) -> None:
        """A. tokens [c0, c1): norm, fused QKV, (q/k norm), RoPE -> the full-length Q/K/V."""
        spec, n = self.spec, c1 - c0
        hq, hkv, hd, qw, kw = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.q_width, spec.kv_width
        x = rms_norm_into(ws["normed"][:n], ws["hidden"][c0:c1], layer.input_norm, spec.rms_norm_eps, ws["scratch32"][:n, : spec.hidden_size])
        out = linear_into(ws["qkv"][:n], x, layer.wqkv, layer.bqkv)
        q = out[:, :qw].view(n, hq, hd)
        k = out[:, qw : qw + kw].view(n, hkv, hd)
        v = out[:, qw + kw :].view(n, hkv, hd)
        if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k, in place
            rms_norm_into(q, q, layer.q_norm, spec.rms_norm_eps, ws["scratch32"][:n, :qw].view(n, hq, hd))
            rms_norm_into(k, k, layer.k_norm, spec.rms_norm_eps, ws["scratch32"][:n, :kw].view(n, hkv, hd))
        rope_into(ws["q"][:, c0:c1], q.transpose(0, 1), cos, sin)
        rope_into(ws["k"][:, p + c0 : p + c1], k.transpose(0, 1), cos, sin)
        ws["v"][:, p + c0 : p + c1].copy_(v.transpose(0, 1))

    def _mlp_chunk(self, layer, ws, attn, c0, c1) -> None:
        """C. tokens [c0, c1): o_proj + residual, norm, SwiGLU MLP + residual."""
        spec, n = self.spec, c1 - c0
        h = ws["hidden"][c0:c1]
        o = ws["o_rows"][:n]
        o.view(n, spec.num_heads, spec.head_dim).copy_(attn[:, c0:c1].transpose(0, 1))
        add_linear_(h, o, layer.wo, layer.bo, ws["proj"][:n])
        x = rms_norm_into(ws["normed"][:n], h, layer.post_norm, spec.rms_norm_eps, ws["scratch32"][:n, : spec.hidden_size])
        act = swiglu_into(ws["act"][:n], linear_into(ws["gate_up"][:n], x, layer.w_gate_up, layer.b_gate_up))
        add_linear_(h, act, layer.w_down, layer.b_down, ws["proj"][:n])
