"""Attention over one captured prefix read once for a whole batch (kernels/shared_prefix.py): every
sequence's output against explicit float64 attention over its whole key list (shared prefix, its own
prefix part, its new tokens), and the executor's batched items against each item alone."""

from __future__ import annotations

import pytest
import torch

from prefillonly.cache.prefix_io import CaptureSink, ChainedPrefix, PrefixKV
from prefillonly.kernels import shared_prefix
from prefillonly.kernels.attention_paths import SequenceBySequence, TorchAttention
from prefillonly.kernels.attention import merge_partials
from prefillonly.kernels.shared_prefix import SharedPrefixPass, shared_prefix_of
from prefillonly.worker.executor import ForwardBatch, Sequence

from ..conftest import FAMILY_CONFIGS
from ..engine.test_batching import FP32_TOL, _batch_vs_singles, _executor, _ids
from ..reference import attention_float64, max_abs

CPU = torch.device("cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # against float64; bf16: the inputs' and output's rounding


def _kv(gen, heads, n, d, dtype):
    return PrefixKV([torch.randn(heads, n, d, generator=gen).to(dtype)], [torch.randn(heads, n, d, generator=gen).to(dtype)])


def _batch(gen, shared_len, news, owns, hq, hkv, d, dtype):
    """A one-layer batch after one shared prefix (own prefix parts of `owns` tokens, 0: none), its
    workspace buffers with random new Q/K/V, and each sequence's whole key list for the reference."""
    shared = _kv(gen, hkv, shared_len, d, dtype)
    own_parts = [_kv(gen, hkv, o, d, dtype) if o else None for o in owns]
    seqs = [Sequence(torch.zeros(n, dtype=torch.long), prefix=ChainedPrefix(shared, o) if o else shared)
            for n, o in zip(news, own_parts)]
    batch = ForwardBatch(seqs)
    q = torch.randn(hq, batch.new_tokens, d, generator=gen).to(dtype)
    k = torch.randn(hkv, batch.kv_starts[-1] + seqs[-1].prefix_tokens + seqs[-1].new_tokens, d, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    return batch, (q, k, v), shared, own_parts


def _views(batch, buffers):
    q, k, v = buffers
    qs = [q[:, r : r + s.new_tokens] for r, s in zip(batch.row_starts, batch.sequences)]
    ks = [k[:, a : a + s.prefix_tokens + s.new_tokens] for a, s in zip(batch.kv_starts, batch.sequences)]
    vs = [v[:, a : a + s.prefix_tokens + s.new_tokens] for a, s in zip(batch.kv_starts, batch.sequences)]
    return qs, ks, vs


def _reference(batch, buffers, shared, own_parts, scale, window=0, softcap=0.0):
    """Each sequence's float64 attention over its whole key list, computed before the pass runs."""
    qs, ks, vs = _views(batch, buffers)
    out = []
    for q, k, v, s, own in zip(qs, ks, vs, batch.sequences, own_parts):
        parts_k = [shared.keys[0]] + ([own.keys[0]] if own else []) + [k[:, s.prefix_tokens :]]
        parts_v = [shared.values[0]] + ([own.values[0]] if own else []) + [v[:, s.prefix_tokens :]]
        out.append(attention_float64(q, torch.cat(parts_k, 1), torch.cat(parts_v, 1), scale, window, softcap))
    return out


CASES = {  # shared length, new tokens per sequence, own prefix part per sequence
    "items": (257, [1, 7, 33, 2, 64], [0, 0, 0, 0, 0]),
    "continuations": (1000, [1, 3, 2, 5, 1, 9], [5, 40, 40, 17, 1, 3]),
    # long items among short ones (the pass takes a batch of at most SHARED_PASS_MAX_MEAN_ROWS a sequence)
    "one-token shared, long items": (1, [300, 5, 129, 1, 2, 1, 1, 1], [0, 11, 0, 0, 0, 0, 0, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("own_budget", [shared_prefix.OWN_SCORE_ELEMENTS, 600], ids=["padded", "small-groups+flash"])
def test_every_sequence_equals_float64_over_its_whole_key_list(monkeypatch, case, heads, dtype, own_budget):
    """The small own budget splits the padded groups and sends the long sequences to flash."""
    monkeypatch.setattr(shared_prefix, "OWN_SCORE_ELEMENTS", own_budget)
    gen = torch.Generator().manual_seed(sum(map(ord, case)) + heads[0])
    shared_len, news, owns = CASES[case]
    batch, buffers, shared, own_parts = _batch(gen, shared_len, news, owns, *heads, 32, dtype)
    scale = 32 ** -0.5
    want = _reference(batch, buffers, shared, own_parts, scale)
    found = shared_prefix_of(batch, CPU)
    assert found is not None and found[0] is shared
    attention = SharedPrefixPass(TorchAttention("sdpa"), batch, buffers, *found, scale, False)
    assert attention.loads == [False] * len(news)  # the executor copies no prefix
    got = attention.run(0, *_views(batch, buffers), 0, 0.0)
    for i, (g, w) in enumerate(zip(got, want)):
        assert max_abs(g, w) <= TOL[dtype], (i, max_abs(g, w))


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (0, 30.0), (600, 20.0)])
def test_a_windowed_or_capped_layer_attends_per_sequence_over_the_whole_prefix(window, softcap):
    gen = torch.Generator().manual_seed(window + int(softcap))
    shared_len, news, owns = CASES["continuations"]
    batch, buffers, shared, own_parts = _batch(gen, shared_len, news, owns, 4, 2, 32, torch.float32)
    want = _reference(batch, buffers, shared, own_parts, 0.2, window, softcap)
    attention = SharedPrefixPass(TorchAttention("sdpa"), batch, buffers, *shared_prefix_of(batch, CPU), 0.2, False)
    got = attention.run(0, *_views(batch, buffers), window, softcap)
    assert max(max_abs(g, w) for g, w in zip(got, want)) <= TOL[torch.float32]


def test_merging_two_partial_softmaxes_equals_one_over_both_key_sets():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 8, generator=gen, dtype=torch.float64) for n in (5, 13, 13))
    def part(keys, values):
        scores = q @ keys.transpose(1, 2)
        return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)
    out, lse = merge_partials(*part(k[:, :6], v[:, :6]), *part(k[:, 6:], v[:, 6:]))
    want, want_lse = part(k, v)
    assert max_abs(out, want) <= 1e-6 and max_abs(lse, want_lse) <= 1e-6


def test_batches_the_pass_does_not_take():
    gen = torch.Generator().manual_seed(2)
    shared, other = _kv(gen, 2, 9, 8, torch.float32), _kv(gen, 2, 9, 8, torch.float32)
    seq = lambda prefix, **kw: Sequence(torch.zeros(3, dtype=torch.long), prefix=prefix, **kw)  # noqa: E731
    assert shared_prefix_of(ForwardBatch([seq(shared), seq(shared)]), CPU) is not None
    refused = {
        "one sequence": [seq(shared)],
        "different prefixes": [seq(shared), seq(other)],
        "one without a prefix": [seq(shared), seq(None)],
        "a sink sees whole segments": [seq(shared), seq(shared, sink=CaptureSink(0, 12))],
        "a capture of shared positions": [seq(shared), seq(shared, capture=(4, 12))],
        # long sequences: the per-sequence pass on the compiled kernel is faster
        "long sequences on average": [seq(shared), Sequence(torch.zeros(2 * shared_prefix.SHARED_PASS_MAX_MEAN_ROWS, dtype=torch.long), prefix=shared)],
    }
    for why, seqs in refused.items():
        assert shared_prefix_of(ForwardBatch(seqs), CPU) is None, why
    assert shared_prefix_of(ForwardBatch([seq(shared), seq(shared, capture=(9, 12))]), CPU) is not None
    assert shared_prefix_of(ForwardBatch([seq(shared), seq(shared)]), torch.device("meta")) is None


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_items_and_continuations_batched_over_one_prefix_equal_each_alone(family_folders, name, monkeypatch):
    """Every family (Gemma's windowed and capped layers included): a step of items after one captured
    prompt, and of continuations after one item each, through the shared pass vs each sequence alone."""
    taken = []
    begin = TorchAttention.begin
    monkeypatch.setattr(TorchAttention, "begin", lambda self, *a: taken.append(begin(self, *a)) or taken[-1])
    executor = _executor(family_folders[name])
    gen = torch.Generator().manual_seed(len(name))
    vocab = executor.spec.vocab_size
    shared = executor.forward(_ids(gen, vocab, 301), None, capture=(0, 301)).captured
    items = [Sequence(_ids(gen, vocab, n), prefix=shared, capture=(301, 301 + n)) for n in (1, 17, 40, 3)]
    item_kv = executor.forward_batch(ForwardBatch(items), None).captured
    continuations = [Sequence(_ids(gen, vocab, n), prefix=ChainedPrefix(shared, kv)) for n, kv in zip((2, 1, 5, 3), item_kv)]
    for seqs in (items, continuations):
        seqs = [Sequence(s.token_ids, prefix=s.prefix) for s in seqs]
        for chunk in (None, 7):
            assert _batch_vs_singles(executor, seqs, chunk) <= FP32_TOL, chunk
    assert any(isinstance(t, SharedPrefixPass) for t in taken) and any(isinstance(t, SequenceBySequence) for t in taken)
