"""Which waiting request runs next (DESIGN.md §2, "continuous JCT calibration").

  fcfs  arrival order.
  sjf   shortest estimated job first, the estimate frozen at arrival (plain SJF: it cannot
        see prefixes that other requests put into the cache after it arrived).
  csjf  before every pick, re-estimate every waiting request against the cache as it is now
        and run the argmin of  jct(uncached, cached) - lambda * waited  (lambda converts the
        paper's 500 tokens of credit per second waited into seconds with the fitted cost of
        one token), so cache hits created meanwhile move requests forward and nobody starves.
A request's `priority` (higher first) comes before the policy; the policy orders a class.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import OverloadedError
from .jct import JctEstimator

POLICIES = ("fcfs", "sjf", "csjf")
DEFAULT_LAMBDA_TOKENS_PER_S = 500.0  # the paper's starvation guard


@dataclass(eq=False)
class WaitingRequest:
    prompt_tokens: int
    block_hashes: list = field(default_factory=list)  # the prompt's prefix-cache keys, hashed once
    priority: int = 0
    deadline: float | None = None  # clock() time after which it must not start
    user: str | None = None
    payload: object = None  # what the engine runs; opaque here
    arrived: float = 0.0
    seq: int = 0
    frozen_estimate_s: float = 0.0  # SJF's estimate, taken at arrival


class Scheduler:
    """The waiting set and the pick. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, policy: str, estimator: JctEstimator, cached_tokens: Callable[[WaitingRequest], int],
                 max_waiting: int = 4096, lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.estimator = estimator
        self.cached_tokens = cached_tokens  # request -> leading tokens cached right now
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

    def estimate(self, req: WaitingRequest) -> float:
        cached = min(self.cached_tokens(req), req.prompt_tokens - 1)
        return self.estimator.predict(req.prompt_tokens - cached, cached)

    def cost(self, req: WaitingRequest, now: float) -> float:
        if self.policy == "fcfs":
            return float(req.seq)
        if self.policy == "sjf":
            return req.frozen_estimate_s
        credit_s = self.lambda_tokens_per_s * self.estimator.seconds_per_token * (now - req.arrived)
        return self.estimate(req) - credit_s

    def pick(self) -> WaitingRequest | None:
        """Remove and return the request to run next (None if nothing waits)."""
        if not self._waiting:
            return None
        now = self.clock()
        best = min(self._waiting, key=lambda r: (-r.priority, self.cost(r, now), r.seq))
        self._waiting.remove(best)
        return best

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
