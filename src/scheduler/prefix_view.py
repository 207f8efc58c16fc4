"""What the scheduler asks of the prefix cache: how much of a prompt is cached now, and a ticket's
whole life (pin, then commit or abort) — the scheduler is the one place that begins, commits and
aborts tickets (the runner only executes a step's data moves and hands the executor each
ticket's PrefixCache.access view; nothing else touches a ticket).

The scheduler estimates every waiting request against the cache as it is now (`cached_tokens`)
and pins each member of a step while it picks it (`begin`), so the budget decision is made once,
on the real split: a member whose prefix turns out shorter than estimated (a second-tier block
that found no room in tier 1) is checked against the budgets as it really is, and released
(`abort`) if it does not fit. After the step, `commit` makes a member's kept blocks matchable
(or `abort` releases them if the step failed).

    NoPrefixCache      no cache: nothing cached, nothing pinned
    IndexPrefixView    over the tensor-free PrefixIndex (the engine's cache.index, the simulator's)
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING, Protocol

from .plan import Schedulable

if TYPE_CHECKING:
    from ..cache.index import IndexTicket, Move, PrefixIndex


class PrefixView(Protocol):
    block_size: int  # tokens per cache block (0: no cache, so no block conflicts and no groups)

    def cached_tokens(self, req: Schedulable) -> int:
        """Leading tokens of the request's (shared) prompt cached right now (no pinning)."""

    def held_blocks(self, req: Schedulable, pending: Container[bytes] = ()) -> int:
        """Leading blocks of the request's (shared) prompt cached or being computed by the running
        step, or among `pending` (blocks that earlier waiting requests will keep)."""

    def begin(self, req: Schedulable) -> tuple[IndexTicket | None, list[Move]]:
        """Pin the cached prefix and reserve the blocks to keep; the data moves to execute first."""

    def commit(self, ticket: IndexTicket) -> None:
        """The ticket's step ran: its new blocks become matchable, its pins are released."""

    def abort(self, ticket: IndexTicket) -> None:
        """Release a ticket whose request did not run (dropped, refused, or its step failed)."""


class NoPrefixCache:
    block_size = 0

    def cached_tokens(self, req: Schedulable) -> int:
        return 0

    def held_blocks(self, req: Schedulable, pending: Container[bytes] = ()) -> int:
        return 0

    def begin(self, req: Schedulable) -> tuple[None, list]:
        return None, []

    def commit(self, ticket) -> None:
        pass

    def abort(self, ticket) -> None:
        pass


class IndexPrefixView:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self.block_size = index.block_size

    def cached_tokens(self, req: Schedulable) -> int:
        return self.index.match_length(req.block_hashes) * self.block_size

    def held_blocks(self, req: Schedulable, pending: Container[bytes] = ()) -> int:
        return self.index.held_length(req.block_hashes, pending)

    def begin(self, req: Schedulable) -> tuple[IndexTicket, list[Move]]:
        return self.index.begin(req.block_hashes, req.cache_tokens, req.kept_blocks)

    def commit(self, ticket: IndexTicket) -> None:
        self.index.commit(ticket)

    def abort(self, ticket: IndexTicket) -> None:
        self.index.abort(ticket)
