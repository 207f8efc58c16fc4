"""Dependency groups: one cold request that makes others warm is ranked for all of them.

Waiting requests that would compute the same first uncached block share every uncached block up
to where their prompts part (block keys are chained). Only one of them can compute those blocks
(two requests never compute the same block in one step), and once it has kept them the others
read them from the cache. So they form a group: a leader, which computes and keeps the shared
blocks, and followers, which the leader's step makes warm.

Ranking the leader by its own estimate alone (plain CSJF) treats the requests as independent: a
new user's 2K-token profile waits behind every warm request, and so do all of that user's other
requests. Smith's rule (weighted shortest processing time) orders jobs by processing time over
weight; for the group taken as one job that is

    group cost = (jct(leader) + sum of jct(follower, warm after the leader)) / (1 + followers)

against jct(r) for an independent request. Before credit, exchanging the group with an
independent request lowers the total completion time exactly when its group cost is lower (the
group is a chain: the leader first, then its followers), so against other cold work (a profile
that many requests wait on against one that few do) this order lowers the mean. Against warm
work the group cost is above a warm request's, so Smith's rule alone would keep the group
waiting; what moves it is the starvation credit, which the group shares (its oldest member's):
a cold profile that holds up F requests overtakes warm work after 1/(1 + F) of the wait plain
CSJF gives it. That lowers the tail and costs the warm requests it overtakes some mean (the
simulator at paper scale: P99 0.46-0.89x plain CSJF's, mean 1.0-1.4x; perf/RESULTS.md). A group
of one is plain CSJF, so without shared blocks the order is unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from ..cache.index import usable_cached_tokens
from .plan import TokenSplit, Schedulable


def shared_blocks(a: list[bytes], b: list[bytes], start: int, stop: int) -> int:
    """How many blocks from `start` the key lists a and b (and b only up to `stop`) have in
    common. Keys are chained (a key covers every token before it), so equal keys at j mean equal
    keys before j: a binary search."""
    lo, hi = start, min(len(a), len(b), stop)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo - start


def group_costs(waiting: list[Schedulable], block_size: int, cached_blocks: Callable[[Schedulable], int],
                estimate: Callable[[Schedulable], float], predict: Callable[[TokenSplit], float],
                credit_s: Callable[[float], float]) -> dict[Schedulable, float]:
    """{leader: its group cost} for every group with followers (docstring above). cached_blocks(r):
    r's leading blocks cached now; estimate(r): r's JCT estimate against the cache now;
    predict(split): the JCT estimate of a split; credit_s(arrived): the starvation credit of a
    request that arrived then."""
    groups: dict[tuple[int, bytes], list[tuple[Schedulable, int]]] = defaultdict(list)
    for r in waiting:
        i = cached_blocks(r)
        if i < len(r.block_hashes):
            groups[(r.priority, r.block_hashes[i])].append((r, i))
    out: dict[Schedulable, float] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        keepers = [(estimate(r), r, i) for r, i in members if r.kept_blocks > i]
        if not keepers:
            continue  # nobody keeps the shared blocks: nobody waits for anybody
        # the leader: the best plain CSJF rank (estimate - credit) among the keepers
        total, leader, i = min(keepers, key=lambda eri: (eri[0] - credit_s(eri[1].arrived), eri[1].seq))
        followers, oldest = 0, leader.arrived
        for r, _ in members:
            if r is leader:
                continue
            n = shared_blocks(r.block_hashes, leader.block_hashes, i, leader.kept_blocks)
            if n == 0:
                continue
            cached = usable_cached_tokens((i + n) * block_size, r.cache_tokens)
            total += predict(TokenSplit(r.prompt_tokens - cached, cached))
            followers += 1
            oldest = min(oldest, r.arrived)
        if followers:
            out[leader] = total / (1 + followers) - credit_s(oldest)
    return out
