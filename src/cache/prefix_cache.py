"""PrefixCache: keep the K/V of prompt prefixes worth keeping, never the rest (docs/design.md §3).

Per request (the engine's path: the scheduler holds the ticket, the runner the rest):
    ticket, moves = cache.index.begin(hashes, len(ids), kept_blocks)   # match + pin, reserve new ones
    cache.execute(moves)                                               # tier restores/offloads, in order
    access = cache.access(ticket)                                      # the executor's view of the ticket
    executor.forward(ids[access.cached_tokens:], prefix=access.source, sink=access.sink)
    cache.index.commit(ticket)  (or cache.index.abort(ticket) if the forward failed)

A block keeps its positions' K/V of every layer, their final hidden states (a logprob span
over cached positions runs the LM head on those) and, where a span computed them, each token's
logprob and the best token at its position (a later span with top k <= 1 reads these instead).
Only whole blocks inside the keep boundary (`kept_blocks`: by default the whole prompt's, or those
inside the request's `cache_prefix_len`) are written to the pool; every other token's K/V lives
only in the executor's per-layer buffers (suffix discard). Blocks that find no room are dropped
(overflow is never an error). At least one token is always computed, so a fully cached prompt
still yields logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .prefix_io import KVSink, PrefixSource
from ..contract.block_keys import block_hashes, namespace_root
from .index import Block, CacheStats, IndexTicket, Move, PrefixIndex
from .kv_pool import KVPool


@dataclass(frozen=True)
class PrefixAccess:
    """The executor's view of one cache ticket (PrefixCache.access): what it reads and where it
    writes. Not a ticket: it holds no pins, and nothing commits or aborts it (the scheduler does
    that to the ticket it came from)."""

    cached_tokens: int  # leading prompt tokens read from the cache (the ticket's)
    source: PrefixSource | None = None  # reads the matched blocks from the pool (None: nothing cached)
    sink: KVSink | None = None  # writes the new blocks into their reserved slots (None: none to keep)


NO_PREFIX = PrefixAccess(0)  # a request without a ticket (no cache): nothing read, nothing kept


class _PoolSource:
    """A PrefixSource over pool slots (read in place by the Triton kernel, loaded elsewhere)."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, length: int):
        self.pool, self.slots, self.length = pool, slots, length

    def load(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        self.pool.read(layer, self.slots, k_dst, v_dst)

    def paged(self) -> tuple[KVPool, torch.Tensor]:
        return self.pool, self.slots

    def hidden(self, start: int, dst: torch.Tensor) -> None:
        self.pool.read_hidden(self.slots, start, dst)

    def span_values(self, start: int, n: int) -> torch.Tensor:
        return self.pool.read_span(self.slots, start, n)


class _PoolSink:
    """A KVSink that writes positions [start, start + n_blocks * B) of each layer into the reserved slots."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, start: int):
        self.pool, self.slots, self.start = pool, slots, start
        self.end = start + slots.shape[0] * pool.block_size

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, first_position: int = 0) -> None:
        a, b = self.start - first_position, self.end - first_position
        self.pool.write(layer, self.slots, k[:, a:b], v[:, a:b])

    def store_hidden(self, rows: torch.Tensor, first_position: int) -> None:
        """rows: the final hidden states of positions [first_position, first_position + len(rows))."""
        self.pool.write_hidden(self.slots, rows[self.start - first_position : self.end - first_position])

    def store_span(self, values: torch.Tensor, first_token: int) -> None:
        """values [n, SPAN_VALUES]: a logprob span's values for tokens [first_token, + n)."""
        a, b = max(first_token, self.start), min(first_token + values.shape[0], self.end)
        if a < b:
            self.pool.write_span(self.slots, a - self.start, values[a - first_token : b - first_token])


class PrefixCache:
    def __init__(self, spec, dtype: torch.dtype, device: torch.device, block_size: int, budget_bytes: int,
                 second_tier_bytes: int = 0, model_id: str = ""):
        self.block_size = block_size
        self.model_id = model_id
        self.block_bytes = self.bytes_per_block(spec, dtype, block_size)
        tier1 = budget_bytes // self.block_bytes
        tier2 = second_tier_bytes // self.block_bytes
        dims = (spec.num_layers, spec.num_kv_heads, block_size, spec.head_dim)
        make = lambda slots, dev, pin: KVPool(dims[0], slots, dims[1], dims[2], dims[3], dtype, dev, pin,  # noqa: E731
                                              spec.hidden_size)
        self.pools = {1: make(tier1, device, False)}
        if tier2:
            # on CUDA the second tier is pinned host memory (async copies); on CPU another pool
            self.pools[2] = make(tier2, torch.device("cpu"), device.type == "cuda")
        self.index = PrefixIndex(tier1, tier2, block_size)
        self.device = device

    @staticmethod
    def bytes_per_block(spec, dtype: torch.dtype, block_size: int) -> int:
        """One block's bytes: its positions' K/V of every layer, their final hidden states and span
        values (what a logprob span over cached positions reads). Budgets are counted in these."""
        return KVPool.bytes_per_block(spec.num_layers, spec.num_kv_heads, block_size, spec.head_dim, dtype, spec.hidden_size)

    @property
    def stats(self) -> CacheStats:
        return self.index.stats

    def bytes_in_use(self) -> dict[int, int]:
        return {t: self.index.used_slots(t) * self.block_bytes for t in self.pools}

    def capacity_bytes(self) -> dict[int, int]:
        return {t: self.index.capacity[t] * self.block_bytes for t in self.pools}

    def hashes(self, ids, namespace: str | None) -> list[bytes]:
        """The prompt's block keys (hashed once per request; the scheduler reuses them)."""
        return block_hashes(ids, self.block_size, namespace_root(self.model_id, namespace))

    def execute(self, moves: list[Move]) -> None:
        """Copy blocks between tiers as the index's moves say, in order (restores and offloads
        come before any new block is written)."""
        for m in moves:
            self.pools[m.src_tier].copy_slot(m.src_slot, self.pools[m.dst_tier], m.dst_slot)
        if moves and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def access(self, t: IndexTicket) -> PrefixAccess:
        """The executor's view of the index's ticket `t` (its moves executed): a source reading
        the matched blocks from the pool and a sink writing the new ones into their slots."""
        source = _PoolSource(self.pools[1], self._slots(t.matched), t.cached_tokens) if t.cached_tokens else None
        sink = _PoolSink(self.pools[1], self._slots(t.new), len(t.matched) * self.block_size) if t.new else None
        return PrefixAccess(t.cached_tokens, source, sink)

    # -- internals -----------------------------------------------------------------------
    def _slots(self, blocks: list[Block]) -> torch.Tensor:
        return torch.tensor([blk.slot for blk in blocks], dtype=torch.long, device=self.device)
