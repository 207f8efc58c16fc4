"""Hybrid-prefill executor: one forward pass over a batch of prompts, logits for each one's last position.

Per layer:
  A. per token chunk of the packed rows: RMSNorm -> fused QKV matmul -> (q/k norm) -> RoPE at
     each sequence's own positions, written into that sequence's Q/K/V segment;
  B. attention over each sequence's whole length at once, its cached prefix K/V first, on the
     attention path its KernelBackend chose (kernels.attention_paths): per sequence, or on the
     Triton path one launch for the whole batch, reading pool-backed prefixes in place;
  C. per token chunk: o_proj + residual add, RMSNorm, fused gate/up matmul, SwiGLU, down_proj
     + residual add, in place on the residual stream. Gemma adds a norm on attention's output and
     one on the MLP's before each residual add, and gates with tanh-GELU (GeGLU).
A layer may have a sliding window (Gemma's local layers: the kernels skip the keys outside it)
and its own RoPE table (Gemma 3: a local and a global base).
The B sequences of a ForwardBatch are packed row after row: the per-token ops (all the
matmuls) run over [sum S_i] rows, so every layer's weights are read once per chunk for the
whole batch instead of once per request; only attention is per sequence. Only the residual
stream, one layer's Q/K/V/attention output and one chunk's temporaries are alive at once
(workspace.py lists them); a layer's K/V is overwritten by the next layer unless a sink
keeps it or the caller asked to capture a range of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..cache.prefix_io import CaptureSink, KVSink, PrefixKV, PrefixSource, Sinks
from ..kernels.backend import KernelBackend
from ..kernels.score_head import packs_weight
from ..model.spec import ModelSpec
from ..model.rope import RotaryTable
from ..model.weights import ModelWeights
from .workspace import LOGPROB_ROWS, allocate, plan_workspace


@dataclass
class Sequence:
    """One member of a ForwardBatch: new tokens after an optional cached prefix."""

    token_ids: torch.Tensor  # [S] int64, S >= 1: the tokens to compute
    prefix: PrefixSource | None = None  # fills the first P positions of each layer's K/V
    sink: KVSink | None = None  # offered each layer's K/V ([kv_heads, P + S, head_dim]) to keep
    capture: tuple[int, int] | None = None  # return the K/V of absolute positions [start, end)
    rope_length: int | None = None  # the length that picks LongRoPE's factors; None = prefix + new tokens
    # also the log-probability of the sequence's own next token at its `logprob_rows` positions
    # before the last (positions [P + S - 1 - n, P + S - 1), cached ones included: their hidden
    # states come from the prefix), and at each its top k; logprob_targets: the next token of each
    # of those positions (needed when the span reaches into the prefix; else token_ids give them)
    logprob_rows: int = 0
    logprob_top_k: int = 0
    logprob_targets: torch.Tensor | None = None
    # also the final hidden states (after the final norm) pooled over the sequence, cached positions
    # included (their hidden states come from the prefix): "last" token, "mean" of every position,
    # "cls" (the first), or "score": the classifier head (weights.score) on the last token's
    pool: str | None = None

    @property
    def regime_length(self) -> int:
        return self.rope_length if self.rope_length is not None else self.prefix_tokens + self.new_tokens

    @property
    def new_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def prefix_tokens(self) -> int:
        return self.prefix.length if self.prefix is not None else 0


@dataclass
class ForwardBatch:
    """B sequences computed in one forward. Row r of the packed new tokens belongs to the
    sequence whose [row_start, row_start + S) holds it; its K/V segment starts at kv_start and
    holds positions [first_position, P + S): from 0, or from P where attention reads the prefix
    where it lies (`in_place`, the Triton kernel's pool blocks: no workspace rows for it)."""

    sequences: list[Sequence]
    in_place: list[bool] | None = None  # per sequence; None: no prefix is read in place
    row_starts: list[int] = field(init=False)
    kv_starts: list[int] = field(init=False)
    first_positions: list[int] = field(init=False)
    held_prefixes: list[int] = field(init=False)  # per sequence, the prefix rows its segment holds (P, or 0 in place)

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("a ForwardBatch needs at least one sequence")
        in_place = self.in_place or [False] * len(self.sequences)
        self.first_positions = [s.prefix_tokens if here else 0 for s, here in zip(self.sequences, in_place)]
        self.held_prefixes = [s.prefix_tokens - first for s, first in zip(self.sequences, self.first_positions)]
        self.row_starts, self.kv_starts = [], []
        rows = kv = 0
        for s, held in zip(self.sequences, self.held_prefixes):
            if s.new_tokens < 1:
                raise ValueError("every sequence needs at least one new token")
            if not 0 <= s.logprob_rows < s.prefix_tokens + s.new_tokens:
                raise ValueError(f"logprob_rows {s.logprob_rows} must be in [0, {s.prefix_tokens + s.new_tokens}): "
                                 "positions before the last")
            if s.logprob_rows >= s.new_tokens and s.logprob_targets is None:
                raise ValueError("a logprob span that reaches into the prefix needs logprob_targets")
            self.row_starts.append(rows)
            self.kv_starts.append(kv)
            rows += s.new_tokens
            kv += held + s.new_tokens

    @property
    def new_tokens(self) -> int:
        return self.row_starts[-1] + self.sequences[-1].new_tokens

    @property
    def prefix_tokens(self) -> int:
        return sum(s.prefix_tokens for s in self.sequences)

    @property
    def resident_prefix_tokens(self) -> int:
        """The prefix positions the workspace holds (those not read in place)."""
        return sum(self.held_prefixes)

    def pieces(self, c0: int, c1: int) -> list[tuple[int, int, int]]:
        """The parts of packed rows [c0, c1) by sequence: (sequence index, first local row, end local row)."""
        out = []
        for i, (start, s) in enumerate(zip(self.row_starts, self.sequences)):
            r0, r1 = max(c0, start) - start, min(c1, start + s.new_tokens) - start
            if r0 < r1:
                out.append((i, r0, r1))
        return out


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [vocab] float32, next-token logits after the last prompt position
    captured: PrefixKV | None  # K/V of the requested capture range, if any


@dataclass
class SpanLogprobs:
    """Per row of a sequence's logprob span (Sequence.logprob_rows): the log-probability of the
    sequence's actual next token, whether it is the argmax, the argmax, and the k most likely tokens."""

    logprobs: torch.Tensor  # [n] float32
    greedy: torch.Tensor  # [n] bool
    top_logprobs: torch.Tensor  # [n, k] float32, descending
    top_ids: torch.Tensor  # [n, k] int64
    best_logprobs: torch.Tensor  # [n] float32: the most likely token's logprob
    best_ids: torch.Tensor  # [n] int64: the most likely token

    @classmethod
    def empty(cls, n: int, k: int) -> "SpanLogprobs":
        return cls(torch.empty(n), torch.empty(n, dtype=torch.bool), torch.empty(n, k), torch.empty(n, k, dtype=torch.long),
                   torch.empty(n), torch.empty(n, dtype=torch.long))

    def values(self) -> torch.Tensor:
        """[n, 3] float32: what the prefix cache keeps per position (prefix_io: span values)."""
        return torch.stack([self.logprobs, self.best_logprobs, self.best_ids.float()], 1)


@dataclass
class BatchOutput:
    logits: torch.Tensor  # [B, vocab] float32: row i after sequence i's last position
    captured: list[PrefixKV | None]  # per sequence, the K/V of its capture range
    spans: list[SpanLogprobs | None] = field(default_factory=list)  # per sequence, its logprob span (None: none asked)
    pooled: list[torch.Tensor | None] = field(default_factory=list)  # per sequence, [hidden] or [labels] float32 (Sequence.pool)


class HybridPrefillExecutor:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, kernels: KernelBackend):
        """kernels: what this executor computes with (chosen once: KernelBackend.choose); the
        layers' weights are packed for its linear backend here (in `weights`, replacing the plain
        tensors)."""
        self.spec = spec
        self.kernels = kernels
        self.ops = kernels.ops
        self.weights = weights.pack_linears(kernels.linear, pack_lm_head=packs_weight(kernels.score_head))
        self.gemm = kernels.gemm  # the projections' one GEMM: every weight it reads was packed for it just above
        self.dtype = kernels.dtype
        self.device = kernels.device
        # one RoPE table per layer type where the config has one per type, else one for all
        self.layer_rope = [spec.rope_table(i) for i in range(spec.num_layers)]
        self.rotaries = {t: RotaryTable(spec, self.device, t) for t in set(self.layer_rope)}
        self.scale = spec.softmax_scale
        self.rope_dtype = kernels.rope_dtype
        self.tokens_computed = 0  # prompt tokens run through the layers, all requests (a counter)
        self.last_forward_at = 0.0  # monotonic time the last forward finished (a running step's progress)

    def forward(self, token_ids: torch.Tensor, chunk_size: int | None, prefix: PrefixSource | None = None,
                sink: KVSink | None = None, capture: tuple[int, int] | None = None,
                inplace_attention: bool = False, rope_length: int | None = None) -> ForwardOutput:
        """One sequence: the new tokens `token_ids` ([S] int64, S >= 1) after an optional cached
        `prefix` (a batch of one; see forward_batch for the arguments)."""
        out = self.forward_batch(ForwardBatch([Sequence(token_ids, prefix, sink, capture, rope_length)]), chunk_size, inplace_attention)
        return ForwardOutput(logits=out.logits[0], captured=out.captured[0])

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch, chunk_size: int | None, inplace_attention: bool = False) -> BatchOutput:
        """Run every sequence of `batch` in one pass over the layers.

        chunk_size None (or >= the packed rows) means no chunking. Each sequence's `sink` is
        offered each layer's K/V (the prefix cache keeps its blocks); `capture=(start, end)`
        returns the K/V of absolute positions [start, end) (prefix positions included).
        inplace_attention writes attention's output over Q block by block (less memory, slower;
        CPU only). The compiled CPU kernel and the Triton kernel always write over Q: it costs
        nothing there.
        """
        in_place = self.kernels.attention_path.in_place(batch)
        if any(in_place):  # no workspace rows for the prefixes attention reads where they lie
            batch = ForwardBatch(batch.sequences, in_place)
        spec, seqs = self.spec, batch.sequences
        captures = [CaptureSink(*s.capture) if s.capture else None for s in seqs]
        sinks = [Sinks(s.sink, c) if (s.sink is not None or c is not None) else None for s, c in zip(seqs, captures)]
        plan = plan_workspace(spec, batch.new_tokens, chunk_size, self.dtype, batch.resident_prefix_tokens,
                              fp32_scratch=self.kernels.norm_scratch(spec.qk_norm), linear_outputs=self.kernels.linear_outputs)
        ws = allocate(plan, self.device)
        ids = torch.cat([s.token_ids for s in seqs]) if len(seqs) > 1 else seqs[0].token_ids
        torch.index_select(self.weights.embed, 0, ids.to(self.device), out=ws["hidden"])
        if spec.embed_scale is not None:  # Gemma: the scale rounded to the model dtype, as transformers does
            ws["hidden"].mul_(torch.tensor(spec.embed_scale, dtype=self.dtype))
        chunks = [(c0, min(plan.new_tokens, c0 + plan.chunk)) for c0 in range(0, plan.new_tokens, plan.chunk)]
        pieces = self._rope_pieces(batch, chunks)
        # per sequence: its queries (packed rows) and its K/V segment ([Hkv, P + S, hd]; from P where in place)
        qs = [ws["q"][:, r : r + s.new_tokens] for r, s in zip(batch.row_starts, seqs)]
        held = batch.held_prefixes
        ks = [ws["k"][:, a : a + p + s.new_tokens] for a, p, s in zip(batch.kv_starts, held, seqs)]
        vs = [ws["v"][:, a : a + p + s.new_tokens] for a, p, s in zip(batch.kv_starts, held, seqs)]
        attention = self.kernels.attention_path.begin(batch, (ws["q"], ws["k"], ws["v"]), self.scale, inplace_attention)

        softcap = spec.attention_softcap or 0.0
        for li, layer in enumerate(self.weights.layers):
            layer_pieces, window = pieces[self.layer_rope[li]], spec.layer_window(li)
            for s, k, v, load in zip(seqs, ks, vs, attention.loads):  # the other prefixes are read in place
                if load:
                    s.prefix.load(li, k[:, : s.prefix_tokens], v[:, : s.prefix_tokens])
            for (c0, c1), chunk_pieces in zip(chunks, layer_pieces):
                self._qkv_chunk(layer, ws, c0, c1, chunk_pieces, held, ks, vs)
            for sink, k, v, first in zip(sinks, ks, vs, batch.first_positions):
                if sink is not None:
                    sink.store(li, k, v, first)
            attn = attention.run(li, qs, ks, vs, window, softcap)  # per sequence: over its q, or a new tensor
            for (c0, c1), chunk_pieces in zip(chunks, layer_pieces):
                self._mlp_chunk(layer, ws, attn, c0, c1, chunk_pieces)
            del attn
        self.tokens_computed += plan.new_tokens
        outputs = self._batch_outputs(ws, batch, sinks, captures)
        self.last_forward_at = time.monotonic()
        return outputs

    def _batch_outputs(self, ws: dict, batch: ForwardBatch, sinks: list, captures: list) -> BatchOutput:
        """After the last layer: each sequence's last-position logits and logprob span, and what the
        prefix cache keeps of them (final hidden states, span values) for a later span over its blocks."""
        seqs = batch.sequences
        for r, s, sink in zip(batch.row_starts, seqs, sinks):
            if sink is not None:  # the kept blocks' final hidden states (a later span over them reads these)
                sink.store_hidden(ws["hidden"][r : r + s.new_tokens], s.prefix_tokens)
        logits = self._last_logits(ws, [r + s.new_tokens - 1 for r, s in zip(batch.row_starts, seqs)])
        spans = [self._span_logprobs(ws, r, s) if s.logprob_rows else None for r, s in zip(batch.row_starts, seqs)]
        for s, sink, span in zip(seqs, sinks, spans):
            if sink is not None and span is not None:  # kept with the blocks: a later span there skips the LM head
                # row j predicts token first + 1 + j, and is kept with that token (cache/kv_pool.py)
                sink.store_span(span.values(), s.prefix_tokens + s.new_tokens - s.logprob_rows)
        pooled = [self._pooled(ws, r, s) if s.pool else None for r, s in zip(batch.row_starts, seqs)]
        return BatchOutput(logits=logits, captured=[c.captured if c else None for c in captures], spans=spans, pooled=pooled)

    def _pooled(self, ws, row_start: int, seq: Sequence) -> torch.Tensor:
        """The sequence's final hidden states, final-normed, pooled as seq.pool asks ([hidden]
        float32), or (pool "score") the classifier head's scores on its last token ([labels] float32,
        the head in float32: a bf16 model's scores are not rounded to bf16). Mean pooling reads the
        cached prefix's hidden states and norms one chunk of rows at a time (the norm's scratch)."""
        p, n = seq.prefix_tokens, seq.new_tokens
        if seq.pool == "mean":
            step, total = max(1, ws["normed"].shape[0]), torch.zeros(self.spec.hidden_size, dtype=torch.float64, device=self.device)
            for a in range(0, p + n, step):
                total += self._final_norm(ws, self._position_rows(ws, row_start, seq, a, min(p + n, a + step))).double().sum(0)
            return (total / (p + n)).float()
        first = self._position_rows(ws, row_start, seq, 0, 1) if seq.pool == "cls" else ws["hidden"][row_start + n - 1 : row_start + n]
        vector = self._final_norm(ws, first)[0].float()
        return self.weights.score @ vector if seq.pool == "score" else vector

    def _rope_pieces(self, batch: ForwardBatch, chunks: list[tuple[int, int]]) -> dict:
        """Per RoPE table kind, each chunk's pieces with their rows' cos/sin tables: built once per
        forward and reused by every layer."""
        seqs, spec = batch.sequences, self.spec
        return {kind: [[(i, r0, r1, *rotary.cos_sin(seqs[i].prefix_tokens + r0, seqs[i].prefix_tokens + r1, self.rope_dtype,
                                                    long=spec.rope_long(seqs[i].regime_length)))
                        for i, r0, r1 in batch.pieces(c0, c1)] for c0, c1 in chunks]
                for kind, rotary in self.rotaries.items()}

    def _last_logits(self, ws, rows: list[int]) -> torch.Tensor:
        """[len(rows), vocab] float32: the final norm and LM head on the given rows only (never
        S x vocab), at most one chunk of rows at a time (the norm's scratch has chunk rows)."""
        step = max(1, ws["normed"].shape[0])
        out = []
        for g in range(0, len(rows), step):
            idx = torch.tensor(rows[g : g + step], dtype=torch.long, device=self.device)
            out.append(self._lm_head(ws, ws["hidden"].index_select(0, idx)))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _lm_head(self, ws, rows: torch.Tensor) -> torch.Tensor:
        """[r, vocab] float32 logits of residual-stream rows (at most a chunk of them): final norm,
        LM head, Gemma 2's soft cap (before the log-softmax, so it changes the scores)."""
        spec = self.spec
        logits = self.kernels.score_logits(self._final_norm(ws, rows), self.weights.lm_head)  # float32, never rounded to bf16 first
        if spec.final_softcap is not None:
            logits = torch.tanh(logits.div_(spec.final_softcap)).mul_(spec.final_softcap)
        return logits

    def _final_norm(self, ws, rows: torch.Tensor) -> torch.Tensor:
        """The final norm of residual-stream rows (at most a chunk of them), in the model dtype."""
        normed = torch.empty_like(rows)
        self.ops.rms_norm_into(normed, rows, self.weights.final_norm, self.spec.rms_norm_eps,
                               ws["scratch32"][: rows.shape[0], : self.spec.hidden_size])
        return normed

    def _span_logprobs(self, ws, row_start: int, seq: Sequence) -> SpanLogprobs:
        """The sequence's logprob span: cached positions whose values the prefix kept (top k <= 1)
        read them; the rest run the LM head, LOGPROB_ROWS positions of logits at a time (memory.py
        counts one such block), so any span length holds the hybrid-prefill memory bound."""
        n, k, p = seq.logprob_rows, seq.logprob_top_k, seq.prefix_tokens
        first = p + seq.new_tokens - 1 - n  # the span's first position
        targets = seq.logprob_targets if seq.logprob_targets is not None else seq.token_ids[first - p + 1 : first - p + 1 + n]
        targets = targets.to(self.device)
        out = SpanLogprobs.empty(n, k)
        todo = _read_cached_span(seq, first, targets, out)
        step = max(1, min(LOGPROB_ROWS, ws["normed"].shape[0]))
        for g in range(0, len(todo), step):
            offsets = todo[g : g + step]
            index = slice(offsets[0], offsets[-1] + 1) if offsets[-1] - offsets[0] + 1 == len(offsets) else torch.tensor(offsets)
            # one pass each: the log-softmax (a new tensor: the logits are dropped at once), then the
            # best k (max for k <= 1: a third of topk's time), whose first is the argmax
            logprobs = torch.log_softmax(self._lm_head(ws, self._span_rows(ws, row_start, seq, first, offsets)), -1)
            want = targets[index]
            out.logprobs[index] = logprobs.gather(1, want[:, None])[:, 0].cpu()
            if k > 1:
                values, ids = logprobs.topk(k, -1)
            else:
                values, ids = (t[:, None] for t in logprobs.max(-1))
            out.best_logprobs[index], out.best_ids[index] = values[:, 0].cpu(), ids[:, 0].cpu()
            if k:
                out.top_logprobs[index], out.top_ids[index] = values.cpu(), ids.cpu()
            del logprobs  # before the next block's logits: two blocks alive at once would be a third more memory
        out.greedy = out.best_ids == targets.cpu()
        return out

    def _span_rows(self, ws, row_start: int, seq: Sequence, first: int, offsets: list[int]) -> torch.Tensor:
        """[len(offsets), hidden] final hidden states of span positions first + offsets (ascending):
        each contiguous run a view of the workspace's rows or, in the prefix, gathered from its source."""
        runs, a = [], 0
        for i in range(1, len(offsets) + 1):
            if i == len(offsets) or offsets[i] != offsets[i - 1] + 1:
                runs.append(self._position_rows(ws, row_start, seq, first + offsets[a], first + offsets[i - 1] + 1))
                a = i
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def _position_rows(self, ws, row_start: int, seq: Sequence, a: int, b: int) -> torch.Tensor:
        """[b - a, hidden] final hidden states of positions [a, b)."""
        p = seq.prefix_tokens
        if a >= p:
            return ws["hidden"][row_start + a - p : row_start + b - p]
        rows = torch.empty((b - a, self.spec.hidden_size), dtype=self.dtype, device=self.device)
        seq.prefix.hidden(a, rows[: min(b, p) - a])
        if b > p:
            rows[p - a :].copy_(ws["hidden"][row_start : row_start + b - p])
        return rows

    def _qkv_chunk(self, layer, ws, c0, c1, pieces, held, ks, vs) -> None:
        """A. packed rows [c0, c1): norm, fused QKV, (q/k norm), RoPE -> each sequence's Q/K/V
        (`held`: the prefix rows before its new ones in its K/V segment)."""
        spec, n = self.spec, c1 - c0
        x = self.ops.rms_norm_into(ws["normed"][:n], ws["hidden"][c0:c1], layer.input_norm, spec.rms_norm_eps, ws["scratch32"][:n, : spec.hidden_size])
        out = self.gemm(ws["qkv"][:n], x, layer.wqkv, layer.bqkv)  # ws["qkv"] or a new tensor (kernels.linear)
        qk_norm = (layer.q_norm, layer.k_norm, spec.rms_norm_eps) if layer.q_norm is not None else None  # Qwen3
        row = c0
        for i, r0, r1, cos, sin in pieces:
            a, b = row - c0, row - c0 + (r1 - r0)  # the piece's rows within this chunk
            p = held[i]
            self.ops.rope_qkv_into(ws["q"][:, row : row + (r1 - r0)], ks[i][:, p + r0 : p + r1], vs[i][:, p + r0 : p + r1], out[a:b],
                          cos, sin, spec.num_heads, spec.num_kv_heads, qk_norm, ws["scratch32"][a:b])
            row += r1 - r0

    def _mlp_chunk(self, layer, ws, attn, c0, c1, pieces) -> None:
        """C. packed rows [c0, c1): o_proj + residual, norm, gated MLP + residual (Gemma: each
        branch's output normed before its residual add)."""
        spec, n = self.spec, c1 - c0
        h = ws["hidden"][c0:c1]
        o = ws["o_rows"][:n].view(n, spec.num_heads, spec.head_dim)
        row = 0
        for i, r0, r1, _, _ in pieces:
            o[row : row + (r1 - r0)].copy_(attn[i][:, r0:r1].transpose(0, 1))
            row += r1 - r0
        scratch = ws["scratch32"][:n, : spec.hidden_size]
        # each projection's output is its workspace buffer or, on a backend that allocates them,
        # a new tensor: dropped as soon as it is read, so that one is alive at a time (memory.py)
        proj = self.gemm(ws["proj"][:n], ws["o_rows"][:n], layer.wo, layer.bo)
        if layer.attn_out_norm is not None:
            self.ops.rms_norm_into(proj, proj, layer.attn_out_norm, spec.rms_norm_eps, scratch)
        x = self.ops.add_rms_norm_(h, proj, layer.post_norm, spec.rms_norm_eps, ws["normed"][:n], scratch)
        del proj
        gate_up = self.gemm(ws["gate_up"][:n], x, layer.w_gate_up, layer.b_gate_up)
        act = self.ops.gated_activation_into(ws["act"][:n], gate_up, spec.activation)
        del gate_up
        down = self.gemm(ws["proj"][:n], act, layer.w_down, layer.b_down)
        if layer.mlp_out_norm is not None:
            self.ops.rms_norm_into(down, down, layer.mlp_out_norm, spec.rms_norm_eps, scratch)
        h.add_(down)


def _read_cached_span(seq: Sequence, first: int, targets: torch.Tensor, out: SpanLogprobs) -> list[int]:
    """Fill `out` at the span's positions whose values the prefix kept (only the best token is kept:
    top k <= 1 only); the span offsets left for the LM head, ascending. Row j predicts token
    first + 1 + j, whose value the prefix holds while that token is in it: every cached position
    but the last (whose next token is the first computed one)."""
    n = seq.logprob_rows
    m = min(n, seq.prefix_tokens - first - 1) if seq.logprob_top_k <= 1 else 0
    cached = seq.prefix.span_values(first + 1, m) if m > 0 else None
    if cached is None:
        return list(range(n))
    cached = cached.cpu()
    known = ~torch.isnan(cached[:, 0])
    idx = known.nonzero()[:, 0]
    out.logprobs[idx], out.best_logprobs[idx], out.best_ids[idx] = cached[idx, 0], cached[idx, 1], cached[idx, 2].long()
    if seq.logprob_top_k:
        out.top_logprobs[idx, 0], out.top_ids[idx, 0] = out.best_logprobs[idx], out.best_ids[idx]
    return (~known).nonzero()[:, 0].tolist() + list(range(m, n))
