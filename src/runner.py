"""PrefillRunner: one device's compute. It turns a step of ScoreRequests into results.

It owns the executor, the prefix cache, the memory meter and the activation budget, and feeds
the JCT estimator with each step's measured time. The Engine (loading, public API, waiting set,
worker loop) asks the scheduler for a step and hands it here:

    step = runner.begin(requests)       # pin cached prefixes, reserve blocks to keep (or defer)
    runner.abort(step, i)               # a member cancelled before it started
    outcomes = runner.run(step)         # one ForwardBatch; commit the kept blocks; ScoreResults

A step of several requests is one ForwardBatch (their uncached tokens packed row after row);
a multi-item request is a step of its own: its shared prompt (K/V captured), then its items
batched over that K/V.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from .cache import PrefixCache
from .cache.prefix_cache import CacheTicket
from .prefix_io import PrefixKV
from .errors import OverBudgetError
from .executor import ForwardBatch, HybridPrefillExecutor, Sequence
from .kernels.attention import inplace_attention_supported
from .memory import PeakMemoryMeter, predict_batch_peak_bytes
from .request import ScoreRequest
from .result import ScoreResult
from .scheduler import JctEstimator
from .scoring import build_result


@dataclass
class Step:
    requests: list[ScoreRequest]  # the members that run, in step order
    tickets: list[CacheTicket | None]
    deferred: list[int] = field(default_factory=list)  # indexes (into begin's list) that must wait for a later step
    live: list[bool] = field(default_factory=list)
    computed_tokens: int = 0  # prompt tokens the step's forwards computed (set by run)


class PrefillRunner:
    def __init__(self, executor: HybridPrefillExecutor, cache: PrefixCache | None, activation_budget_bytes: int,
                 chunk_size: int | None, max_batch_tokens: int, jct: JctEstimator, token_text, counters: Counter):
        self.executor = executor
        self.spec, self.dtype, self.device = executor.spec, executor.dtype, executor.device
        self.cache = cache
        self.activation_budget_bytes = activation_budget_bytes
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
        self.jct = jct
        self.token_text = token_text
        self.counters = counters
        self.meter = PeakMemoryMeter(self.device)

    # -- admission -----------------------------------------------------------------------
    def predict_peak_bytes(self, members: list[tuple[int, int]], captured: int = 0, inplace_attention: bool = False) -> int:
        """Predicted peak of one forward over `members` = [(new tokens, prefix tokens)]."""
        return predict_batch_peak_bytes(self.spec, members, self.chunk_size, self.dtype, captured, inplace_attention,
                                        self.executor.attention_backend, self.device)

    def fits(self, members: list[tuple[int, int]]) -> bool:
        """Whether a step of `members` = [(uncached, cached)] fits the activation budget with
        attention out of place (the scheduler's batch check)."""
        return self.predict_peak_bytes(members) <= self.activation_budget_bytes

    def needs_inplace_attention(self, new_tokens: int, prefix_tokens: int, captured: int = 0) -> bool:
        """Admit one forward against the activation budget: whether it must write attention in
        place (CPU: slower, no second [S, q_width] tensor) to fit; OverBudgetError if it fits
        neither way."""

        def need(inplace: bool) -> int:
            return self.predict_peak_bytes([(new_tokens, prefix_tokens)], captured, inplace)

        if need(False) <= self.activation_budget_bytes:
            return False
        if inplace_attention_supported(self.device) and need(True) <= self.activation_budget_bytes:
            self.counters["inplace_attention"] += 1
            return True
        raise OverBudgetError(
            f"a {new_tokens + prefix_tokens}-token prompt needs ~{need(inplace_attention_supported(self.device)) / 2**20:.1f} MiB "
            f"of activation memory, over the budget of {self.activation_budget_bytes / 2**20:.1f} MiB "
            f"(raise activation_budget_bytes or lower chunk_size)"
        )

    # -- a step ------------------------------------------------------------------------------
    def begin(self, requests: list[ScoreRequest]) -> Step:
        """Pin every member's cached prefix and reserve its blocks to keep. A member whose
        prefix turned out shorter than the scheduler saw (its tier-2 blocks found no room) may
        push the step over a budget: it and the rest are deferred (tickets released)."""
        if self.cache is None:
            tickets = [None] * len(requests)
        else:
            tickets = self.cache.begin_many([(r.block_hashes, len(r.token_ids), r.keep_len) for r in requests])
        step = Step(requests=list(requests), tickets=list(tickets), live=[True] * len(requests))
        if len(requests) > 1:
            members = _members(requests, tickets)
            tokens = 0
            for i, (uncached, _) in enumerate(members):
                tokens += uncached
                if i and (tokens > self.max_batch_tokens or not self.fits(members[: i + 1])):
                    step.deferred = list(range(i, len(requests)))
                    break
            for i in reversed(step.deferred):
                self.abort(step, i)
            keep = len(requests) - len(step.deferred)
            step.requests, step.tickets, step.live = step.requests[:keep], step.tickets[:keep], step.live[:keep]
        return step

    def abort(self, step: Step, i: int) -> None:
        """Release member i's ticket: it will not run in this step."""
        if step.live[i] and step.tickets[i] is not None:
            self.cache.abort(step.tickets[i])
        step.live[i] = False

    def run(self, step: Step) -> list[ScoreResult | list[ScoreResult] | BaseException]:
        """Compute the live members; one outcome per member (a result, or the exception that
        member's request fails with; a dead member's outcome is None). Every ticket is
        committed on success and released on failure."""
        live = [i for i, ok in enumerate(step.live) if ok]
        outcomes: list = [None] * len(step.requests)
        if not live:
            return outcomes
        try:
            if len(live) == 1 and step.requests[live[0]].runs_alone:
                i = live[0]
                results = [self._run_items(step.requests[i], step.tickets[i])]
                step.computed_tokens = step.requests[i].total_tokens - _cached(step.tickets[i])
            else:
                results = self._run_batch([step.requests[i] for i in live], [step.tickets[i] for i in live])
                step.computed_tokens = sum(u for u, _ in _members([step.requests[i] for i in live], [step.tickets[i] for i in live]))
        except BaseException as e:  # every member gets exactly one answer
            for i in live:
                if step.tickets[i] is not None:
                    self.cache.abort(step.tickets[i])
                outcomes[i] = e
            return outcomes
        for i, result in zip(live, results):
            if step.tickets[i] is not None:
                self.cache.commit(step.tickets[i])
            outcomes[i] = result
        return outcomes

    def _run_batch(self, requests: list[ScoreRequest], tickets: list[CacheTicket | None]) -> list[ScoreResult]:
        members = _members(requests, tickets)
        # a step of several passed fits() (out of place); a single request may need attention in place
        inplace = self.needs_inplace_attention(*members[0]) if len(requests) == 1 else False
        batch = ForwardBatch([_uncached_sequence(r.token_ids, t) for r, t in zip(requests, tickets)])
        t0 = time.perf_counter()
        self.meter.start()
        out = self.executor.forward_batch(batch, self.chunk_size, inplace)
        peak = self.meter.peak_growth()
        self.jct.observe_step(members, time.perf_counter() - t0)
        return [build_result(out.logits[i], r.allowed_ids, r.top_k, self.token_text, len(r.token_ids), c, peak)
                for i, (r, (_, c)) in enumerate(zip(requests, members))]

    def _run_items(self, request: ScoreRequest, ticket: CacheTicket | None) -> list[ScoreResult]:
        """The shared prompt once (its K/V captured for this request only, whatever the cache
        budget), then the items, as many per forward as the token and memory budgets allow."""
        shared, items = request.token_ids, request.item_ids
        p = _cached(ticket)
        inplace_shared = self.needs_inplace_attention(len(shared) - p, p, captured=len(shared))
        # the items run while the shared K/V is held: count it like a capture of that size
        inplace_items = self.needs_inplace_attention(max(map(len, items)), len(shared), captured=len(shared))
        shared_kv: PrefixKV = self.executor.forward_batch(
            ForwardBatch([_uncached_sequence(shared, ticket, capture=(0, len(shared)))]), self.chunk_size,
            inplace_shared).captured[0]
        results: list[ScoreResult] = []
        for group in self._item_groups(items, len(shared), inplace_items):
            self.meter.start()
            out = self.executor.forward_batch(
                ForwardBatch([Sequence(torch.tensor(items[j], dtype=torch.long), prefix=shared_kv) for j in group]),
                self.chunk_size, inplace_items)
            peak = self.meter.peak_growth()
            # items never go through the prefix cache, so its miss count leaves them out: counted here
            self.counters["item_tokens_computed"] += sum(len(items[j]) for j in group)
            results += [build_result(out.logits[g], request.allowed_ids, request.top_k, self.token_text,
                                     len(shared) + len(items[j]), p, peak) for g, j in enumerate(group)]
        return results

    def _item_groups(self, items: list[list[int]], shared_len: int, inplace: bool) -> list[list[int]]:
        """Consecutive items per forward: while their tokens fit max_batch_tokens and the
        step's prediction (each item loads the shared K/V as its prefix) fits the budget; an
        item that needs attention in place runs alone."""
        groups: list[list[int]] = []
        group: list[int] = []
        tokens = 0
        for j, ids in enumerate(items):
            candidate = [(len(items[g]), shared_len) for g in group] + [(len(ids), shared_len)]
            if group and not inplace and tokens + len(ids) <= self.max_batch_tokens and \
                    self.predict_peak_bytes(candidate, captured=shared_len) <= self.activation_budget_bytes:
                group.append(j)
                tokens += len(ids)
            else:
                if group:
                    groups.append(group)
                group, tokens = [j], len(ids)
        groups.append(group)
        return groups


def _members(requests: list[ScoreRequest], tickets: list[CacheTicket | None]) -> list[tuple[int, int]]:
    """(uncached, cached) tokens of each request's prompt, as its ticket found the cache."""
    return [(len(r.token_ids) - _cached(t), _cached(t)) for r, t in zip(requests, tickets)]


def _cached(ticket: CacheTicket | None) -> int:
    return ticket.cached_tokens if ticket is not None else 0


def _uncached_sequence(ids: list[int], ticket: CacheTicket | None, capture: tuple[int, int] | None = None) -> Sequence:
    """The tokens the cache did not hold, fed the cached prefix and keeping the ticket's blocks."""
    p = _cached(ticket)
    return Sequence(torch.tensor(ids[p:], dtype=torch.long), prefix=ticket.source if ticket else None,
                    sink=ticket.sink if ticket else None, capture=capture)
