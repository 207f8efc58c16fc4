"""PrefillRunner: one device's compute. It turns a step the scheduler planned into results.

It owns the executor, the prefix cache's tensors, the memory meter and the activation budget, and
feeds the JCT estimator with each step's measured time. The scheduler has already decided the
step (scheduler/plan.py: every member pinned in the cache and checked against the budgets on its
real split); the Engine (loading, public API, waiting set, worker loop) hands it here:

    runner.prepare(plan)                # the cache's data moves (tier restores, offloads)
    runner.release(member)              # a member cancelled before it started
    outcome = runner.run(members)       # one ForwardBatch; commit the kept blocks; StepOutcome

A step of several requests is one ForwardBatch (their uncached tokens packed row after row);
a multi-item request is a step of its own: its shared prompt (K/V captured), then its items
batched over that K/V.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache.prefix_cache import PrefixCache
from .cache.prefix_cache import CacheTicket
from .stats import EngineCounters
from .prefix_io import PrefixKV
from .errors import OverBudgetError
from .executor import ForwardBatch, HybridPrefillExecutor, Sequence
from .kernels.attention import inplace_attention_supported
from .memory import PeakMemoryMeter, predict_batch_peak_bytes
from .request import ScoreRequest
from .result import ScoreResult
from .scheduler import JctEstimator, StepMember, StepPlan, TokenSplit
from .scoring import build_result


@dataclass
class MemberOutcome:
    """One member's answer: its result (a multi-item request: one per item) or its error."""

    member: StepMember[ScoreRequest]
    result: ScoreResult | list[ScoreResult] | None = None
    error: BaseException | None = None


@dataclass
class StepOutcome:
    members: list[MemberOutcome]  # one per member run, in step order
    computed_tokens: int = 0  # prompt tokens the step's forwards computed (0 if it failed)


class PrefillRunner:
    def __init__(self, executor: HybridPrefillExecutor, cache: PrefixCache | None, activation_budget_bytes: int,
                 chunk_size: int | None, max_batch_tokens: int, jct: JctEstimator, token_text, counters: EngineCounters):
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
                                        self.executor.attention_backend, self.device, self.executor.linear_backend)

    def fits(self, members: list[TokenSplit]) -> bool:
        """Whether a step of `members` fits the activation budget with attention out of place
        (the scheduler's memory check: StepBudget.fits)."""
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
            self.counters.inplace_attention += 1
            return True
        raise OverBudgetError(
            f"a {new_tokens + prefix_tokens}-token prompt needs ~{need(inplace_attention_supported(self.device)) / 2**20:.1f} MiB "
            f"of activation memory, over the budget of {self.activation_budget_bytes / 2**20:.1f} MiB "
            f"(raise activation_budget_bytes or lower chunk_size)"
        )

    # -- a step ------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> None:
        """Execute the cache's data moves the plan's pins made (restores and offloads between
        tiers), in order, before any member's forward writes a block."""
        if self.cache is not None:
            self.cache.execute(plan.moves)

    def release(self, member: StepMember) -> None:
        """A member that will not run after all (cancelled before it started): release its ticket."""
        if member.ticket is not None:
            self.cache.abort(member.ticket)

    def run(self, members: list[StepMember[ScoreRequest]]) -> StepOutcome:
        """Compute the members; one outcome per member (its result, or the exception its
        request fails with). Every ticket is committed on success and released on failure."""
        if not members:
            return StepOutcome([])
        tickets = [self.cache.attach(m.ticket) if m.ticket is not None else None for m in members]
        try:
            if len(members) == 1 and members[0].request.payload.runs_alone:
                results = [self._run_items(members[0].request.payload, tickets[0])]
            else:
                results = self._run_batch(members, tickets)
        except BaseException as e:  # every member gets exactly one answer
            for m in members:
                self.release(m)
            return StepOutcome([MemberOutcome(m, error=e) for m in members])
        for m in members:
            if m.ticket is not None:
                self.cache.commit(m.ticket)
        return StepOutcome([MemberOutcome(m, result=r) for m, r in zip(members, results)],
                           computed_tokens=sum(m.split.uncached for m in members))

    def _run_batch(self, members: list[StepMember[ScoreRequest]], tickets: list[CacheTicket | None]) -> list[ScoreResult]:
        shape = [m.split for m in members]
        requests = [m.request.payload for m in members]
        # a step of several passed fits() (out of place); a single request may need attention in place
        inplace = self.needs_inplace_attention(*shape[0]) if len(members) == 1 else False
        batch = ForwardBatch([_uncached_sequence(r.token_ids, t) for r, t in zip(requests, tickets)])
        t0 = time.perf_counter()
        self.meter.start()
        out = self.executor.forward_batch(batch, self.chunk_size, inplace)
        peak = self.meter.peak_growth()
        self.jct.observe_step(shape, time.perf_counter() - t0)
        return [build_result(out.logits[i], r.allowed_ids, r.top_k, self.token_text, len(r.token_ids), split.cached, peak)
                for i, (r, split) in enumerate(zip(requests, shape))]

    def _run_items(self, request: ScoreRequest, ticket: CacheTicket | None) -> list[ScoreResult]:
        """The shared prompt once (its K/V captured for this request only, whatever the cache
        budget), then the items, as many per forward as the token and memory budgets allow."""
        shared, items = request.token_ids, request.item_ids
        p = _cached(ticket)
        inplace_shared = self.needs_inplace_attention(len(shared) - p, p, captured=len(shared))
        # the items run while the shared K/V is held: count it like a capture of that size
        inplace_items = self.needs_inplace_attention(max(map(len, items)), len(shared), captured=len(shared))
        regime = request.rope_length  # the shared part and every item rotate as its longest item does
        shared_kv: PrefixKV = self.executor.forward_batch(
            ForwardBatch([_uncached_sequence(shared, ticket, capture=(0, len(shared)), rope_length=regime)]), self.chunk_size,
            inplace_shared).captured[0]
        results: list[ScoreResult] = []
        for group in self._item_groups(items, len(shared), inplace_items):
            self.meter.start()
            out = self.executor.forward_batch(
                ForwardBatch([Sequence(torch.tensor(items[j], dtype=torch.long), prefix=shared_kv, rope_length=regime)
                              for j in group]),
                self.chunk_size, inplace_items)
            peak = self.meter.peak_growth()
            # items never go through the prefix cache, so its miss count leaves them out: counted here
            self.counters.item_tokens_computed += sum(len(items[j]) for j in group)
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


def _cached(ticket: CacheTicket | None) -> int:
    return ticket.cached_tokens if ticket is not None else 0


def _uncached_sequence(ids: list[int], ticket: CacheTicket | None, capture: tuple[int, int] | None = None,
                       rope_length: int | None = None) -> Sequence:
    """The tokens the cache did not hold, fed the cached prefix and keeping the ticket's blocks."""
    p = _cached(ticket)
    return Sequence(torch.tensor(ids[p:], dtype=torch.long), prefix=ticket.source if ticket else None,
                    sink=ticket.sink if ticket else None, capture=capture, rope_length=rope_length)
