"""What the scheduler asks of the prefix cache: how much of a prompt is cached now, and a pin.

The scheduler estimates every waiting request against the cache as it is now (`cached_tokens`)
and pins each member of a step while it picks it (`begin`), so the budget decision is made once,
on the real split: a member whose prefix turns out shorter than estimated (a second-tier block
that found no room in tier 1) is checked against the budgets as it really is, and released
(`abort`) if it does not fit.

    NoPrefixCache      no cache: nothing cached, nothing pinned
    IndexPrefixView    over the tensor-free PrefixIndex (the engine's cache.index, the simulator's)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .plan import WaitingRequest

if TYPE_CHECKING:
    from ..cache.index import IndexTicket, Move, PrefixIndex


class PrefixView(Protocol):
    block_size: int  # tokens per cache block (0: no cache, so no block conflicts and no groups)

    def cached_tokens(self, req: WaitingRequest) -> int:
        """Leading tokens of the request's (shared) prompt cached right now (no pinning)."""

    def begin(self, req: WaitingRequest) -> tuple[IndexTicket | None, list[Move]]:
        """Pin the cached prefix and reserve the blocks to keep; the data moves to execute first."""

    def abort(self, ticket: IndexTicket | None) -> None:
        """Release a ticket whose request will not run in this step."""


class NoPrefixCache:
    block_size = 0

    def cached_tokens(self, req: WaitingRequest) -> int:
        return 0

    def begin(self, req: WaitingRequest) -> tuple[None, list]:
        return None, []

    def abort(self, ticket) -> None:
        pass


class IndexPrefixView:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self.block_size = index.block_size

    def cached_tokens(self, req: WaitingRequest) -> int:
        return self.index.match_length(req.block_hashes) * self.block_size

    def begin(self, req: WaitingRequest) -> tuple[IndexTicket, list[Move]]:
        return self.index.begin(req.block_hashes, req.cache_tokens, req.kept_blocks * self.block_size)

    def abort(self, ticket: IndexTicket | None) -> None:
        if ticket is not None:
            self.index.abort(ticket)
