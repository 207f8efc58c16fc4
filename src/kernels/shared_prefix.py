"""Attention for a batch whose sequences all follow one captured prefix (a multi-item step's items,
a decision's questions and options), with that prefix's K/V read once per layer for the whole batch.

The per-sequence pass copies the shared prefix into every sequence's K/V segment and attends each
sequence over it: for 64 short items after a 3K-token prompt that is 64 copies and 64 passes over
the same 3K keys per layer, memory-bound. Attention splits exactly over disjoint key sets by
log-sum-exp: a query's softmax over (shared keys + its own keys) is the two partial softmaxes
weighted by exp(lse_part - lse_total). So per layer:
  shared  every query of the batch against the shared keys, no mask (every query comes after them):
          torch's CPU flash attention, which also returns each row's log-sum-exp, in query blocks;
  own     each sequence against its own keys (an item's; a continuation's item K/V, then its own),
          bottom-right causal: short sequences padded into one batched float32 product per group
          of sequences, long ones on the same flash op;
  merge   the two by their log-sum-exps in float32, written over the queries.
Layers with a sliding window or soft-capped scores (Gemma) take the per-sequence pass: the shared
prefix is copied into the segments for those layers only.
"""

from __future__ import annotations

import torch

from ..cache.prefix_io import shared_and_own
from .attention import CPU_FLASH_WITH_LSE, merge_partials, suffix_attention_with_lse

SHARED_QUERY_BLOCK = 512  # queries per call against the shared keys (its float32 merge scales with it)
# One padded group of sequences' own attention: its float32 scores (all query heads), its padded
# query rows and key positions. These bound its temporaries whatever the batch (scratch_bytes).
OWN_SCORE_ELEMENTS = 1 << 21
OWN_QUERY_ROWS = 512
OWN_KEY_ROWS = 4096
_FIXED_BYTES = 4 << 20  # torch flash's per-thread blocks, the masks and indices, allocator slack
# The pass pays where sequences are short (many passes over the same keys with a few queries each);
# for longer ones the per-sequence pass on the compiled kernel is faster than torch's flash op over
# the shared keys. Measured (SmolLM2-135M float32, 2 threads, Intel Xeon Ice Lake, items after a
# cached 2K-token prompt; shared vs per-sequence): 64 x 8 tokens 2.09 vs 3.62 s, 32 x 32 2.71 vs
# 2.76, 16 x 64 2.28 vs 2.31, 16 x 128 4.56 vs 3.94, 16 x 200 7.78 vs 5.99.
SHARED_PASS_MAX_MEAN_ROWS = 64


def shared_prefix_of(batch, device: torch.device):
    """(the PrefixKV every sequence of `batch` follows, per sequence its own captured prefix part or
    None) where this pass takes the batch, else None: CPU, two or more sequences of at most
    SHARED_PASS_MAX_MEAN_ROWS new tokens on average after the same captured prefix, none keeping its K/V in a cache (a sink sees whole segments) nor capturing
    shared positions."""
    if device.type != "cpu" or CPU_FLASH_WITH_LSE is None or len(batch.sequences) < 2:
        return None
    if batch.new_tokens > SHARED_PASS_MAX_MEAN_ROWS * len(batch.sequences):
        return None
    splits = [shared_and_own(s.prefix) for s in batch.sequences]
    if any(sp is None for sp in splits):
        return None
    shared = splits[0][0]
    if shared.length == 0 or any(sp[0] is not shared for sp in splits):
        return None
    if any(s.sink is not None or (s.capture is not None and s.capture[0] < shared.length) for s in batch.sequences):
        return None
    return shared, [own for _, own in splits]


class SharedPrefixPass:
    """A forward's attention (attention_paths: `loads`, then run per layer) over a batch that
    shared_prefix_of took. The executor loads no prefix: this pass loads each sequence's own
    prefix part into its segment after the shared positions (and, for a windowed or capped layer,
    the shared part too, then attends per sequence on `fallback`)."""

    def __init__(self, fallback, batch, buffers: tuple, shared, owns: list, scale: float, inplace: bool):
        self.fallback, self.scale, self.inplace = fallback, scale, inplace
        self.rows = batch.new_tokens
        self.q_all = buffers[0][:, : self.rows]  # the packed rows: every sequence's queries, in order
        self.shared, self.owns = shared, owns
        self.loads = [False] * len(batch.sequences)
        self.own = _OwnLayout(batch, shared.length, buffers)

    def run(self, layer: int, qs: list, ks: list, vs: list, window: int, softcap: float) -> list[torch.Tensor]:
        n = self.shared.length
        for own, k, v in zip(self.owns, ks, vs):
            if own is not None:
                own.load(layer, k[:, n : n + own.length], v[:, n : n + own.length])
        if window or softcap:
            for k, v in zip(ks, vs):
                self.shared.load(layer, k[:, :n], v[:, :n])
            return [self.fallback.attend(q, k, v, self.scale, self.inplace, window, softcap) for q, k, v in zip(qs, ks, vs)]
        q_all = self.q_all
        own_out, own_lse = self.own.attend(ks, vs, self.scale)
        k_sh, v_sh = self.shared.keys[layer], self.shared.values[layer]
        for r0 in range(0, self.rows, SHARED_QUERY_BLOCK):
            r1 = min(self.rows, r0 + SHARED_QUERY_BLOCK)
            out, lse = CPU_FLASH_WITH_LSE(q_all[None, :, r0:r1], k_sh[None], v_sh[None], 0.0, False, scale=self.scale)
            merged, _ = merge_partials(out[0], lse[0], own_out[:, r0:r1], own_lse[:, r0:r1])
            q_all[:, r0:r1].copy_(merged)
        return qs


class _OwnLayout:
    """Each sequence's own keys (segment positions after the shared prefix: its own prefix part,
    then its new tokens), bottom-right causal. Sequences are grouped in order so that one group's
    padded float32 scores stay within OWN_SCORE_ELEMENTS; the gather indices and masks are built
    once per forward and reused by every layer. A sequence too long for that alone runs on flash."""

    def __init__(self, batch, shared_tokens: int, buffers: tuple):
        seqs = batch.sequences
        self.buffers = buffers
        self.heads = buffers[0].shape[0]
        self.news = [s.new_tokens for s in seqs]
        self.keys = [s.prefix_tokens - shared_tokens + s.new_tokens for s in seqs]
        self.row_starts = batch.row_starts
        self.key_starts = [a + shared_tokens for a in batch.kv_starts]
        self.groups = self._groups(len(seqs))
        self.plans = [self._plan(g) for g in self.groups]

    def _groups(self, count: int) -> list[list[int]]:
        groups, group, s_max, l_max = [], [], 0, 0
        for i in range(count):
            s, l = max(s_max, self.news[i]), max(l_max, self.keys[i])
            if group and not _group_fits(len(group) + 1, s, l, self.heads):
                groups.append(group)
                group, s, l = [], self.news[i], self.keys[i]
            group.append(i)
            s_max, l_max = s, l
        groups.append(group)
        return groups

    def _plan(self, group: list[int]):
        """(query row index, key position index, visible mask [n, S, L], output row index) of a
        padded group, or None for a lone sequence too long to pad (it runs on flash)."""
        s_max, l_max = max(self.news[i] for i in group), max(self.keys[i] for i in group)
        if not _group_fits(len(group), s_max, l_max, self.heads):
            return None  # a lone sequence too long to pad
        t = torch.arange(s_max)[:, None]
        j = torch.arange(l_max)[None, :]
        q_index, k_index, masks, valid = [], [], [], []
        for g, i in enumerate(group):
            s, l = self.news[i], self.keys[i]
            q_index.append(self.row_starts[i] + torch.arange(s_max).clamp_(max=s - 1))
            k_index.append(self.key_starts[i] + torch.arange(l_max).clamp_(max=l - 1))
            # query t sits at own position l - s + t and sees own keys up to it; padded rows (t >= s)
            # see keys too: no empty softmax
            masks.append((j <= l - s + t) & (j < l))
            valid.append(g * s_max + torch.arange(s))
        return torch.cat(q_index), torch.cat(k_index), torch.stack(masks), torch.cat(valid)

    def attend(self, ks: list, vs: list, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's output over its own keys ([Hq, rows, D] float32, packed like the rows)
        and each row's log-sum-exp ([Hq, rows])."""
        q_all, k_all, v_all = self.buffers
        hq, d = q_all.shape[0], q_all.shape[2]
        rows = sum(self.news)
        out = torch.empty((hq, rows, d), dtype=torch.float32)
        lse = torch.empty((hq, rows), dtype=torch.float32)
        for group, plan in zip(self.groups, self.plans):
            r0 = self.row_starts[group[0]]
            r1 = r0 + sum(self.news[i] for i in group)
            if plan is None:
                i = group[0]
                o, l = suffix_attention_with_lse(q_all[:, r0:r1], ks[i][:, ks[i].shape[1] - self.keys[i]:], vs[i][:, vs[i].shape[1] - self.keys[i]:], scale)
            else:
                o, l = _padded_attention(q_all, k_all, v_all, plan, scale)
            out[:, r0:r1], lse[:, r0:r1] = o, l
        return out, lse


def _group_fits(n: int, s: int, l: int, heads: int) -> bool:
    """Whether n sequences padded to s queries and l own keys stay within the padded path's bounds."""
    return heads * n * s * l <= OWN_SCORE_ELEMENTS and n * s <= OWN_QUERY_ROWS and n * l <= OWN_KEY_ROWS


def scratch_bytes(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, members: list[tuple[int, int]]) -> int:
    """What the pass allocates at its largest in a layer of a forward over `members` [(new tokens,
    prefix tokens)]: every row's own output and log-sum-exp (float32, alive until the merge), then
    the largest of: a padded group (its float32 scores twice, logsumexp's temporary; its queries
    gathered, widened and regrouped; its keys and values gathered and widened; its output and the
    regrouped copy), a lone long sequence on flash (two outputs and the float32 merge), one shared
    query block (flash's output, the float32 merge)."""
    e = torch.tensor([], dtype=dtype).element_size()
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    rows = sum(n for n, _ in members)
    own = 4 * rows * (q_width + q_heads)
    group = (3 * 4 * OWN_SCORE_ELEMENTS + (e + 3 * 4) * OWN_QUERY_ROWS * q_width + 2 * (e + 4) * OWN_KEY_ROWS * kv_width
             + 3 * 4 * OWN_QUERY_ROWS * q_width)
    lone = max(n for n, _ in members) * (q_width * (2 * e + 3 * 4) + 3 * 4 * q_heads)
    block = SHARED_QUERY_BLOCK * (q_width * (e + 2 * 4) + 4 * 4 * q_heads)
    return own + max(group, lone, block) + _FIXED_BYTES


def _padded_attention(q_all, k_all, v_all, plan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded group: scores [Hkv, n, g*S, L] in float32 (GQA: a KV head's g query heads side by
    side), masked, softmaxed by their log-sum-exp, times V; the real rows back in packed order."""
    q_index, k_index, mask, valid = plan
    n, s, l = mask.shape
    hq, d = q_all.shape[0], q_all.shape[2]
    hkv = k_all.shape[0]
    g = hq // hkv
    q = q_all.index_select(1, q_index).float().view(hkv, g, n, s, d).transpose(1, 2).reshape(hkv, n, g * s, d)
    k = k_all.index_select(1, k_index).float().view(hkv, n, l, d)
    v = v_all.index_select(1, k_index).float().view(hkv, n, l, d)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).view(hkv, n, g, s, l)
    scores.masked_fill_(~mask[None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(scores.sub_(lse[..., None]).exp_().view(hkv, n, g * s, l), v)
    out = out.view(hkv, n, g, s, d).transpose(1, 2).reshape(hq, n * s, d).index_select(1, valid)
    return out, lse.transpose(1, 2).reshape(hq, n * s).index_select(1, valid)
