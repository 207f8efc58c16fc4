"""Envoy 1.40's consistent-hash placement, modelled exactly: which replica a user lands on.

The fleet's front door (prefillonly.serving.host.envoy_config) routes a request carrying
`x-prefillonly-user` by hashing the header with RING_HASH or MAGLEV and bounded load. This module
rebuilds Envoy's own tables from the same inputs, so the simulator's fleet mode routes as the real
proxy does and a test can predict, user by user, where Envoy sends each one (tests/fleet/test_fleet.py
checks the prediction against the real Envoy). What it follows, from Envoy's source
(load_balancing_policies/{ring_hash,maglev,common/thread_aware_lb_impl}):

- request hash: XXH64 (seed 0) of the header value;
- a host's key: its `envoy.lb` hash_key metadata, else its address as Envoy prints it
  ("10.0.0.7:8000"). The front door sets the metadata to the replica's HTTP address
  (Upstream.key) in every cluster, so the keys here are those; only healthy hosts are in the table
  (the front door turns Envoy's panic threshold off, so a failed host never comes back into it);
- equal weights, normalised 1/N as a double (weight x 1.0 / sum);
- RING_HASH (defaults minimum_ring_size 1024, maximum 8M): scale = min(ceil(w x 1024) / w, max);
  running sums give each host "key_0", "key_1", ... XXH64 points in host order; the ring sorted; a
  hash goes to the first point >= it (wrapping). The points per host are ~1024/N, so removing or
  adding a host changes every other host's points: some users move between two hosts that both
  stayed (~12% of them on 3 -> 2);
- MAGLEV (table size 65537, prime): hosts sorted by key; offset = XXH64(key, 0) % M, skip =
  XXH64(key, 1) % (M - 1) + 1; round-robin fill of each host's permutation into the table; a hash
  goes to table[hash % M];
- bounded load (hash_balance_factor F, percent): a host is overloaded when its active requests >
  max(ceil(ceil((cluster active + 1) x F / 100) x w), 1); then hosts are tried in a shuffle by
  std::mt19937 seeded with the hash (the low 32 bits), the first one not overloaded taken, else the
  least overloaded.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import numpy as np
import xxhash

POLICIES = ("RING_HASH", "MAGLEV")
MAGLEV_TABLE_SIZE = 65537
RING_MIN_SIZE, RING_MAX_SIZE = 1024, 8 * 1024 * 1024


def _xxh64(text: str, seed: int = 0) -> int:
    return xxhash.xxh64_intdigest(text.encode(), seed=seed)


def request_hash(user: str) -> int:
    """The hash Envoy's header hash policy gives one header value."""
    return _xxh64(user)


class RingHashTable:
    """Envoy's ring (RingHashLoadBalancer::Ring) over `hosts` in the cluster's host order."""

    def __init__(self, hosts: Sequence[str], min_ring_size: int = RING_MIN_SIZE, max_ring_size: int = RING_MAX_SIZE):
        if not hosts:
            raise ValueError("a ring needs at least one host")
        self.hosts = list(hosts)
        weight = 1 * 1.0 / len(self.hosts)  # normalizeHostWeights: weight x locality weight / sum
        scale = min(math.ceil(weight * min_ring_size) / weight, float(max_ring_size))
        points: list[tuple[int, int]] = []
        current, target = 0.0, 0.0
        for index, host in enumerate(self.hosts):
            target += scale * weight
            i = 0
            while current < target:
                points.append((_xxh64(f"{host}_{i}"), index))
                i += 1
                current += 1
        points.sort(key=lambda p: p[0])
        self._hashes = [h for h, _ in points]
        self._owners = [e for _, e in points]

    def primary(self, h: int) -> str:
        """The host of the first point at or after `h`, wrapping to the start."""
        i = bisect.bisect_left(self._hashes, h)
        return self.hosts[self._owners[i % len(self._hashes)]]


class MaglevTable:
    """Envoy's Maglev lookup table (OriginalMaglevTable; the compact one fills it identically)."""

    def __init__(self, hosts: Sequence[str], table_size: int = MAGLEV_TABLE_SIZE):
        if not hosts:
            raise ValueError("a Maglev table needs at least one host")
        self.hosts = list(hosts)
        self.table_size = m = table_size
        keys = sorted(self.hosts)  # Envoy sorts by hash key so the table does not depend on host order
        offsets = [_xxh64(k, 0) % m for k in keys]
        skips = [_xxh64(k, 1) % (m - 1) + 1 for k in keys]
        nexts = [0] * len(keys)
        table = np.full(m, -1, dtype=np.int32)
        filled = 0
        # equal weights: every host takes one slot per round, in sorted order
        while filled < m:
            for e in range(len(keys)):
                if filled == m:
                    break
                c = (offsets[e] + skips[e] * nexts[e]) % m
                while table[c] >= 0:
                    nexts[e] += 1
                    c = (offsets[e] + skips[e] * nexts[e]) % m
                table[c] = e
                nexts[e] += 1
                filled += 1
        by_key = {k: self.hosts.index(k) for k in keys}
        self._table = np.array([by_key[keys[e]] for e in range(len(keys))], dtype=np.int32)[table]

    def primary(self, h: int) -> str:
        return self.hosts[int(self._table[h % self.table_size])]


def build_table(policy: str, hosts: Sequence[str]) -> RingHashTable | MaglevTable:
    if policy == "RING_HASH":
        return RingHashTable(hosts)
    if policy == "MAGLEV":
        return MaglevTable(hosts)
    raise ValueError(f"policy {policy!r} unknown; choose one of {', '.join(POLICIES)}")


def mt19937_words(seed: int):
    """The outputs of C++'s std::mt19937(seed), one by one (numpy's legacy seeding of a 32-bit
    integer is the same init_genrand, and a full-range uint32 draw is the raw output)."""
    state = np.random.RandomState(seed & 0xFFFFFFFF)
    while True:
        yield from (int(w) for w in state.randint(0, 2**32, size=16, dtype=np.uint32))


class EnvoyPlacement:
    """Where Envoy sends a user: the table's host, or, with bounded load, Envoy's seeded probe."""

    def __init__(self, policy: str, hosts: Sequence[str], hash_balance_factor: int = 0):
        self.policy, self.hosts, self.factor = policy, list(hosts), hash_balance_factor
        self.table = build_table(policy, hosts)

    def host_of(self, user: str, active: Mapping[str, int] | None = None) -> str:
        """The host Envoy picks for `user` given each host's active requests (None: an idle fleet)."""
        h = request_hash(user)
        host = self.table.primary(h)
        if not self.factor or not active:
            return host
        weight = 1 * 1.0 / len(self.hosts)
        total_slots = ((sum(active.values()) + 1) * self.factor + 99) // 100
        slots = max(math.ceil(total_slots * weight), 1)

        def overload(name: str) -> float:
            return active.get(name, 0) / slots

        best, best_factor = host, overload(host)
        if best_factor <= 1.0:
            return host
        order = list(range(len(self.hosts)))
        words = mt19937_words(h)
        for i in range(len(self.hosts)):
            k = len(self.hosts) - i
            x = k
            while x >= k:
                x = next(words) // (2**32 // k)
            order[i], order[i + x] = order[i + x], order[i]
            alt = self.hosts[order[i]]
            if alt == host:
                continue
            f = overload(alt)
            if f <= 1.0:
                return alt
            if f < best_factor:
                best, best_factor = alt, f
        return best


def classify_moves(before: Mapping, after: Mapping, old_hosts, new_hosts) -> dict:
    """Of the users of `before` (user -> host, as `after`), going from hosts `old_hosts` to
    `new_hosts`: the fraction whose host changed ("moved"), split into those whose old host is gone
    ("forced": they must move), those moved to a host that is new ("to_new"), and those moved
    between two hosts that are in both sets ("between_kept": avoidable, a cold cache for nothing)."""
    kept = set(old_hosts) & set(new_hosts)
    counts = {"forced": 0, "to_new": 0, "between_kept": 0}
    for user, old in before.items():
        new = after[user]
        if new != old:
            counts["forced" if old not in kept else "to_new" if new not in kept else "between_kept"] += 1
    n = len(before)
    return {"moved": sum(counts.values()) / n, **{k: v / n for k, v in counts.items()}}


def moved_fraction(policy: str, before: Sequence[str], after: Sequence[str], users: Sequence[str]) -> dict:
    """classify_moves of `users` on an idle fleet whose hosts go from `before` to `after`."""
    a, b = build_table(policy, before), build_table(policy, after)
    hashes = {u: request_hash(u) for u in users}
    return classify_moves({u: a.primary(h) for u, h in hashes.items()}, {u: b.primary(h) for u, h in hashes.items()},
                          before, after)
