"""What prefillonly_prompt_tokens_total{source="computed"} counts (EngineStats.computed_prompt_tokens), on a real
engine's stats: every token the layers ran, multi-item items included. (The metric's export
through Triton is tested against a real tritonserver in test_triton_server.py.)"""

from __future__ import annotations

import random

import pytest

from prefillonly import Engine, EngineConfig
from prefillonly.cache.index import CacheStats
from prefillonly.stats import EngineCounters, EngineStats

B = 8


def _stats(tokens_computed, cache=None, item_tokens=0):
    return EngineStats(waiting=0, counters=EngineCounters(item_tokens_computed=item_tokens), jct_mean_abs_rel_error=None,
                       tokens_computed=tokens_computed, steps=0, recent_steps=[], dtype="float32", dtype_reason="explicit",
                       budget_bytes={}, cache=cache)


def test_computed_tokens_count_the_cache_misses_and_every_item():
    assert _stats(999, CacheStats(miss_tokens=120, hit_tokens=64), item_tokens=30).computed_prompt_tokens == 150
    assert _stats(999, CacheStats(miss_tokens=120)).computed_prompt_tokens == 120  # no multi-item yet
    assert _stats(77, item_tokens=30).computed_prompt_tokens == 77  # no cache: the executor's count


def rand_ids(n, seed):
    r = random.Random(seed)
    return [r.randrange(0, 300) for _ in range(n)]


@pytest.mark.parametrize("cache_budget_bytes", [1 << 20, 0])
def test_prompt_tokens_metric_counts_multi_item_items_as_computed(family_folders, cache_budget_bytes):
    config = EngineConfig(model=family_folders["llama_gqa_llama3rope_untied"], dtype="float32", threads=2,
                          cache_block_size=B, chunk_size=16, cache_budget_bytes=cache_budget_bytes)
    with Engine(config) as engine:
        baseline = engine.stats()
        shared = rand_ids(3 * B + 2, seed=1)
        items = [rand_ids(n, seed=10 + n) for n in (3, 9, 5)]
        engine.score_items(shared, items, [5, 17])
        plain = rand_ids(2 * B, seed=2)
        engine.score(shared[: 2 * B] + plain, [5, 17])  # a plain request after it (a hit if there is a cache)
        stats = engine.stats()
        computed = stats.computed_prompt_tokens - baseline.computed_prompt_tokens
        cached = stats.cache.hit_tokens - baseline.cache.hit_tokens if stats.cache else 0
        hit = 2 * B if cache_budget_bytes else 0
        assert cached == hit
        assert computed == len(shared) + sum(map(len, items)) + 2 * B + 2 * B - hit
        assert computed == engine.executor.tokens_computed - baseline.tokens_computed  # what the layers ran
