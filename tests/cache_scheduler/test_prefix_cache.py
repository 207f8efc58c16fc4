"""Prefix KV cache: hash chain, index (pinning, LRU, tiers, overflow), engine results with and
without hits, explicit cache boundary, namespaces, multi-item scoring, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from prefillonly import Engine, EngineConfig, InvalidRequestError
from prefillonly.contract.block_keys import block_hashes, namespace_root
from prefillonly.cache.index import PrefixIndex
from prefillonly.cache.kv_pool import KVPool
from prefillonly.cache.prefix_cache import PrefixCache

B = 8  # small blocks so that short prompts span several


# -- hash chain -----------------------------------------------------------------------------
def test_hash_chain_shares_equal_prefixes_and_changes_after_a_difference():
    root = namespace_root("m", None)
    a = list(range(100, 140))  # 5 blocks
    b = a[:20] + [7] + a[21:]  # differs in block 2 (positions 16..23)
    ha, hb = block_hashes(a, B, root), block_hashes(b, B, root)
    assert len(ha) == 5 and ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert block_hashes(a + [1, 2, 3], B, root) == ha  # a partial block has no hash
    assert block_hashes(a, B, namespace_root("other-model", None))[0] != ha[0]
    assert block_hashes(a, B, namespace_root("m", "tenant-a"))[0] != ha[0]


# -- index ------------------------------------------------------------------------------------
def chain(index: PrefixIndex, names: list[str], parent=None):
    blocks = []
    for n in names:
        blk, moves = index.reserve(n.encode(), parent)
        assert blk is not None and moves == []
        blocks.append(blk)
        parent = n.encode()
    index.mark_ready(blocks)
    index.unpin(blocks)
    return blocks


def test_lru_leaf_first_eviction_and_pinning():
    idx = PrefixIndex(tier1_slots=4)
    chain(idx, ["a1", "a2"])
    chain(idx, ["b1", "b2"])
    assert idx.used_slots(1) == 4
    idx.pin(idx.match([b"a1", b"a2"]))  # a is in use: never evicted
    blk, _ = idx.reserve(b"c1", None)  # must evict b's leaf first (b2), never b1 before b2
    assert blk is not None and b"b2" not in idx.blocks and b"b1" in idx.blocks
    idx.mark_ready([blk]); idx.unpin([blk])
    blk, _ = idx.reserve(b"d1", None)  # next LRU leaf: b1 (older than c1)
    assert b"b1" not in idx.blocks and blk is not None
    idx.mark_ready([blk]); idx.unpin([blk])
    assert idx.used_slots(1) <= 4 and {b"a1", b"a2"} <= set(idx.blocks)
    # everything else pinned or parent of a pinned block: no room is an answer, not an error
    idx.pin(idx.match([b"c1"])); idx.pin(idx.match([b"d1"]))
    blk, moves = idx.reserve(b"e1", None)
    assert blk is None and moves == []
    assert idx.stats.blocks_evicted == 2


def test_second_tier_offload_and_restore_moves():
    idx = PrefixIndex(tier1_slots=2, tier2_slots=2)
    chain(idx, ["a1", "a2"])
    blk, moves = idx.reserve(b"b1", None)  # a2 (leaf) offloaded to tier 2
    assert blk is not None and [(m.src_tier, m.dst_tier) for m in moves] == [(1, 2)]
    assert idx.blocks[b"a2"].tier == 2 and idx.stats.blocks_offloaded == 1
    idx.mark_ready([blk]); idx.unpin([blk])
    matched = idx.match([b"a1", b"a2"])
    assert len(matched) == 2  # still a hit, from the second tier
    idx.pin(matched)
    moves = idx.restore(matched[1])  # makes room (b1 -> tier 2) then copies a2 back
    assert [(m.src_tier, m.dst_tier) for m in moves] == [(1, 2), (2, 1)]
    assert moves[0].src_slot == moves[1].dst_slot  # b1's slot is reused after b1 was copied out
    assert idx.blocks[b"a2"].tier == 1 and idx.stats.blocks_restored == 1


def test_pool_hidden_states_roundtrip_across_tiers_at_any_offset():
    """A block's final hidden states travel with its K/V (offload and restore) and read back exactly
    from any position range, across block boundaries."""
    g = torch.Generator().manual_seed(1)
    p1 = KVPool(2, 3, 2, B, 4, torch.bfloat16, torch.device("cpu"), hidden_size=5)
    p2 = KVPool(2, 3, 2, B, 4, torch.bfloat16, torch.device("cpu"), hidden_size=5)
    h = torch.randn(2 * B, 5, generator=g).bfloat16()
    p1.write_hidden(torch.tensor([2, 0]), h)
    p1.copy_slot(2, p2, 0); p1.copy_slot(0, p2, 1)
    p2.copy_slot(0, p1, 1); p2.copy_slot(1, p1, 2)
    for start, n in ((0, 2 * B), (3, B), (B - 1, 2), (B + 2, B - 2)):
        dst = torch.zeros(n, 5).bfloat16()
        p1.read_hidden(torch.tensor([1, 2]), start, dst)
        assert torch.equal(dst, h[start : start + n])
    # the hidden states (bf16) and the span values (3 float32) per position
    assert KVPool.bytes_per_block(2, 2, B, 4, torch.bfloat16, 5) == KVPool.bytes_per_block(2, 2, B, 4, torch.bfloat16) + (2 * 5 + 12) * B


def test_pool_span_values_travel_with_the_block_at_every_position():
    """Span values written at any offset read back exactly after an offload and a restore, a block's
    last position included (each value is kept with the token it predicts, which the block's hash
    fixes); positions never written and a slot rewritten by a later block read NaN."""
    g = torch.Generator().manual_seed(2)
    p1 = KVPool(2, 3, 2, B, 4, torch.float32, torch.device("cpu"), hidden_size=5)
    p2 = KVPool(2, 3, 2, B, 4, torch.float32, torch.device("cpu"), hidden_size=5)
    slots = torch.tensor([2, 0])
    p1.write_hidden(slots, torch.randn(2 * B, 5, generator=g))
    values = torch.randn(2 * B - 3, 3, generator=g)
    values[:, 2] = torch.randint(0, 49152, (2 * B - 3,), generator=g).float()
    p1.write_span(slots, 3, values)  # positions [3, 2B) of the two blocks
    p1.copy_slot(2, p2, 0); p1.copy_slot(0, p2, 1)
    p2.copy_slot(0, p1, 1); p2.copy_slot(1, p1, 2)
    got = p1.read_span(torch.tensor([1, 2]), 0, 2 * B)
    expect = torch.cat([torch.full((3, 3), float("nan")), values])
    assert not expect[B - 1].isnan().any()  # a block's last position is kept like any other
    assert torch.equal(got.isnan(), expect.isnan()) and torch.equal(got.nan_to_num(), expect.nan_to_num())
    assert torch.equal(p1.read_span(torch.tensor([1, 2]), B - 2, 4).nan_to_num(), expect[B - 2 : B + 2].nan_to_num())
    p1.write_hidden(torch.tensor([1]), torch.randn(B, 5, generator=g))  # another block takes slot 1
    assert p1.read_span(torch.tensor([1]), 0, B).isnan().all()


def test_pool_roundtrip_is_bit_exact_across_tiers():
    g = torch.Generator().manual_seed(0)
    p1 = KVPool(2, 3, 2, B, 4, torch.bfloat16, torch.device("cpu"))
    p2 = KVPool(2, 3, 2, B, 4, torch.bfloat16, torch.device("cpu"))
    k = torch.randn(2, 2 * B, 4, generator=g).bfloat16()
    v = torch.randn(2, 2 * B, 4, generator=g).bfloat16()
    slots = torch.tensor([2, 0])
    for layer in range(2):
        p1.write(layer, slots, k + layer, v - layer)
    p1.copy_slot(2, p2, 1); p1.copy_slot(0, p2, 2)
    p2.copy_slot(1, p1, 1); p2.copy_slot(2, p1, 2)  # back into different slots
    for layer in range(2):
        kd, vd = torch.empty(2, 2 * B - 3, 4).bfloat16(), torch.empty(2, 2 * B - 3, 4).bfloat16()
        p1.read(layer, torch.tensor([1, 2]), kd, vd)
        assert torch.equal(kd, (k + layer)[:, : 2 * B - 3]) and torch.equal(vd, (v - layer)[:, : 2 * B - 3])
        # as the executor reads: whole blocks into the front of a longer K/V buffer, the rest untouched
        kbig, vbig = torch.zeros(2, 2 * B + 5, 4).bfloat16(), torch.zeros(2, 2 * B + 5, 4).bfloat16()
        p1.read(layer, torch.tensor([1, 2]), kbig[:, : 2 * B], vbig[:, : 2 * B])
        assert torch.equal(kbig[:, : 2 * B], k + layer) and torch.equal(vbig[:, : 2 * B], v - layer)
        assert not kbig[:, 2 * B :].any() and not vbig[:, 2 * B :].any()


# -- engine -----------------------------------------------------------------------------------
def make_engine(folder, **kw):
    kw.setdefault("cache_budget_bytes", 1 << 20)
    return Engine(EngineConfig(model=folder, dtype="float32", threads=2, cache_block_size=B, chunk_size=16, **kw))


@pytest.fixture(scope="module")
def folder(family_folders):
    return family_folders["llama_gqa_llama3rope_untied"]


@pytest.fixture(scope="module")
def reference(folder):
    with make_engine(folder, cache_budget_bytes=0) as e:
        assert e.cache is None
        yield e


def rand_ids(n, seed):
    r = random.Random(seed)
    return [r.randrange(0, 300) for _ in range(n)]


ALLOWED = [5, 17, 250]


def lp(result):
    return torch.tensor([t.logprob for t in result.tokens], dtype=torch.float64)


@pytest.mark.parametrize("shared_len", [B * 3, B * 3 + 5, 1, 7])  # block-aligned and not
def test_hits_give_the_same_logprobs(folder, reference, shared_len):
    with make_engine(folder) as e:
        profile = rand_ids(shared_len, seed=shared_len)
        for i in range(3):
            ids = profile + rand_ids(11 + i, seed=100 + i)
            want = lp(reference.score(ids, ALLOWED))
            got = e.score(ids, ALLOWED)
            assert (lp(got) - want).abs().max() <= 1e-4
            assert got.cached_tokens == (0 if i == 0 else (shared_len // B) * B)


def test_fully_cached_prompt_still_computes_its_last_token(folder, reference):
    with make_engine(folder) as e:
        ids = rand_ids(4 * B, seed=3)
        first = e.score(ids, ALLOWED)
        before = e.executor.tokens_computed
        again = e.score(ids, ALLOWED)
        assert again.cached_tokens == 4 * B - 1 and e.executor.tokens_computed - before == 1
        assert (lp(again) - lp(first)).abs().max() <= 1e-4
        assert (lp(again) - lp(reference.score(ids, ALLOWED))).abs().max() <= 1e-4


def test_cache_prefix_len_stops_caching_at_the_boundary(folder):
    with make_engine(folder) as e:
        profile = rand_ids(2 * B + 3, seed=4)
        e.score(profile + rand_ids(20, seed=5), ALLOWED, cache_prefix_len=len(profile))
        assert e.cache.index.stats.blocks_stored == 2  # the profile's full blocks, not the post
        r = e.score(profile + rand_ids(20, seed=6), ALLOWED, cache_prefix_len=len(profile))
        assert r.cached_tokens == 2 * B
        assert e.score(rand_ids(40, seed=7), ALLOWED, cache_prefix_len=0).cached_tokens == 0
        assert e.cache.index.stats.blocks_stored == 2  # boundary 0: nothing new kept


def test_budget_is_never_exceeded_and_overflow_is_not_an_error(folder, reference):
    spec = reference.spec
    block_bytes = PrefixCache.bytes_per_block(spec, torch.float32, B)
    with make_engine(folder, cache_budget_bytes=3 * block_bytes + 100) as e:
        assert e.cache.index.capacity[1] == 3
        for i in range(6):
            ids = rand_ids(5 * B, seed=50 + i)  # each prompt wants 5 blocks
            r = e.score(ids, ALLOWED)
            assert (lp(r) - lp(reference.score(ids, ALLOWED))).abs().max() <= 1e-4
            assert e.cache.bytes_in_use()[1] <= 3 * block_bytes
        assert e.cache.stats.overflow_blocks > 0


def test_namespaces_never_share_blocks(folder):
    with make_engine(folder) as e:
        ids = rand_ids(3 * B, seed=8) + [1, 2, 3]
        e.score(ids, ALLOWED, cache_namespace="tenant-a")
        assert e.score(ids, ALLOWED, cache_namespace="tenant-b").cached_tokens == 0
        assert e.score(ids, ALLOWED).cached_tokens == 0
        assert e.score(ids, ALLOWED, cache_namespace="tenant-a").cached_tokens == 3 * B


def test_second_tier_serves_hits_after_eviction(folder, reference):
    spec = reference.spec
    block_bytes = PrefixCache.bytes_per_block(spec, torch.float32, B)
    with make_engine(folder, cache_budget_bytes=4 * block_bytes, cache_second_tier_bytes=8 * block_bytes) as e:
        a, b = rand_ids(4 * B + 2, seed=9), rand_ids(4 * B + 2, seed=10)
        e.score(a, ALLOWED)
        e.score(b, ALLOWED)  # pushes a's blocks to the second tier
        assert e.cache.stats.blocks_offloaded >= 4
        r = e.score(a, ALLOWED)
        assert r.cached_tokens == 4 * B and e.cache.stats.blocks_restored >= 4
        assert (lp(r) - lp(reference.score(a, ALLOWED))).abs().max() <= 1e-4


def test_multi_item_equals_separate_requests_and_computes_the_shared_part_once(folder, reference):
    with make_engine(folder, cache_budget_bytes=0) as e:
        shared = rand_ids(2 * B + 5, seed=11)
        items = [rand_ids(n, seed=20 + n) for n in (3, 9, 1, 14)]
        before = e.executor.tokens_computed
        results = e.score_items(shared, items, ALLOWED)
        assert e.executor.tokens_computed - before == len(shared) + sum(map(len, items))
        for item, r in zip(items, results):
            assert r.prompt_tokens == len(shared) + len(item)
            assert (lp(r) - lp(reference.score(shared + item, ALLOWED))).abs().max() <= 1e-4


def test_multi_item_text_with_template(default_engine):
    shared = "User likes: hiking, mountains, photography."
    posts = ["Ten alpine trails", "Stock market news today"]
    results = default_engine.score_items(shared, posts, [" Yes", " No"], item_template="\nPost: {item}\nWould the user click? Answer:")
    tok = default_engine.encoder.tokenizer
    for post, r in zip(posts, results):
        ids = tok.encode(shared) + tok.encode(f"\nPost: {post}\nWould the user click? Answer:", add_special_tokens=False)
        single = default_engine.score(ids, [" Yes", " No"])
        assert abs(single.tokens[0].logprob - r.tokens[0].logprob) < 1e-4


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_prefix_len=-1), "cache_prefix_len -1 must be between 0 and the prompt length 20"),
    (dict(cache_prefix_len=21), "cache_prefix_len 21 must be between 0"),
    (dict(cache_prefix_len=2.5), "must be an integer"),
    (dict(cache_namespace=5), "cache_namespace must be a string"),
])
def test_bad_cache_arguments(folder, kwargs, match):
    with make_engine(folder) as e:
        with pytest.raises(InvalidRequestError, match=match):
            e.score(rand_ids(20, seed=1), ALLOWED, **kwargs)
        assert e.score(rand_ids(20, seed=1), ALLOWED).prompt_tokens == 20


@pytest.mark.parametrize("items,match", [
    ([], "items is empty"),
    ("abc", "items must be a list"),
    ([[1, 2]] * 5, r"too many items: 5, the limit is 4 per request \(max_items\)"),
    ([[1, 2], []], "item 1 is empty"),
    ([[1, 999]], "item 0 token id 999 is outside the vocabulary"),
])
def test_bad_items(folder, items, match):
    with make_engine(folder, max_items=4) as e:
        with pytest.raises(InvalidRequestError, match=match):
            e.score_items(rand_ids(10, seed=2), items, ALLOWED)
        assert len(e.score_items(rand_ids(10, seed=2), [[1], [2]], ALLOWED)) == 2


def test_default_model_hits_equal_misses_fp32(default_engine):
    """The real SmolLM2 (fp32): a cache hit gives the same logprobs as the cold computation."""
    profile = "User profile: " + "enjoys long hikes in the Alps, film photography, and mountain villages; " * 8
    for i, post in enumerate(["Post: ten alpine trails. Click? Answer:", "Post: a new camera review. Click? Answer:"]):
        ns = f"default-model-test-{i}"  # a fresh namespace: the first request is a guaranteed miss
        cold = default_engine.score(profile + post, [" Yes", " No"], cache_namespace=ns)
        warm = default_engine.score(profile + post, [" Yes", " No"], cache_namespace=ns)
        assert cold.cached_tokens == 0 and warm.cached_tokens > 64
        assert max(abs(a.logprob - b.logprob) for a, b in zip(cold.tokens, warm.tokens)) <= 1e-4


def test_eviction_is_lru_by_last_use_not_by_when_a_block_became_a_leaf():
    idx = PrefixIndex(tier1_slots=6)
    chain(idx, ["a1", "a2", "a3"])  # used first
    chain(idx, ["b1", "b2", "b3"])  # used later
    for name in ("c1", "c2"):
        blk, _ = idx.reserve(name.encode(), b"c1" if name == "c2" else None)
        assert blk is not None
    # the two victims are a's leaf, then a's new leaf (a2 is older than b3), never b's blocks
    assert {b"b1", b"b2", b"b3", b"a1"} <= set(idx.blocks) and b"a3" not in idx.blocks and b"a2" not in idx.blocks


def test_match_length_is_the_length_of_match():
    idx = PrefixIndex(tier1_slots=8)
    chain(idx, ["x1", "x2", "x3", "x4"])
    for hashes in ([b"x1", b"x2", b"x3", b"x4", b"x5"], [b"x1", b"x2"], [b"y1"], [], [b"x1", b"zz", b"x3"]):
        assert idx.match_length(hashes) == len(idx.match(hashes))


# -- a request's lifecycle on the index (tensor-free: what PrefixCache and the simulator share) --
def keys(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(1, n + 1)]


def test_index_begin_reserves_inside_the_keep_boundary_and_commit_makes_it_matchable():
    idx = PrefixIndex(tier1_slots=8, block_size=4)
    hashes = keys("p", 4)  # an 18-token prompt: 4 full blocks and 2 tokens
    ticket, moves = idx.begin(hashes, 18, 2)  # keep 2 blocks (cache_prefix_len 10: its 2 whole blocks)
    assert moves == [] and ticket.cached_tokens == 0 and ticket.matched == []
    assert [b.hash for b in ticket.new] == hashes[:2] and all(b.refs == 1 and not b.ready for b in ticket.new)
    assert idx.match_length(hashes) == 0  # reserved is not cached yet
    idx.commit(ticket)
    assert idx.match_length(hashes) == 2 and all(b.refs == 0 for b in idx.blocks.values())
    again, _ = idx.begin(hashes, 18, 4)  # a hit on 2 blocks; the rest of the prompt kept this time
    assert again.cached_tokens == 8 and [b.hash for b in again.matched] == hashes[:2]
    assert [b.hash for b in again.new] == hashes[2:] and all(b.refs == 1 for b in again.matched)
    idx.commit(again)
    s = idx.stats
    assert (s.lookups, s.hit_tokens, s.miss_tokens, s.blocks_stored, s.overflow_blocks) == (2, 8, 18 + 10, 4, 0)


def test_index_begin_on_a_fully_cached_prompt_computes_its_last_token():
    idx = PrefixIndex(tier1_slots=4, block_size=4)
    hashes = keys("f", 2)
    idx.commit(idx.begin(hashes, 8, 2)[0])
    ticket, _ = idx.begin(hashes, 8, 2)
    assert ticket.cached_tokens == 7 and len(ticket.matched) == 2 and ticket.new == []
    idx.commit(ticket)
    assert idx.stats.hit_tokens == 7 and idx.stats.miss_tokens == 8 + 1


def test_index_abort_leaves_nothing_behind():
    idx = PrefixIndex(tier1_slots=4, block_size=4)
    cached = keys("a", 2)
    idx.commit(idx.begin(cached, 8, 2)[0])
    ticket, _ = idx.begin(cached + keys("b", 2), 17, 4)  # 2 cached blocks pinned, 2 new reserved
    assert len(ticket.matched) == 2 and len(ticket.new) == 2 and idx.used_slots(1) == 4
    idx.abort(ticket)
    assert set(idx.blocks) == set(cached) and idx.used_slots(1) == 2
    assert all(b.refs == 0 and b.ready for b in idx.blocks.values())
    assert idx.stats.blocks_stored == 2  # the aborted blocks were never stored
    empty = PrefixIndex(tier1_slots=4, block_size=4)
    empty.abort(empty.begin(keys("c", 3), 12, 3)[0])
    assert empty.blocks == {} and empty.used_slots(1) == 0


def test_index_pins_protect_a_running_request_from_eviction():
    idx = PrefixIndex(tier1_slots=3, block_size=4)
    a = keys("a", 2)
    idx.commit(idx.begin(a, 8, 2)[0])
    # the scheduler begins a step's members one by one: the one picked first holds its pins
    running, moves = idx.begin(a + keys("x", 1), 12, 0)  # a is in use, nothing new kept
    other, more = idx.begin(keys("b", 3), 12, 3)  # wants 3 blocks: only the free one, a's stay
    assert running.cached_tokens == 8 and moves == more == [] and idx.stats.lookups == 3
    assert [b.hash for b in other.new] == [b"b1"] and idx.stats.overflow_blocks == 2 and idx.stats.blocks_evicted == 0
    assert set(a) <= set(idx.blocks)
    idx.commit(other)
    idx.commit(running)
    later, _ = idx.begin(keys("c", 2), 8, 2)  # a unpinned now: LRU leaves make room
    assert len(later.new) == 2 and idx.stats.blocks_evicted == 2
    idx.commit(later)


def test_index_begin_restores_second_tier_blocks_and_returns_the_moves():
    idx = PrefixIndex(tier1_slots=2, tier2_slots=2, block_size=4)
    a = keys("a", 2)
    idx.commit(idx.begin(a, 8, 2)[0])
    idx.commit(idx.begin(keys("b", 2), 8, 2)[0])  # a's blocks offloaded to tier 2
    assert all(idx.blocks[h].tier == 2 for h in a)
    ticket, moves = idx.begin(a + keys("z", 1), 12, 0)
    assert ticket.cached_tokens == 8 and all(b.tier == 1 for b in ticket.matched)
    # a1 back over b2 (dropped: tier 2 holds only pinned blocks), a2 back over b1 (offloaded to a1's old slot)
    assert [(m.src_tier, m.dst_tier) for m in moves] == [(2, 1), (1, 2), (2, 1)]
    assert idx.stats.blocks_restored == 2 and idx.stats.blocks_evicted == 1
    idx.abort(ticket)


def test_index_begin_needs_the_block_size():
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(tier1_slots=2).begin([b"x"], 4, 1)


def test_longrope_regimes_never_share_cached_blocks(family_folders):
    """A LongRoPE model rotates a prompt by its whole length's regime (short factors up to the
    original context length, 64 here, long past it): a short prompt's cached prefix must not serve
    a long prompt that starts the same. Every result equals the same prompt on a fresh engine; a
    multi-item request runs in its longest item's regime, and one whose items fall on both sides
    of the switch is refused by name."""
    folder = family_folders["phi3_longrope_partial"]
    rng = random.Random(5)
    profile = [rng.randrange(300) for _ in range(48)]
    short, long = profile + [rng.randrange(300) for _ in range(10)], profile + [rng.randrange(300) for _ in range(40)]
    config = dict(model=folder, dtype="float32", threads=2, cache_block_size=16, cache_budget_bytes=8 << 20)
    with Engine(EngineConfig(**config)) as fresh:
        want_long = fresh.score(long, [5, 17])
        want_items = [fresh.score(profile + item, [5, 17]) for item in ([1] * 20, [2] * 30)]
    with Engine(EngineConfig(**config)) as engine:
        first = engine.score(short, [5, 17])
        assert first.cached_tokens == 0
        got = engine.score(long, [5, 17])  # same 48-token profile, other regime: no hit
        assert got.cached_tokens == 0
        assert [t.logprob for t in got.tokens] == pytest.approx([t.logprob for t in want_long.tokens], abs=1e-4)
        again = engine.score(long, [5, 17])  # the long regime's own blocks do hit (all 5 full blocks of 88 tokens)
        assert again.cached_tokens == 80 and [t.logprob for t in again.tokens] == pytest.approx(
            [t.logprob for t in want_long.tokens], abs=1e-4)
        items = engine.score_items(profile, [[1] * 20, [2] * 30], [5, 17])  # 68 and 78 tokens: both long
        for g, w in zip(items, want_items):
            assert [t.logprob for t in g.tokens] == pytest.approx([t.logprob for t in w.tokens], abs=1e-4)
        with pytest.raises(InvalidRequestError, match="both sides of 64 tokens"):
            engine.score_items(profile, [[1] * 5, [2] * 30], [5, 17])


def test_a_pool_slot_is_one_contiguous_block_of_every_layer():
    """Slot-major: moving a block between tiers is one contiguous copy of k and of v (on CUDA a
    direct DMA to pinned memory, where a strided slot would go through a pageable temporary); a
    layer's pages are views the attention kernels read by strides. Nothing is pinned on CPU."""
    g = torch.Generator().manual_seed(3)
    pool = KVPool(3, 4, 2, B, 8, torch.float32, torch.device("cpu"))
    pool.k.zero_(), pool.v.zero_()
    assert pool.k[1].is_contiguous() and pool.k[1].shape == (3, 2, B, 8) and pool.pinned_bytes == 0
    k_pages, v_pages = pool.pages(2)
    assert k_pages.shape == (4, 2, B, 8) and k_pages.data_ptr() == pool.k[0, 2].data_ptr()
    k, v = torch.randn(2, 2 * B, 8, generator=g), torch.randn(2, 2 * B, 8, generator=g)
    pool.write(2, torch.tensor([3, 1]), k, v)
    assert torch.equal(pool.k[3, 2], k[:, :B]) and torch.equal(pool.v[1, 2], v[:, B:])
    assert not pool.k[:, :2].any() and not pool.v[:, :2].any()  # the other layers untouched
    k_back, v_back = torch.empty(2, 2 * B - 3, 8), torch.empty(2, 2 * B - 3, 8)
    pool.read(2, torch.tensor([3, 1]), k_back, v_back)
    assert torch.equal(k_back, k[:, : 2 * B - 3]) and torch.equal(v_back, v[:, : 2 * B - 3])
