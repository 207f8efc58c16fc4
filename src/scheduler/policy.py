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

Tenants (teams sharing a server; a request's `tenant`, None being one tenant of its own): within
a priority class the tenants take turns. A request sorts by (-priority, round, cost, seq), its
round being the turns its tenant has taken in the class (requests picked since it last had nothing
waiting there; one joining starts level with the fewest of those waiting) plus its rank among its
tenant's waiting requests by the policy's key (cost, seq): every round holds each waiting tenant's
next best request, in the policy's order. Why: the policy compares requests, not teams, so one
team's burst (200 short requests) would queue every other team's work behind all of it; with
turns, another team's request waits about one pick per tenant waiting. With one tenant every
round follows the key and the order is the policy's own.

A step (schedule): one forward computes several requests packed together. The step is filled in
the policy's order, within one priority class; each candidate is pinned in the prefix cache as it
is picked (PrefixView.begin), so its real split is what the step's budgets (StepBudget: uncached
tokens, and the predicted peak of the step's workspace plan against the activation budget) are
checked against, and a candidate that does not fit is released at once. The first request
always runs: alone if it is over the token budget; over the memory budget with attention in
place, or refused (one that could not fit even with nothing cached was refused at add()). Two requests that would compute the same
not-yet-cached blocks never share a step: the second waits one step and then finds them cached.

The step's three calls (plan.py): schedule() takes the expired requests out (answered, not run),
picks the step, drops members cancelled meanwhile and decides how the lone member runs within the
activation budget (forward_plan.py); finish() commits or aborts every member's cache ticket and
counts the outcome. The scheduler is the one owner of the prefix-cache tickets (through its
PrefixView) and of the request counters.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable

from ..cache.index import usable_cached_tokens
from ..contract.errors import DeadlineExceededError, OverloadedError, PrefillOnlyError
from ..contract.limits import DEFAULT_MAX_WAITING
from ..stats import EngineCounters
from .forward_plan import attention_in_place, item_modes, plan_items
from .groups import group_costs
from ..contract.jct import JctEstimator
from .plan import Answer, Schedulable, StepBudget, StepMember, StepOutcome, StepPlan, TokenSplit, span_of
from .prefix_view import NoPrefixCache, PrefixView

POLICIES = ("fcfs", "sjf", "csjf", "csjf-independent")
# The scheduler's own defaults; EngineConfig reads them (its settings of the same names).
DEFAULT_LAMBDA_TOKENS_PER_S = 500.0  # the paper's starvation guard: tokens of credit per second waited


class Scheduler:
    """The waiting set and the pick. Not thread-safe: the engine calls it under its lock, from
    its worker (the only thread that changes the prefix cache)."""

    def __init__(self, policy: str, estimator: JctEstimator, prefix: PrefixView | None = None, *,
                 budget: StepBudget = StepBudget(1), max_waiting: int = DEFAULT_MAX_WAITING,
                 lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S, clock: Callable[[], float] = time.monotonic):
        """budget: what one step may hold (default one request per step, no memory check)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.estimator = estimator
        self.budget = budget
        self.prefix = prefix or NoPrefixCache()
        self.block_size = self.prefix.block_size  # 0: no cache, no block conflicts, no groups
        self.max_waiting = max_waiting
        self.lambda_tokens_per_s = lambda_tokens_per_s
        self.clock = clock
        self.counters = EngineCounters()
        self._waiting: list[Schedulable] = []
        self._seq = itertools.count()
        # turns each (priority, tenant) with requests waiting has taken (requests picked): the rounds
        # go on across picks, so a tenant that just ran waits for the others' turns
        self._turns: dict[tuple[int, str | None], int] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Schedulable) -> None:
        """Queue a request; raises (and counts as rejected) when the waiting set is full or the
        request could not fit the activation budget even with nothing cached."""
        try:
            if len(self._waiting) >= self.max_waiting:
                raise OverloadedError(f"overloaded: {len(self._waiting)} requests already waiting (max_waiting {self.max_waiting}); retry later")
            self._check_fits_alone(req)
        except PrefillOnlyError as e:
            self.counters.rejected[e.code] += 1
            raise
        req.arrived = self.clock()
        req.seq = next(self._seq)
        if self.policy == "sjf":
            req.frozen_estimate_s = self.estimate(req)
        self._join_turns(req)
        self._waiting.append(req)

    def _join_turns(self, req: Schedulable) -> None:
        """A tenant with nothing waiting in the request's class starts level with those that have
        (the fewest turns among them): no credit for the time it was away (it would take every
        pick until it caught up), no debt for the turns it took before."""
        present = {(r.priority, r.tenant) for r in self._waiting}
        self._turns = {k: n for k, n in self._turns.items() if k in present}  # forget who left
        key = (req.priority, req.tenant)
        if key not in self._turns:
            self._turns[key] = min((n for (p, _), n in self._turns.items() if p == req.priority), default=0)

    # -- estimates ---------------------------------------------------------------------------
    def split(self, req: Schedulable, cached_tokens: int | None = None) -> TokenSplit:
        """The request's tokens against the cache as it is now (at least one token is always
        computed); `cached_tokens`: the cache's answer if already asked during this pick."""
        if cached_tokens is None:
            cached_tokens = self.prefix.cached_tokens(req)
        cached = usable_cached_tokens(cached_tokens, req.cache_tokens)
        return TokenSplit(req.prompt_tokens - cached, cached)

    def estimate(self, req: Schedulable, cached_tokens: int | None = None) -> float:
        return self.estimator.predict(*self.split(req, cached_tokens))

    def queued_work_s(self) -> float:
        """Seconds of work waiting, as it will run (what a replica publishes to the fleet's picker):
        each waiting request's estimate against the cache as it will be by then. Blocks cached now,
        being computed by the running step, or kept by an earlier waiting request count as cached:
        a user's posts queued behind the request computing its profile are warm work. (Each counted
        against the cache as it is now, a hot user's burst of posts made its replica look several
        times busier than it was, and the picker sent everyone else away: perf/RESULTS.md.)"""
        if not self.block_size:
            return sum(self.estimate(r) for r in self._waiting)
        pending: set[bytes] = set()
        total = 0.0
        for r in self._waiting:  # in arrival order (only appended to): who computes a shared prefix first
            held = self.prefix.held_blocks(r, pending)
            total += self.estimate(r, held * self.block_size)
            pending.update(r.block_hashes[held : r.kept_blocks])
        return total

    def credit_s(self, arrived: float, now: float) -> float:
        """CSJF's starvation credit of a request that arrived at `arrived`, in seconds."""
        return self.lambda_tokens_per_s * self.estimator.seconds_per_token * (now - arrived)

    def cost(self, req: Schedulable, now: float, cached_tokens: int | None = None) -> float:
        if self.policy == "fcfs":
            return float(req.seq)
        if self.policy == "sjf":
            return req.frozen_estimate_s
        return self.estimate(req, cached_tokens) - self.credit_s(req.arrived, now)

    def order(self) -> list[Schedulable]:
        """Every waiting request in the policy's order (the next step is filled from the front)."""
        now = self.clock()
        if not (self.policy == "csjf" and self.block_size):
            return self._tenant_turns({r: self.cost(r, now) for r in self._waiting})
        cached = {r: self.prefix.cached_tokens(r) for r in self._waiting}  # asked once per request per pick
        costs = {r: self.cost(r, now, cached[r]) for r in self._waiting}
        groups = group_costs(self._waiting, self.block_size, lambda r: cached[r] // self.block_size,
                             lambda r: self.estimate(r, cached[r]), lambda s: self.estimator.predict(*s),
                             lambda t: self.credit_s(t, now))
        for leader, group_cost in groups.items():
            costs[leader] = min(costs[leader], group_cost)
        return self._tenant_turns(costs)

    def _tenant_turns(self, costs: dict[Schedulable, float]) -> list[Schedulable]:
        """The waiting requests by (-priority, round, cost, seq), a request's round being its
        tenant's turns taken in its class plus its rank among the tenant's waiting requests there
        by (cost, seq): the tenants take turns (module docstring). A dependency group never spans
        tenants: a tenant's block keys are its own (contract.tenants.tenant_namespace)."""
        classes: dict[tuple, list[Schedulable]] = defaultdict(list)
        for r in self._waiting:
            classes[r.priority, r.tenant].append(r)
        rank: dict[Schedulable, int] = {}
        for key, members in classes.items():
            members.sort(key=lambda r: (costs[r], r.seq))
            rank.update((r, self._turns.get(key, 0) + i) for i, r in enumerate(members))
        return sorted(self._waiting, key=lambda r: (-r.priority, rank[r], costs[r], r.seq))

    # -- the step's three calls: schedule, (the runner's execute), finish ---------------------------
    def schedule(self) -> StepPlan:
        """The next step: the expired requests taken out and answered (plan.refused), the members
        picked and pinned in the policy's order, those cancelled meanwhile dropped, and how the
        lone member runs decided (an empty plan if nothing is left to run)."""
        plan = StepPlan()
        for req in self.take_expired():
            self._refuse(plan, req, DeadlineExceededError("deadline passed while the request waited; it was not run"))
        self._pick(plan)
        for m in list(plan.members):
            if not m.request.start(m.split.cached):  # cancelled between its pick and now
                self._release(plan, m)
        if len(plan.members) == 1:
            self._plan_lone_member(plan)
        return plan

    def finish(self, plan: StepPlan, outcome: StepOutcome) -> list[Answer]:
        """The step ran: each member's ticket committed (its kept blocks become matchable) or, if
        the step failed, aborted; the outcome counted and the forward's time fed to the JCT
        estimate; one Answer per member, in step order."""
        for m in plan.members:
            if m.ticket is not None:
                (self.prefix.abort if outcome.error is not None else self.prefix.commit)(m.ticket)
        if outcome.error is not None:
            self.counters.failed[error_code(outcome.error)] += len(plan.members)
            return [Answer(m.request, error=outcome.error) for m in plan.members]
        self.counters.completed += len(plan.members)
        self.counters.item_tokens_computed += outcome.item_tokens
        if outcome.forward_s is not None:
            self.estimator.observe_step(plan.shape, outcome.forward_s)
        return [Answer(m.request, result=r) for m, r in zip(plan.members, outcome.results)]

    def fail_all(self, error: BaseException) -> list[Answer]:
        """The scheduler itself failed: every waiting request (not cancelled) fails with `error`."""
        answers = [Answer(r, error=error) for r in self.drain() if r.start()]
        self.counters.failed[error_code(error)] += len(answers)
        return answers

    def refuse_all(self, error: PrefillOnlyError) -> list[Answer]:
        """The engine closes: every waiting request (not cancelled) is refused with `error`."""
        answers = [Answer(r, error=error) for r in self.drain() if r.start()]
        self.counters.rejected[error.code] += len(answers)
        return answers

    def cancel(self, req: Schedulable) -> None:
        """The caller cancelled a request: out of the waiting set (if it still waits), counted."""
        if self.remove(req):
            self.counters.cancelled += 1

    # -- the pick ----------------------------------------------------------------------------
    def _pick(self, plan: StepPlan) -> None:
        """Move the requests of the next forward step from the waiting set into `plan`, pinned, in
        the policy's order; see the module docstring for the rules."""
        budget = self.budget
        if not self._waiting:
            return
        order = self.order()
        first = order[0]
        self._admit(first, plan)
        computing = set()  # the first block each member computes and keeps
        if not first.runs_alone and budget.admits(plan.shape, logprob_spans=plan.spans):
            self._note_computed(plan.members[0], computing)
            for req in order[1:]:
                if req.priority != first.priority or plan.tokens >= budget.tokens:
                    break
                if req.runs_alone or self._first_computed_block(req) in computing:
                    continue
                # the estimate first: pinning reserves the blocks to keep, which may evict others'
                # blocks for good, so only a candidate that fits as estimated is pinned (the real
                # split differs only when a tier-2 restore finds no room)
                if not budget.admits(plan.shape + [self.split(req)], logprob_spans=plan.spans + [span_of(req)]):
                    continue
                member = self._admit(req, plan)
                if not budget.admits(plan.shape, logprob_spans=plan.spans):
                    self._release(plan, member)
                    continue
                self._note_computed(member, computing)
        for m in plan.members:
            self._waiting.remove(m.request)
            key = (m.request.priority, m.request.tenant)
            self._turns[key] = self._turns.get(key, 0) + 1  # its tenant took a turn

    def _plan_lone_member(self, plan: StepPlan) -> None:
        """A step of one may be over the memory budget: in place, or refused (its ticket released)."""
        member = plan.members[0]
        try:
            plan.inplace_attention, plan.items = self._plan_forward(member.request, member.split.cached)
        except PrefillOnlyError as e:
            self._release(plan, member)
            self._refuse(plan, member.request, e, started=True)
            return
        self.counters.inplace_attention += plan.inplace_attention + (
            plan.items.shared_inplace + plan.items.items_inplace if plan.items else 0)

    def _check_fits_alone(self, req: Schedulable) -> None:
        """OverBudgetError if `req` could not run even alone with nothing cached (no item groups:
        those are planned when it is picked)."""
        if req.item_tokens is not None:
            item_modes(self.budget, req.cache_tokens, 0, req.item_tokens, req.item_logprobs, req.continuation_tokens)
        else:
            attention_in_place(self.budget, [TokenSplit(req.prompt_tokens, 0)], logprob_spans=[span_of(req)])

    def _plan_forward(self, req: Schedulable, cached: int):
        """(attention in place, ItemsPlan or None) for `req` run alone with `cached` tokens read."""
        if req.item_tokens is not None:
            return False, plan_items(self.budget, req.cache_tokens, cached, req.item_tokens, req.item_logprobs,
                                     req.continuation_tokens)
        return attention_in_place(self.budget, [TokenSplit(req.prompt_tokens - cached, cached)],
                                  logprob_spans=[span_of(req)]), None

    def _refuse(self, plan: StepPlan, req: Schedulable, error: PrefillOnlyError, started: bool = False) -> None:
        if started or req.start():
            self.counters.rejected[error.code] += 1
            plan.refused.append(Answer(req, error=error))

    def _admit(self, req: Schedulable, plan: StepPlan) -> StepMember:
        ticket, moves = self.prefix.begin(req)
        plan.moves += moves  # kept even if the member is released: the index already moved the blocks
        cached = ticket.cached_tokens if ticket is not None else 0
        member = StepMember(req, TokenSplit(req.prompt_tokens - cached, cached), ticket)
        plan.members.append(member)
        return member

    def _release(self, plan: StepPlan, member: StepMember) -> None:
        plan.members.remove(member)
        if member.ticket is not None:
            self.prefix.abort(member.ticket)

    def _first_computed_block(self, req: Schedulable) -> bytes | None:
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
    def remove(self, req: Schedulable) -> bool:
        try:
            self._waiting.remove(req)
            return True
        except ValueError:
            return False

    def take_expired(self) -> list[Schedulable]:
        now = self.clock()
        expired = [r for r in self._waiting if r.deadline is not None and r.deadline <= now]
        for r in expired:
            self._waiting.remove(r)
        return expired

    def drain(self) -> list[Schedulable]:
        out, self._waiting = self._waiting, []
        return out


def error_code(error: BaseException) -> str:
    """What the counters file an error under: its code, else its type's name."""
    return getattr(error, "code", type(error).__name__)
