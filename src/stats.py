"""What the engine counts, and the snapshot Engine.stats() returns (for metrics, tests, benchmarks).

EngineCounters has one owner, the scheduler (it counts refusals at submit, cancellations, and each
step's outcome in finish()), always under the engine's lock; EngineStats is a copy taken under
that lock, so a reader never sees a half-updated step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor-free, but the cache package imports torch
    from .cache.index import CacheStats


@dataclass
class EngineCounters:
    completed: int = 0
    failed: Counter = field(default_factory=Counter)  # error code (or exception type) -> requests
    rejected: Counter = field(default_factory=Counter)  # error code -> requests refused or failed before they ran
    cancelled: int = 0  # cancelled by the caller while waiting
    inplace_attention: int = 0  # forwards that had to write attention in place to fit the budget
    item_tokens_computed: int = 0  # items of multi-item requests (never go through the prefix cache)

    def copy(self) -> "EngineCounters":
        return EngineCounters(self.completed, Counter(self.failed), Counter(self.rejected), self.cancelled,
                              self.inplace_attention, self.item_tokens_computed)


@dataclass(frozen=True)
class StepRecord:
    """One forward step: prompt tokens it computed, requests it answered, and the time the worker
    spent not computing while this step's work was already waiting (its idle gap)."""

    tokens: int
    requests: int
    idle_gap_s: float


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    counters: EngineCounters
    jct_mean_abs_rel_error: float | None
    tokens_computed: int  # every token the executor ran (prompts, shared prompts and items)
    steps: int  # forward steps run since start
    recent_steps: list[StepRecord]  # the last few steps, oldest first (steps - len(recent_steps) came before)
    dtype: str
    dtype_reason: str  # why `dtype` was chosen (EngineConfig.dtype_reason)
    budget_bytes: dict[str, int]  # weights, activation, cache_tier1[, cache_tier2]
    attention_backend: str = ""  # what the engine attends with (attention_backend "auto" resolved at start)
    linear_backend: str = ""  # what its GEMMs run on (linear_backend "auto" resolved at start)
    score_head: str = ""  # how the logits that become scores are computed (kernels/score_head.py, chosen at start)
    kernel_check: str = ""  # the Triton kernels' start-up check against torch and what fell back ("": none ran here)
    cache: CacheStats | None = None  # the prefix cache's counters (a copy); None without a cache
    cache_bytes_in_use: dict[int, int] = field(default_factory=dict)  # tier -> bytes
    queued_work_s: float = 0.0  # the running step's predicted rest + the waiting requests' work as it will run (Scheduler.queued_work_s; the fleet picker reads it)
    jct_coefficients: object = None  # the JCT fit (scheduler.jct.JctCoefficients), None before one exists

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the engine computed: with a prefix cache its misses (every prompt's and
        shared prompt's uncached tokens) plus the items of multi-item requests, which never go
        through the cache; without one, every token the executor ran."""
        if self.cache is not None:
            return self.cache.miss_tokens + self.counters.item_tokens_computed
        return self.tokens_computed

    @property
    def failed(self) -> int:
        return sum(self.counters.failed.values())
