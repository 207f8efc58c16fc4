"""Which waiting request runs next (docs/design.md §4, "continuous JCT calibration").

  fcfs  arrival order.
  sjf   shortest estimated job first, the estimate frozen at arrival (plain SJF: it cannot
        see prefixes that other requests put into the cache after it arrived).
  csjf  before every pick, re-estimate every waiting request against the cache as it is now
        and run the argmin of  jct(uncached, cached) - lambda * waited  (lambda converts the
        paper's 500 tokens of credit per second waited into seconds with the fitted cost of
        one token), so cache hits created meanwhile move requests forward and nobody starves.
A request's `priority` (higher first) comes before the policy; the policy orders a class.

Batching (pick_batch): one forward step computes several requests packed together. The step
is filled in the policy's order, within one priority class, while the members' uncached tokens
fit the token budget and the runner's `fits` callback (the predicted peak of the step's
workspace plan against the activation budget) accepts them; the first request always runs,
alone if it is over either budget. Two requests that would compute the same not-yet-cached
blocks never share a step: the second waits one step and then finds them cached.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..errors import OverloadedError
from .jct import JctEstimator

POLICIES = ("fcfs", "sjf", "csjf")
# the engine's defaults, for callers that build a Scheduler without an EngineConfig
DEFAULT_LAMBDA_TOKENS_PER_S = EngineConfig.default_of("lambda_tokens_per_s")
DEFAULT_MAX_WAITING = EngineConfig.default_of("max_waiting")


@dataclass(eq=False)
class WaitingRequest:
    prompt_tokens: int
    block_hashes: list = field(default_factory=list)  # the prompt's prefix-cache keys, hashed once
    priority: int = 0
    deadline: float | None = None  # clock() time after which it must not start
    payload: object = None  # what the engine runs; opaque here
    kept_blocks: int = 0  # leading blocks of block_hashes the request will keep in the cache
    runs_alone: bool = False  # never batched with other requests (e.g. multi-item)
    arrived: float = 0.0
    seq: int = 0
    frozen_estimate_s: float = 0.0  # SJF's estimate, taken at arrival


class Scheduler:
    """The waiting set and the pick. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, policy: str, estimator: JctEstimator, cached_tokens: Callable[[WaitingRequest], int],
                 max_waiting: int = DEFAULT_MAX_WAITING, lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S,
                 clock: Callable[[], float] = time.monotonic, block_size: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.estimator = estimator
        self.cached_tokens = cached_tokens  # request -> leading tokens cached right now
        self.max_waiting = max_waiting
        self.lambda_tokens_per_s = lambda_tokens_per_s
        self.clock = clock
        self.block_size = block_size  # tokens per cache block (0: no cache, no block conflicts)
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

    def split(self, req: WaitingRequest) -> tuple[int, int]:
        """(uncached, cached) tokens of the request against the cache as it is now (at least
        one token is always computed)."""
        cached = min(self.cached_tokens(req), req.prompt_tokens - 1)
        return req.prompt_tokens - cached, cached

    def estimate(self, req: WaitingRequest) -> float:
        return self.estimator.predict(*self.split(req))

    def cost(self, req: WaitingRequest, now: float) -> float:
        if self.policy == "fcfs":
            return float(req.seq)
        if self.policy == "sjf":
            return req.frozen_estimate_s
        credit_s = self.lambda_tokens_per_s * self.estimator.seconds_per_token * (now - req.arrived)
        return self.estimate(req) - credit_s

    def _order_key(self, now: float):
        return lambda r: (-r.priority, self.cost(r, now), r.seq)

    def pick(self) -> WaitingRequest | None:
        """Remove and return the request to run next (None if nothing waits)."""
        if not self._waiting:
            return None
        best = min(self._waiting, key=self._order_key(self.clock()))
        self._waiting.remove(best)
        return best

    def pick_batch(self, token_budget: int, fits: Callable[[list[tuple[int, int]]], bool] | None = None) -> list[WaitingRequest]:
        """Remove and return the requests of the next forward step, in the policy's order
        (empty if nothing waits). `fits([(uncached, cached), ...])` says whether such a step
        fits the memory budget; see the module docstring for the rules."""
        if not self._waiting:
            return []
        order = sorted(self._waiting, key=self._order_key(self.clock()))
        first = order[0]
        batch, shape = [first], [self.split(first)]
        tokens = shape[0][0]
        computing = set()  # the first block each member computes and keeps
        if not first.runs_alone and tokens < token_budget and (fits is None or fits(shape)):
            self._note_computed(first, computing)
            for req in order[1:]:
                if req.priority != first.priority or tokens >= token_budget:
                    break
                if req.runs_alone:
                    continue
                member = self.split(req)
                uncached = member[0]
                if tokens + uncached > token_budget or self._first_computed_block(req) in computing:
                    continue
                if fits is not None and not fits(shape + [member]):
                    continue
                batch.append(req)
                shape.append(member)
                tokens += uncached
                self._note_computed(req, computing)
        for req in batch:
            self._waiting.remove(req)
        return batch

    def _first_computed_block(self, req: WaitingRequest, kept_only: bool = False) -> bytes | None:
        """The hash of the first uncached block of the request (None: every block is cached, or
        with kept_only, the request keeps none of the blocks it computes). Two requests compute
        a common block only if they share every block before it, so they compute a common block
        exactly when their first computed blocks are equal."""
        if not self.block_size:
            return None
        i = self.cached_tokens(req) // self.block_size
        last = min(req.kept_blocks, len(req.block_hashes)) if kept_only else len(req.block_hashes)
        return req.block_hashes[i] if i < last else None

    def _note_computed(self, req: WaitingRequest, computing: set) -> None:
        block = self._first_computed_block(req, kept_only=True)
        if block is not None:
            computing.add(block)

    def put_back(self, req: WaitingRequest) -> None:
        """Return a picked request that the runner could not start after all (it keeps its
        place: arrival time and order are unchanged)."""
        self._waiting.append(req)

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
