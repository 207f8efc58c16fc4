"""The typed objects of one step's three calls (tensor-free):

    plan = scheduler.schedule()                  # StepPlan: who runs, pinned, and how (memory decided)
    outcome = runner.execute(plan)               # StepOutcome: results, or the step's one error
    answers = scheduler.finish(plan, outcome)    # tickets committed / aborted, counters, one Answer each

    Schedulable    what the scheduler reads of a request (token counts, block keys, priority,
                   tenant, deadline) and writes into it (arrival, sequence number); the engine's Request
                   (request.py) and the simulator's records are Schedulables
    WaitingRequest the plain Schedulable (the simulator's and the tests')
    TokenSplit     (uncached, cached) tokens of one prompt against the prefix cache
    StepMemory     the activation-memory model the scheduler checks steps against
    StepBudget     what one step may hold: a token budget and that memory model
    StepPlan       the step: its members, each with its pinned prefix-cache ticket, the cache's
                   data moves to execute first, how attention runs (in place or not) and, for a
                   multi-item request, how its items are grouped; plus the requests the scheduler
                   answered without running them (expired, too big)
    StepOutcome    what the runner hands back
    Answer         one request's result or error, to deliver

The plan is final: every decision (members, splits, memory, item groups) is made by the
scheduler; the runner computes it as given and never refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # types only (the tensor-free index is imported for real where its rules are used)
    from ..cache.index import IndexTicket, Move


class TokenSplit(NamedTuple):
    """A prompt's tokens against the prefix cache: `uncached` are computed, `cached` read."""

    uncached: int
    cached: int


class Schedulable(Protocol):
    prompt_tokens: int  # every token the request computes (a multi-item request: shared prompt + items)
    cache_tokens: int  # tokens the prefix cache sees (a multi-item request: the shared prompt)
    block_hashes: list  # the (shared) prompt's prefix-cache keys, hashed once
    kept_blocks: int  # leading blocks of block_hashes the request will keep in the cache
    runs_alone: bool  # never batched with other requests (multi-item)
    item_tokens: list[int] | None  # a multi-item request's item lengths (None: a plain prompt)
    logprob_rows: int  # rows of the prompt's logprob span (0: none)
    logprob_top_k: int  # top tokens per row of that span
    item_logprobs: bool  # a multi-item request wants each item's own tokens' logprobs (a span of len - 1 rows)
    # per item, the lengths of the continuations scored over it (a tree: decisions' options over their
    # question); None: items only
    continuation_tokens: list[list[int]] | None
    priority: int
    tenant: str | None  # whose request: tenants take turns within a priority class (None: one tenant of its own)
    deadline: float | None  # clock() time after which it must not start
    # written by the scheduler when it is added
    arrived: float
    seq: int
    frozen_estimate_s: float  # SJF's estimate, taken at arrival

    def start(self, cached_tokens: int = 0) -> bool:
        """Called once when the request is picked (`cached_tokens` of it from the prefix cache):
        False if it was cancelled meanwhile (dropped)."""


@dataclass(eq=False)
class WaitingRequest:
    """A Schedulable made of plain fields (the engine's own record is request.Request)."""

    prompt_tokens: int
    block_hashes: list = field(default_factory=list)
    priority: int = 0
    deadline: float | None = None
    kept_blocks: int = 0
    runs_alone: bool = False
    cache_prompt_tokens: int | None = None  # None = prompt_tokens
    item_tokens: list[int] | None = None
    logprob_rows: int = 0
    logprob_top_k: int = 0
    item_logprobs: bool = False
    continuation_tokens: list[list[int]] | None = None
    tenant: str | None = None
    arrived: float = 0.0
    seq: int = 0
    frozen_estimate_s: float = 0.0

    @property
    def cache_tokens(self) -> int:
        return self.prompt_tokens if self.cache_prompt_tokens is None else self.cache_prompt_tokens

    def start(self, cached_tokens: int = 0) -> bool:
        return True


class StepMemory(Protocol):
    """The activation-memory model (memory.ActivationBudget on the engine)."""

    budget_bytes: int
    inplace_supported: bool  # whether attention can be written over Q to save a tensor

    def peak_bytes(self, shape: list[TokenSplit], captured: int = 0, inplace: bool = False,
                   logprob_spans: list[tuple[int, int]] | None = None) -> int:
        """Predicted peak of one forward over `shape`, holding `captured` tokens of K/V besides;
        `logprob_spans`: per member, its logprob span's (rows, top k) (None: none)."""


@dataclass(frozen=True)
class StepBudget:
    """tokens: uncached tokens one step may pack. memory: the activation budget (None: no memory
    check, the simulator's). A step's first member always runs, alone if it is over the token
    budget; one over the memory budget runs with attention in place, or is refused."""

    tokens: int
    memory: StepMemory | None = None

    def admits(self, shape: list[TokenSplit], captured: int = 0, inplace: bool = False,
               logprob_spans: list[tuple[int, int]] | None = None) -> bool:
        return sum(s.uncached for s in shape) <= self.tokens and self.fits_memory(shape, captured, inplace, logprob_spans)

    def fits_memory(self, shape: list[TokenSplit], captured: int = 0, inplace: bool = False,
                    logprob_spans: list[tuple[int, int]] | None = None) -> bool:
        return self.memory is None or self.memory.peak_bytes(shape, captured, inplace, logprob_spans) <= self.memory.budget_bytes


@dataclass(eq=False)
class StepMember:
    request: Schedulable
    split: TokenSplit  # as its ticket found the cache (the truth, not an estimate)
    ticket: IndexTicket | None  # pinned prefix + reserved blocks to keep; None without a cache


@dataclass(frozen=True)
class ItemsPlan:
    """How a multi-item request runs: its shared prompt once (K/V captured), then its items in
    `groups` (item indices per forward) over that K/V; after each group, its items' continuations
    (if any) in `continuations[g]`: (item, continuation) pairs per forward, each over the shared
    K/V and its item's own (captured in the group's forward)."""

    shared_inplace: bool
    items_inplace: bool
    groups: list[list[int]]
    continuations: list[list[list[tuple[int, int]]]] | None = None


@dataclass(eq=False)
class Answer:
    request: Schedulable
    result: Any = None  # a ScoreResult (multi-item: a list of them)
    error: BaseException | None = None


@dataclass(eq=False)
class StepPlan:
    members: list[StepMember] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)  # the cache's data moves, in order, before the forward
    inplace_attention: bool = False  # a lone member that fits only with attention written over Q
    items: ItemsPlan | None = None  # the lone member is a multi-item request: how it runs
    refused: list[Answer] = field(default_factory=list)  # answered without running (counted already)

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

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Per member, its logprob span's (rows, top k): what the step's memory check counts."""
        return [span_of(m.request) for m in self.members]


def span_of(req: Schedulable) -> tuple[int, int]:
    return req.logprob_rows, req.logprob_top_k


@dataclass
class StepOutcome:
    results: list = field(default_factory=list)  # one per member, in step order (empty if the step failed)
    error: BaseException | None = None  # the step failed: every member fails with it
    item_tokens: int = 0  # of which items of a multi-item request (they never go through the cache)
    forward_s: float | None = None  # a batch forward's measured time (the JCT fit's sample); None: none taken
