"""The fleet picker's decision: which replica completes a request soonest.

For each live replica the picker predicts the request's completion time there as

    backlog(replica, now) + jct(uncached, cached on that replica)

  backlog   the seconds of work the replica has queued, as it last reported it (its engine's own
            JCT estimates of what waits and runs), drained at one second per second since the
            report, plus what the picker itself sent it since (so a burst is not all sent to the
            replica that looked idle at the last report);
  jct       the replica's own fitted JCT model (scheduler/jct.py: a + b*u + k*u*(u + 2c), as it
            reported its coefficients; before a report, `fallback_s_per_token` * u), with
            c = the request's leading blocks the picker believes that replica holds (HeldBlocks:
            the chained block hashes of what it sent there, LRU at the replica's cache size in
            blocks; an approximation, since the picker does not see evictions forced by others).

and picks the lowest cost = completion + `work_weight` x jct: the request's own completion time,
plus what its compute costs everyone queued behind it on that replica. Without that term a
greedy pick sends a user's second request (its profile still computing for the first) to an idle
replica, where it finishes as early but computes the profile again: the fleet's work grows, and
at 64 simulated engines the hit rate fell from Maglev's 63% to 42% and the mean tripled. A user's
requests stay on the replica they last went to unless another's cost is lower by more than
`stick_margin_s` (hysteresis: two replicas within noise of each other do not split a user).

Tensor-free and clock-free (`now` is passed in): the live picker and the fleet simulator
(perf/simulate.py, routing "picker") run this same code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ...contract.jct import JctCoefficients, predict_jct

DEFAULT_STICK_MARGIN_S = 0.05
DEFAULT_WORK_WEIGHT = 10.0  # swept at 64 simulated engines: 1 -> hit 51%, 3 -> 62%, 5-30 -> 72-74% (the ideal), P99 best at 10 (RESULTS.md)


@dataclass
class HeldBlocks:
    """What the picker believes one replica's prefix cache holds: block keys in LRU order,
    at most `capacity` of them (the replica's cache size in blocks)."""
    capacity: int
    _keys: OrderedDict = field(default_factory=OrderedDict)

    def leading(self, keys: Sequence[Hashable]) -> int:
        """How many of `keys`' leading blocks are held (a chain: the first miss ends the match)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def record(self, keys: Sequence[Hashable]) -> None:
        """The replica was sent `keys`: it will hold them, most recently used."""
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class ReplicaView:
    """The picker's view of one replica."""
    held: HeldBlocks
    coefficients: JctCoefficients | None = None
    backlog_s: float = 0.0  # queued seconds as of `backlog_at`
    backlog_at: float = 0.0
    reported_at: float | None = None  # when its last report was taken (None: never)

    def backlog(self, now: float) -> float:
        return max(0.0, self.backlog_s - (now - self.backlog_at))


@dataclass(frozen=True)
class Choice:
    replica: Hashable
    predicted_s: dict  # replica -> predicted completion seconds from now
    cached_blocks: int  # on the chosen replica


class Picker:
    def __init__(self, block_size: int, capacity_blocks: int, fallback_s_per_token: float,
                 stick_margin_s: float = DEFAULT_STICK_MARGIN_S, work_weight: float = DEFAULT_WORK_WEIGHT):
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError(f"block_size must be >= 1 and capacity_blocks >= 0, not {block_size}, {capacity_blocks}")
        self.block_size, self.capacity_blocks = block_size, capacity_blocks
        self.fallback_s_per_token, self.stick_margin_s = fallback_s_per_token, stick_margin_s
        self.work_weight = work_weight
        self.replicas: dict[Hashable, ReplicaView] = {}
        self._last: dict[Hashable, Hashable] = {}  # user -> the replica its last request went to

    def set_members(self, members: Sequence[Hashable]) -> None:
        """The live replicas from now on: a new one starts with an empty view, a gone one is forgotten."""
        self.replicas = {m: self.replicas.get(m) or ReplicaView(HeldBlocks(self.capacity_blocks)) for m in members}

    def report(self, replica: Hashable, queued_work_s: float, coefficients: JctCoefficients | None, at: float) -> None:
        """A replica's published state, taken at `at`: what it has queued, its JCT fit."""
        view = self.replicas.get(replica)
        if view is None:
            return  # not (or no longer) a member
        view.backlog_s, view.backlog_at, view.reported_at = max(0.0, queued_work_s), at, at
        if coefficients is not None:
            view.coefficients = coefficients

    def predict(self, replica: Hashable, block_keys: Sequence[Hashable], prompt_tokens: int, now: float) -> tuple[float, float, int]:
        """(predicted completion seconds from `now`, compute seconds, leading blocks held) of a
        request on `replica`; at least one token is always computed."""
        view = self.replicas[replica]
        held = view.held.leading(block_keys)
        cached = min(held * self.block_size, prompt_tokens - 1)
        compute = predict_jct(view.coefficients, self.fallback_s_per_token, prompt_tokens - cached, cached)
        return view.backlog(now) + compute, compute, held

    def pick(self, user: Hashable | None, block_keys: Sequence[Hashable], prompt_tokens: int, now: float,
             kept_blocks: int | None = None) -> Choice:
        """The replica of lowest cost (completion + work_weight x compute; the user's last one
        unless another costs less by more than stick_margin_s); the choice is recorded: its
        backlog grows by the request's predicted compute and it is taken to hold the request's
        blocks (the first `kept_blocks` of them when given: a replica keeps a request's prefix
        blocks only, as the engine discards a suffix's K/V). `user`: whose requests stick together,
        any hashable (the live picker passes (tenant, user): two tenants' same name are two users);
        `block_keys` already name the cache they read (the picker's service roots them in both)."""
        if not self.replicas:
            raise LookupError("no live replica to pick")
        predicted = {r: self.predict(r, block_keys, prompt_tokens, now) for r in self.replicas}
        cost = {r: done + self.work_weight * compute for r, (done, compute, _) in predicted.items()}
        best = min(cost, key=cost.get)
        last = self._last.get(user) if user is not None else None
        if last in cost and cost[last] <= cost[best] + self.stick_margin_s:
            best = last
        view = self.replicas[best]
        seconds, _, held = predicted[best]
        view.backlog_s, view.backlog_at = seconds, now  # its backlog now ends when this request does
        view.held.record(block_keys if kept_blocks is None else block_keys[:kept_blocks])
        if user is not None:
            self._last[user] = best
        return Choice(best, {r: p[0] for r, p in predicted.items()}, held)
