"""How K/V of a prompt prefix flows into and out of the executor (the executor owns these).

The executor asks a *source* to fill the first P positions of each layer's K/V buffers
(cached prefix) and offers each layer's freshly computed K/V, and after the last layer the new
positions' final hidden states and a logprob span's values, to a *sink* (blocks to keep); a
logprob span over prefix positions reads their hidden states, and where kept their span values
(the prediction for each token, kept with that token: its logprob, the best token's logprob and
id: [n, 3] float32, NaN where unknown), from the source.
PrefixKV is the plain in-memory form (a list of per-layer tensors), used for multi-item
scoring's shared prompt and in tests; the prefix cache (cache/prefix_cache.py) implements
pool-backed ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class PrefixSource(Protocol):
    length: int

    def load(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """Write this layer's prefix K/V into k_dst, v_dst ([kv_heads, length, head_dim])."""

    def paged(self) -> tuple[object, torch.Tensor] | None:
        """(pool, slots) when the K/V sits in a KVPool's blocks that attention may read in place
        (the Triton kernel does, instead of load); None if it must be loaded."""

    def hidden(self, start: int, dst: torch.Tensor) -> None:
        """dst [n, hidden] = the final hidden states of prefix positions [start, start + n) (a
        logprob span over cached positions); a source without them raises."""

    def span_values(self, start: int, n: int) -> torch.Tensor | None:
        """[n, 3] float32 span values of prefix tokens [start, start + n) (each the prediction for
        that token, made at the position before it), NaN where unknown; None if this source keeps none."""


class KVSink(Protocol):
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, first_position: int = 0) -> None:
        """Take what it keeps of this layer's K/V buffers ([kv_heads, rows, head_dim]) of positions
        [first_position, + rows): the whole P + S, or from P on where the prefix was read in place."""

    def store_hidden(self, rows: torch.Tensor, first_position: int) -> None:
        """Take what it keeps of the final hidden states of positions [first_position, + len(rows))."""

    def store_span(self, values: torch.Tensor, first_token: int) -> None:
        """Take what it keeps of a logprob span's values ([n, 3]) for tokens [first_token, + n)."""


class _CapturedOnly:
    """A captured prefix's answers beyond its K/V: none (no pool blocks, no hidden states, no span values)."""

    def paged(self) -> None:
        return None

    def hidden(self, start: int, dst: torch.Tensor) -> None:
        raise ValueError("a captured prefix keeps K/V only: a logprob span must start after it")

    def span_values(self, start: int, n: int) -> None:
        return None


@dataclass
class PrefixKV(_CapturedOnly):
    keys: list[torch.Tensor]  # per layer [kv_heads, length, head_dim], RoPE already applied
    values: list[torch.Tensor]  # per layer [kv_heads, length, head_dim]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def load(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        k_dst.copy_(self.keys[layer][:, : k_dst.shape[1]])
        v_dst.copy_(self.values[layer][:, : v_dst.shape[1]])


@dataclass
class ChainedPrefix(_CapturedOnly):
    """One captured prefix after another (a shared prompt's K/V, then an item's own): the prefix a
    continuation of that item reads, without copying the two into one."""

    first: PrefixKV
    second: PrefixKV

    @property
    def length(self) -> int:
        return self.first.length + self.second.length

    def load(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        n = min(self.first.length, k_dst.shape[1])
        self.first.load(layer, k_dst[:, :n], v_dst[:, :n])
        if k_dst.shape[1] > n:
            self.second.load(layer, k_dst[:, n:], v_dst[:, n:])


def shared_and_own(prefix: PrefixSource | None) -> tuple[PrefixKV, PrefixKV | None] | None:
    """A captured prefix as (the part other sequences of a step may follow too, the sequence's own
    part after it or None): what attention can read once for them all (kernels/shared_prefix.py);
    None for no prefix or a cache-backed one."""
    if isinstance(prefix, PrefixKV):
        return prefix, None
    if isinstance(prefix, ChainedPrefix):
        return prefix.first, prefix.second
    return None


@dataclass
class CaptureSink:
    """Copies positions [start, end) of every layer into a PrefixKV."""

    start: int
    end: int
    captured: PrefixKV = field(default_factory=lambda: PrefixKV([], []))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, first_position: int = 0) -> None:
        a, b = self.start - first_position, self.end - first_position
        self.captured.keys.append(k[:, a:b].clone())
        self.captured.values.append(v[:, a:b].clone())

    def store_hidden(self, rows: torch.Tensor, first_position: int) -> None:
        pass  # a capture is K/V for items that follow it

    def store_span(self, values: torch.Tensor, first_token: int) -> None:
        pass


class Sinks:
    """Several sinks behind one (e.g. the prefix cache's and a multi-item capture)."""

    def __init__(self, *sinks: KVSink | None):
        self.sinks = [s for s in sinks if s is not None]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, first_position: int = 0) -> None:
        for s in self.sinks:
            s.store(layer, k, v, first_position)

    def store_hidden(self, rows: torch.Tensor, first_position: int) -> None:
        for s in self.sinks:
            s.store_hidden(rows, first_position)

    def store_span(self, values: torch.Tensor, first_token: int) -> None:
        for s in self.sinks:
            s.store_span(values, first_token)
