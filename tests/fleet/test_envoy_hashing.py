"""The model of Envoy's consistent hashing (perf/envoy_hashing.py) on what holds by construction:
the C++ generator and hash it relies on, Maglev's balance and order independence, and the bounded
load rule. That it places users exactly as the real Envoy does is checked against Envoy itself in
tests/fleet/test_fleet.py (real replicas) and perf/bench_placement.py."""

from __future__ import annotations

import random

import pytest

from perf import envoy_hashing as eh


def test_the_generator_and_hash_are_the_ones_envoy_uses():
    words = eh.mt19937_words(5489)  # C++'s default seed: the standard fixes its 10,000th output
    for _ in range(9999):
        next(words)
    assert next(words) == 4123659995
    assert eh.request_hash("") == 0xEF46DB3751D8E999  # XXH64 of nothing, seed 0


@pytest.mark.heavy
def test_maglev_gives_every_host_a_near_equal_share_whatever_the_host_order():
    rng = random.Random(3)
    for n in (1, 2, 3, 7, 64):
        hosts = [f"10.0.{rng.randrange(256)}.{rng.randrange(1, 255)}:{rng.randrange(1024, 65535)}" for _ in range(n)]
        table = eh.MaglevTable(hosts)
        counts = [int((table._table == i).sum()) for i in range(n)]
        assert sum(counts) == eh.MAGLEV_TABLE_SIZE and max(counts) - min(counts) <= 1
        shuffled = eh.MaglevTable(rng.sample(hosts, n))
        users = [f"user{i}" for i in range(500)]
        assert [table.primary(eh.request_hash(u)) for u in users] == [shuffled.primary(eh.request_hash(u)) for u in users]


def test_ring_gives_each_host_ceil_1024_over_n_points():
    for n in (1, 3, 8, 64, 1500):
        ring = eh.RingHashTable([f"h{i}:1" for i in range(n)])
        per_host = -(-1024 // n)
        assert len(ring._hashes) == n * per_host


def test_bounded_load_sends_a_user_elsewhere_only_while_its_host_is_over_the_bound():
    hosts = [f"127.0.0.1:{8000 + 10 * i}" for i in range(4)]
    for policy in eh.POLICIES:
        place = eh.EnvoyPlacement(policy, hosts, hash_balance_factor=150)
        home = place.host_of("alice")
        assert place.host_of("alice", {h: 0 for h in hosts}) == home
        # 8 active: slots = max(ceil(ceil((8 + 1) x 150 / 100) / 4), 1) = ceil(14 / 4) = 4, and 5 is over it
        active = {h: 1 for h in hosts}
        active[home] = 5
        other = place.host_of("alice", active)
        assert other != home and active[other] <= 4
        assert place.host_of("alice", active) == other  # Envoy's probe order is seeded by the hash
        active[home] = 3  # 6 active: slots ceil(ceil(7 x 1.5) / 4) = 3, and 3 is not over it
        assert place.host_of("alice", active) == home
