"""PrefixIndex: which prefix blocks are cached where, with no tensors in it.

The scheduler and the simulator use it without a model; PrefixCache pairs it with the K/V
pools and executes the data moves it returns. A request's cache lifecycle lives here, tensor-free,
so that the engine's cache and the simulator's run the same rules:

    ticket, moves = index.begin(hashes, prompt_len, kept_blocks)   # match + pin, reserve the blocks to keep
    ... (the caller executes `moves`, computes, fills ticket.new) ...
    index.commit(ticket)   (or index.abort(ticket) if the forward failed)

In the engine the scheduler does both ends (through scheduler/prefix_view.py: begin while it picks
a step, commit or abort in finish) and the runner only executes the moves and hands the executor
PrefixCache.access(ticket). The keep boundary comes in whole blocks (the engine converts the API's
cache_prefix_len once, at submit). At least one token of a prompt is always computed: that rule is
written once, usable_cached_tokens, for the index and the scheduler alike.

Tiers: 1 = the primary pool (next to the compute), 2 = the optional second tier (host
memory on CUDA). Invariants:
  * a block is only in the index while its parent is (a prefix chain never has holes);
  * pinned blocks (refs > 0, used by a running request) are never moved or dropped;
  * tier 1 evicts LRU among unpinned blocks with no tier-1 child (leaves first): to tier 2
    when there is one, else dropped (only with no child at all);
  * tier 2 drops LRU among unpinned blocks with no child.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container
from dataclasses import dataclass


@dataclass
class Block:
    hash: bytes
    parent: bytes | None
    tier: int
    slot: int
    ready: bool = False  # False while its K/V is being computed: not matchable yet
    refs: int = 0
    children: int = 0  # cached children, any tier
    tier1_children: int = 0
    last_used: int = 0  # logical clock of the last pin/unpin: LRU order


@dataclass(frozen=True)
class Move:
    """Copy a block's K/V between tiers (executed by the cache on its pools)."""

    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int


@dataclass
class CacheStats:
    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0  # dropped from the cache altogether
    blocks_offloaded: int = 0  # tier 1 -> tier 2
    blocks_restored: int = 0  # tier 2 -> tier 1
    overflow_blocks: int = 0  # wanted to keep, no room (discarded, never an error)


def usable_cached_tokens(cached_tokens: int, prompt_tokens: int) -> int:
    """How many of a prompt's `prompt_tokens` are read from the cache when its first
    `cached_tokens` are cached: all but the last at most, since at least one token is always
    computed (its row gives the logits). The index, the scheduler's estimates and its dependency
    groups all split a prompt by this rule."""
    return min(cached_tokens, prompt_tokens - 1)


@dataclass
class IndexTicket:
    """A request's hold on the index from begin to commit or abort: the cache's one ticket. The
    scheduler holds it (StepMember.ticket); the executor sees it through PrefixCache.access."""

    cached_tokens: int  # P: prompt tokens whose K/V is read from the cache
    matched: list[Block]  # pinned cached blocks covering [0, P) (last one maybe partly used)
    new: list[Block]  # reserved blocks the forward will fill, right after the matched ones


class PrefixIndex:
    def __init__(self, tier1_slots: int, tier2_slots: int = 0, block_size: int = 0):
        self.block_size = block_size  # tokens per block: begin() needs it (the low-level calls do not)
        self.blocks: dict[bytes, Block] = {}
        self.capacity = {1: tier1_slots, 2: tier2_slots}
        self._free = {1: list(range(tier1_slots - 1, -1, -1)), 2: list(range(tier2_slots - 1, -1, -1))}
        # eviction candidates per tier (unpinned leaves of that tier); the victim is the least
        # recently used one. A scan, not an ordered list: a parent that becomes a leaf when its
        # child goes keeps its own (older) last use, which an append-ordered list would lose.
        self._evictable: dict[int, dict[bytes, Block]] = {1: {}, 2: {}}
        self.stats = CacheStats()
        self._tick = itertools.count()

    # -- queries ------------------------------------------------------------------------
    def match_length(self, hashes: list[bytes]) -> int:
        """How many leading hashes are cached (ready): ready blocks are prefix-closed (a block is
        only ready while its parent is). The scheduler calls this for every waiting request at
        every pick."""
        def ready(h: bytes) -> bool:
            b = self.blocks.get(h)
            return b is not None and b.ready

        return _leading(hashes, ready)

    def held_length(self, hashes: list[bytes], pending: Container[bytes] = ()) -> int:
        """How many leading hashes are held: cached, or reserved by a running step that is computing
        them, or in `pending` (blocks the caller knows will be kept before it matters); the index
        and a `pending` made of chains' prefixes are both prefix-closed."""
        return _leading(hashes, lambda h: h in self.blocks or h in pending)

    def match(self, hashes: list[bytes]) -> list[Block]:
        """The cached (ready) blocks of the longest matching prefix, in order."""
        out = []
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.ready:
                break
            out.append(b)
        return out

    def used_slots(self, tier: int) -> int:
        return self.capacity[tier] - len(self._free[tier])

    # -- pinning --------------------------------------------------------------------------
    def pin(self, blocks: list[Block]) -> None:
        tick = next(self._tick)
        for b in blocks:
            b.refs += 1
            b.last_used = tick
            self._refresh(b)

    def unpin(self, blocks: list[Block]) -> None:
        tick = next(self._tick)
        for b in blocks:
            b.refs -= 1
            assert b.refs >= 0
            b.last_used = tick
            self._refresh(b)

    # -- a request's lifecycle -----------------------------------------------------------------
    def begin(self, hashes: list[bytes], prompt_len: int, kept_blocks: int) -> tuple[IndexTicket, list[Move]]:
        """Match and pin the cached prefix of a prompt of `prompt_len` tokens whose block keys
        are `hashes`, reserve the blocks to keep that are not cached yet (among the first
        `kept_blocks` of `hashes`: the request's keep boundary, in whole blocks). Returns the
        ticket and the data moves to execute, in order, before any block is written. The engine's
        scheduler begins each member of a step as it picks it, so the members picked before
        already hold their pins: one member's evictions never take a block another was promised."""
        if self.block_size < 1:
            raise ValueError("begin() needs the index's block_size (PrefixIndex(..., block_size=B))")
        moves: list[Move] = []
        matched = self.match(hashes)
        self.pin(matched)
        if not self._restore_to_tier1(matched, moves):  # tier 1 too small to hold the matched chain: use what is in tier 1
            first_off = next((j for j, blk in enumerate(matched) if blk.tier != 1), len(matched))
            self.unpin(matched[first_off:])
            matched = matched[:first_off]
        return self._reserve_new(hashes, prompt_len, kept_blocks, matched, moves), moves

    def commit(self, ticket: IndexTicket) -> None:
        """The forward wrote the new blocks: they become matchable; release the ticket's pins."""
        self.mark_ready(ticket.new)
        self.unpin(ticket.matched + ticket.new)

    def abort(self, ticket: IndexTicket) -> None:
        """The forward did not run or failed: release the pins, forget the unwritten blocks."""
        self.unpin(ticket.matched)
        self.discard(ticket.new)

    def _restore_to_tier1(self, matched: list[Block], moves: list[Move]) -> bool:
        """Bring the matched blocks that sit in tier 2 back (their moves appended to `moves`);
        False if tier 1 has no room."""
        for blk in matched:
            if blk.tier == 1:
                continue
            needed = self.restore(blk)
            if needed is None:
                return False
            moves += needed
        return True

    def _reserve_new(self, hashes: list[bytes], prompt_len: int, kept_blocks: int, matched: list[Block],
                     moves: list[Move]) -> IndexTicket:
        """The keep rule and the hit statistics: at least one token is always computed
        (usable_cached_tokens); the first `kept_blocks` blocks that are not cached are reserved
        (those that find no room are overflow)."""
        matched_tokens = len(matched) * self.block_size
        cached = usable_cached_tokens(matched_tokens, prompt_len)
        new: list[Block] = []
        if cached == matched_tokens:  # else everything is cached already
            parent = matched[-1].hash if matched else None
            new, needed = self.reserve_chain(hashes[len(matched) : kept_blocks], parent)
            moves += needed
        self.stats.lookups += 1
        self.stats.hit_tokens += cached
        self.stats.miss_tokens += prompt_len - cached
        return IndexTicket(cached_tokens=cached, matched=matched, new=new)

    # -- changes ----------------------------------------------------------------------------
    def reserve(self, h: bytes, parent: bytes | None) -> tuple[Block | None, list[Move]]:
        """A pinned, not-yet-ready tier-1 block for `h` (its K/V is about to be written), or
        None when no slot can be freed. Returns the data moves the eviction needs first."""
        moves: list[Move] = []
        if h in self.blocks:  # reserved by a request still running: not ours to overwrite
            return None, moves
        slot = self._take_slot(1, moves)
        if slot is None:
            return None, moves
        b = Block(hash=h, parent=parent, tier=1, slot=slot, refs=1, last_used=next(self._tick))
        self.blocks[h] = b
        if parent is not None:
            p = self.blocks[parent]
            p.children += 1
            p.tier1_children += 1
            self._refresh(p)
        return b, moves

    def reserve_chain(self, hashes: list[bytes], parent: bytes | None) -> tuple[list[Block], list[Move]]:
        """reserve() each of `hashes` in turn, each the parent of the next, until one is refused;
        the refused rest is counted as overflow (kept nowhere, never an error). Returns the
        reserved blocks and the data moves their evictions need, to execute in order before
        the blocks are written."""
        blocks: list[Block] = []
        moves: list[Move] = []
        for h in hashes:
            b, needed = self.reserve(h, parent)
            moves += needed
            if b is None:
                self.stats.overflow_blocks += len(hashes) - len(blocks)
                break
            blocks.append(b)
            parent = h
        return blocks, moves

    def mark_ready(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.ready = True
            self.stats.blocks_stored += 1

    def discard(self, blocks: list[Block]) -> None:
        """Forget reserved blocks whose K/V never got written (last first: children first)."""
        for b in reversed(blocks):
            self._remove(b)

    def restore(self, b: Block) -> list[Move] | None:
        """Bring a pinned tier-2 block back to tier 1. Returns the moves to execute in order
        (evictions first, then the block's own copy), or None if tier 1 has no room."""
        moves: list[Move] = []
        slot = self._take_slot(1, moves)
        if slot is None:
            return None
        moves.append(Move(2, b.slot, 1, slot))
        self._free[2].append(b.slot)
        self._set_tier(b, 1, slot)
        self.stats.blocks_restored += 1
        return moves

    # -- internals -----------------------------------------------------------------------
    def _take_slot(self, tier: int, moves: list[Move]) -> int | None:
        if self._free[tier]:
            return self._free[tier].pop()
        victim = self._pick_victim(tier)
        if victim is None:
            return None
        slot = victim.slot
        if tier == 1 and self.capacity[2] and (dst := self._take_slot(2, moves)) is not None:
            moves.append(Move(1, slot, 2, dst))
            self._set_tier(victim, 2, dst)
            self.stats.blocks_offloaded += 1
        else:
            if victim.children:  # cannot drop a block others extend (tier 2 full of pinned/parents)
                return None
            self._remove(victim, free_slot=False)
            self.stats.blocks_evicted += 1
        return slot

    def _pick_victim(self, tier: int) -> Block | None:
        candidates = self._evictable[tier].values()
        if tier == 1 and not self.capacity[2]:  # no second tier: only childless blocks can go
            candidates = [b for b in candidates if not b.children]
        return min(candidates, key=lambda b: b.last_used, default=None)

    def _remove(self, b: Block, free_slot: bool = True) -> None:
        del self.blocks[b.hash]
        for t in (1, 2):
            self._evictable[t].pop(b.hash, None)
        if free_slot:
            self._free[b.tier].append(b.slot)
        if b.parent is not None and b.parent in self.blocks:
            p = self.blocks[b.parent]
            p.children -= 1
            if b.tier == 1:
                p.tier1_children -= 1
            self._refresh(p)

    def _set_tier(self, b: Block, tier: int, slot: int) -> None:
        if b.parent is not None and b.tier != tier:
            p = self.blocks[b.parent]
            p.tier1_children += 1 if tier == 1 else -1
            self._refresh(p)
        self._evictable[b.tier].pop(b.hash, None)
        b.tier, b.slot = tier, slot
        self._refresh(b)

    def _refresh(self, b: Block) -> None:
        """Keep b's membership of its tier's eviction candidates up to date."""
        candidates = self._evictable[b.tier]
        if b.ready and b.refs == 0 and (b.tier1_children == 0 if b.tier == 1 else b.children == 0):
            candidates[b.hash] = b
        else:
            candidates.pop(b.hash, None)


def _leading(hashes: list[bytes], present: Callable[[bytes], bool]) -> int:
    """How many leading hashes are `present`, for a prefix-closed predicate (if a chain's key is
    present, so is every key before it): a binary search."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if present(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo
