"""Which waiting requests run next (docs/design.md §4, "continuous JCT calibration").

  fcfs   arrival order.
  sjf    shortest estimated job first, the estimate frozen at arrival (plain SJF: it cannot
         see prefixes that other requests put into the cache after it arrived).
  csjf   before every pick, re-estimate every waiting request against the cache as it is now
         and run the argmin of  jct(uncached, cached) - lambda * waited  (lambda converts the
         paper's 500 tokens of credit per second waited into seconds with the fitted cost of
         one token), so cache hits created meanwhile move requests forward and nobody starves;
         a request whose kept blocks other waiting requests need first (a new user's profile)
         is ranked for its whole dependency group by Smith's rule (groups.py).
  csjf-independent   csjf with every request ranked on its own (no groups): the paper's CSJF,
         kept to compare against.
A request's `priority` (higher first) comes before the policy; the policy orders a class.

A step (pick_step): one forward computes several requests packed together. The step is filled in
the policy's order, within one priority class; each candidate is pinned in the prefix cache as it
is picked (PrefixView.begin), so its real split is what the step's budgets (StepBudget: uncached
tokens, and the predicted peak of the step's workspace plan against the activation budget) are
checked against, and a candidate that does not fit is released at once. The first request
always runs, alone if it is over either budget. Two requests that would compute the same
not-yet-cached blocks never share a step: the second waits one step and then finds them cached.
The plan that comes out is final (plan.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from ..errors import OverloadedError
from .groups import group_costs
from .jct import JctEstimator
from .plan import StepBudget, StepMember, StepPlan, TokenSplit, WaitingRequest
from .prefix_view import NoPrefixCache, PrefixView

POLICIES = ("fcfs", "sjf", "csjf", "csjf-independent")
# The scheduler's own defaults; EngineConfig reads them (its settings of the same names).
DEFAULT_LAMBDA_TOKENS_PER_S = 500.0  # the paper's starvation guard: tokens of credit per second waited
DEFAULT_MAX_WAITING = 1024  # waiting requests beyond this are refused at once ("overloaded")


class Scheduler:
    """The waiting set and the pick. Not thread-safe: the engine calls it under its lock, from
    its worker (the only thread that changes the prefix cache)."""

    def __init__(self, policy: str, estimator: JctEstimator, prefix: PrefixView | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.estimator = estimator
        self.prefix = prefix or NoPrefixCache()
        self.block_size = self.prefix.block_size  # 0: no cache, no block conflicts, no groups
        self.max_waiting = max_waiting
        self.lambda_tokens_per_s = lambda_tokens_per_s
        self.clock = clock
        self._waiting: list[WaitingRequest] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: WaitingRequest) -> None:
        if len(self._waiting) >= self.max_waiting:
            raise OverloadedError(f"overloaded: {len(self._waiting)} requests already waiting (max_waiting {self.max_waiting}); retry later")
        req.arrived = self.clock()
        req.seq = next(self._seq)
        if self.policy == "sjf":
            req.frozen_estimate_s = self.estimate(req)
        self._waiting.append(req)

    # -- estimates ---------------------------------------------------------------------------
    def split(self, req: WaitingRequest, cached_tokens: int | None = None) -> TokenSplit:
        """The request's tokens against the cache as it is now (at least one token is always
        computed); `cached_tokens`: the cache's answer if already asked during this pick."""
        if cached_tokens is None:
            cached_tokens = self.prefix.cached_tokens(req)
        cached = min(cached_tokens, req.cache_tokens - 1)
        return TokenSplit(req.prompt_tokens - cached, cached)

    def estimate(self, req: WaitingRequest, cached_tokens: int | None = None) -> float:
        return self.estimator.predict(*self.split(req, cached_tokens))

    def credit_s(self, arrived: float, now: float) -> float:
        """CSJF's starvation credit of a request that arrived at `arrived`, in seconds."""
        return self.lambda_tokens_per_s * self.estimator.seconds_per_token * (now - arrived)

    def cost(self, req: WaitingRequest, now: float, cached_tokens: int | None = None) -> float:
        if self.policy == "fcfs":
            return float(req.seq)
        if self.policy == "sjf":
            return req.frozen_estimate_s
        return self.estimate(req, cached_tokens) - self.credit_s(req.arrived, now)

    def order(self) -> list[WaitingRequest]:
        """Every waiting request in the policy's order (the next step is filled from the front)."""
        now = self.clock()
        if not (self.policy == "csjf" and self.block_size):
            return sorted(self._waiting, key=lambda r: (-r.priority, self.cost(r, now), r.seq))
        cached = {r: self.prefix.cached_tokens(r) for r in self._waiting}  # asked once per request per pick
        costs = {r: self.cost(r, now, cached[r]) for r in self._waiting}
        groups = group_costs(self._waiting, self.block_size, lambda r: cached[r] // self.block_size,
                             lambda r: self.estimate(r, cached[r]), lambda s: self.estimator.predict(*s),
                             lambda t: self.credit_s(t, now))
        for leader, group_cost in groups.items():
            costs[leader] = min(costs[leader], group_cost)
        return sorted(self._waiting, key=lambda r: (-r.priority, costs[r], r.seq))

    # -- the pick ----------------------------------------------------------------------------
    def pick_step(self, budget: StepBudget) -> StepPlan:
        """Remove the requests of the next forward step from the waiting set and return them
        pinned, in the policy's order (an empty plan if nothing waits); see the module
        docstring for the rules."""
        plan = StepPlan()
        if not self._waiting:
            return plan
        order = self.order()
        first = order[0]
        self._admit(first, plan)
        computing = set()  # the first block each member computes and keeps
        if not first.runs_alone and budget.admits(plan.shape):
            self._note_computed(plan.members[0], computing)
            for req in order[1:]:
                if req.priority != first.priority or plan.tokens >= budget.tokens:
                    break
                if req.runs_alone or self._first_computed_block(req) in computing:
                    continue
                # the estimate first: pinning reserves the blocks to keep, which may evict others'
                # blocks for good, so only a candidate that fits as estimated is pinned (the real
                # split differs only when a tier-2 restore finds no room)
                if not budget.admits(plan.shape + [self.split(req)]):
                    continue
                member = self._admit(req, plan)
                if not budget.admits(plan.shape):
                    self._release(plan, member)
                    continue
                self._note_computed(member, computing)
        for m in plan.members:
            self._waiting.remove(m.request)
        return plan

    def _admit(self, req: WaitingRequest, plan: StepPlan) -> StepMember:
        ticket, moves = self.prefix.begin(req)
        plan.moves += moves  # kept even if the member is released: the index already moved the blocks
        cached = ticket.cached_tokens if ticket is not None else 0
        member = StepMember(req, TokenSplit(req.prompt_tokens - cached, cached), ticket)
        plan.members.append(member)
        return member

    def _release(self, plan: StepPlan, member: StepMember) -> None:
        plan.members.remove(member)
        self.prefix.abort(member.ticket)

    def _first_computed_block(self, req: WaitingRequest) -> bytes | None:
        """The hash of the first uncached block of the request (None: every block is cached).
        Two requests compute a common block only if they share every block before it, so they
        compute a common block exactly when their first computed blocks are equal."""
        if not self.block_size:
            return None
        i = self.prefix.cached_tokens(req) // self.block_size
        return req.block_hashes[i] if i < len(req.block_hashes) else None

    def _note_computed(self, member: StepMember, computing: set) -> None:
        """Remember the first block a member computes and keeps (its ticket's first new block)."""
        if member.ticket is not None and member.ticket.new:
            computing.add(member.ticket.new[0].hash)

    # -- the rest of the waiting set's life --------------------------------------------------------
    def remove(self, req: WaitingRequest) -> bool:
        try:
            self._waiting.remove(req)
            return True
        except ValueError:
            return False

    def take_expired(self) -> list[WaitingRequest]:
        now = self.clock()
        expired = [r for r in self._waiting if r.deadline is not None and r.deadline <= now]
        for r in expired:
            self._waiting.remove(r)
        return expired

    def drain(self) -> list[WaitingRequest]:
        out, self._waiting = self._waiting, []
        return out
