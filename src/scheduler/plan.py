"""The typed objects that cross the scheduler -> runner boundary (tensor-free).

    WaitingRequest[P]  one queued request as the scheduler sees it (token counts, block keys,
                       priority, deadline) plus the caller's payload P (the engine's: a Future
                       and its ScoreRequest; the simulator's: a trace request)
    TokenSplit         (uncached, cached) tokens of one prompt against the prefix cache
    StepBudget         what one forward step may hold: a token budget and a memory check
    StepPlan[P]        the scheduler's decision for one step: its members, each with the
                       prefix-cache ticket pinned while it was picked, and the cache's data moves
                       (tier restores, offloads) to execute before the forward

The plan is final: every member fits the step's budgets with its real (pinned) split, so the
runner computes it as given and nothing is handed back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:  # the cache index is tensor-free, but its package imports torch
    from ..cache.index import IndexTicket, Move

P = TypeVar("P")


class TokenSplit(NamedTuple):
    """A prompt's tokens against the prefix cache: `uncached` are computed, `cached` read."""

    uncached: int
    cached: int


@dataclass(eq=False)
class WaitingRequest(Generic[P]):
    prompt_tokens: int  # every token the request computes (a multi-item request: shared prompt + items)
    block_hashes: list = field(default_factory=list)  # the (shared) prompt's prefix-cache keys, hashed once
    priority: int = 0
    deadline: float | None = None  # clock() time after which it must not start
    payload: P | None = None  # what the caller runs when it is picked; opaque to the scheduler
    kept_blocks: int = 0  # leading blocks of block_hashes the request will keep in the cache
    runs_alone: bool = False  # never batched with other requests (e.g. multi-item)
    cache_prompt_tokens: int | None = None  # tokens the prefix cache sees (multi-item: the shared prompt); None = prompt_tokens
    arrived: float = 0.0
    seq: int = 0
    frozen_estimate_s: float = 0.0  # SJF's estimate, taken at arrival

    @property
    def cache_tokens(self) -> int:
        return self.prompt_tokens if self.cache_prompt_tokens is None else self.cache_prompt_tokens


@dataclass(frozen=True)
class StepBudget:
    """tokens: uncached tokens one step may pack. fits(shape): whether a step of these splits
    fits the memory budget (None: no memory check). A step's first member always runs, alone
    if it is over either budget (the runner then decides how, or refuses it with a clear error)."""

    tokens: int
    fits: Callable[[list[TokenSplit]], bool] | None = None

    def admits(self, shape: list[TokenSplit]) -> bool:
        return sum(s.uncached for s in shape) <= self.tokens and (self.fits is None or self.fits(shape))


@dataclass(eq=False)
class StepMember(Generic[P]):
    request: WaitingRequest[P]
    split: TokenSplit  # as its ticket found the cache (the truth, not an estimate)
    ticket: IndexTicket | None  # pinned prefix + reserved blocks to keep; None without a cache


@dataclass(eq=False)
class StepPlan(Generic[P]):
    members: list[StepMember[P]] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)  # the cache's data moves, in order, before the forward

    def __bool__(self) -> bool:
        return bool(self.members)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def shape(self) -> list[TokenSplit]:
        return [m.split for m in self.members]

    @property
    def tokens(self) -> int:
        return sum(m.split.uncached for m in self.members)
