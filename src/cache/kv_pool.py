"""KVPool: preallocated K/V storage for prefix blocks, one slot per block, all layers.

Layout k, v: [slots, layers, kv_heads, block_size, head_dim]: a slot (one block, every layer) is
contiguous, so moving a block between tiers is one contiguous copy each of k and v (between the
GPU and pinned host memory a direct asynchronous DMA; a strided slot would go through a pageable
temporary, synchronously). A request's cached prefix is gathered per layer (index_select over its
slots of `pages(layer)`) straight into the executor's K/V buffers, so only one layer's prefix is
ever materialised outside the pool; the Triton kernel reads `pages(layer)` in place by strides.
On CUDA the second tier is host memory pinned at its exact size (registered with the CUDA runtime;
torch's pinned allocator would round each tensor up to a power of two, pinning up to twice the
budget unseen); where registering fails it falls back to that allocator and `pinned_bytes` counts
the rounded size. h: [slots, block_size, hidden]
(hidden_size > 0): each position's final hidden state (the residual stream after the last layer,
before the final norm), so that a logprob span starting inside cached blocks needs no recompute:
the LM head runs on these rows. span: [slots, block_size, 3] float32 (with h): where a logprob
span computed them, the prediction *for* each token, kept with that token: its logprob given every
token before it, the most likely token's logprob there and that token's id (exact as a float below
2**24), so a span over cached positions skips the LM head; NaN where unknown (a prompt's first
token, positions no span covered). Kept with the predicted token, not the predicting position, so
that every value depends only on tokens inside the block's chain, which its hash fixes: a block's
first token's value is read whenever the block is, and no block position stays unknown.
"""

from __future__ import annotations

import torch

SPAN_VALUES = 3  # per token: its logprob, the best token's logprob there, the best token's id
SPAN_VALUE_BYTES = SPAN_VALUES * 4  # float32 each


class KVPool:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False, hidden_size: int = 0):
        shape = (slots, num_layers, kv_heads, block_size, head_dim)
        self.block_size = block_size
        self.pinned_bytes = 0  # host bytes really pinned for this pool (0: not a pinned tier)
        empty = (lambda shape, dtype: self._pinned_empty(shape, dtype)) if pin_memory else \
            (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))  # noqa: E731
        self.k = empty(shape, dtype)
        self.v = empty(shape, dtype)
        self.h = empty((slots, block_size, hidden_size), dtype) if hidden_size else None
        self.span = empty((slots, block_size, SPAN_VALUES), torch.float32).fill_(float("nan")) if hidden_size else None

    def _pinned_empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Host memory pinned at its exact size (CUDA hosts only: the second tier)."""
        t = torch.empty(shape, dtype=dtype)
        if t.numel() and not _register_pinned(t):
            t = torch.empty(shape, dtype=dtype, pin_memory=True)  # torch's allocator: a power of two
            self.pinned_bytes += 1 << (t.nbytes - 1).bit_length()
            return t
        self.pinned_bytes += t.nbytes
        return t

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's k and v blocks, [slots, kv_heads, block_size, head_dim] views of the pool."""
        return self.k[:, layer], self.v[:, layer]

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                        hidden_size: int = 0) -> int:
        e = torch.tensor([], dtype=dtype).element_size()
        span = SPAN_VALUE_BYTES if hidden_size else 0
        return ((2 * num_layers * kv_heads * head_dim + hidden_size) * e + span) * block_size

    def read(self, layer: int, slots: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """k_dst, v_dst: [kv_heads, n, head_dim] with n <= len(slots) * block_size."""
        n = k_dst.shape[1]
        for pages, dst in zip(self.pages(layer), (k_dst, v_dst)):
            blocks = pages.index_select(0, slots)  # [n_blocks, Hkv, B, hd]
            dst.copy_(blocks.transpose(0, 1).reshape(dst.shape[0], -1, dst.shape[2])[:, :n])

    def write(self, layer: int, slots: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """k_src, v_src: [kv_heads, len(slots) * block_size, head_dim]."""
        n_blocks = slots.shape[0]
        for pages, src in zip(self.pages(layer), (k_src, v_src)):
            h, _, d = src.shape
            pages.index_copy_(0, slots, src.reshape(h, n_blocks, self.block_size, d).transpose(0, 1))

    def read_hidden(self, slots: torch.Tensor, start: int, dst: torch.Tensor) -> None:
        """dst [n, hidden] = the final hidden states of positions [start, start + n) of the prefix
        held in `slots` (block by block: nothing larger than one block is materialised)."""
        b, n, at = self.block_size, dst.shape[0], 0
        while at < n:
            pos = start + at
            slot, offset = int(slots[pos // b]), pos % b
            take = min(b - offset, n - at)
            dst[at : at + take].copy_(self.h[slot, offset : offset + take])
            at += take

    def write_hidden(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """src: [len(slots) * block_size, hidden], the blocks' positions in order. The blocks' span
        values become unknown (a slot's previous block may have left some)."""
        self.h.index_copy_(0, slots, src.reshape(slots.shape[0], self.block_size, -1))
        self.span.index_fill_(0, slots, float("nan"))

    def read_span(self, slots: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """[n, SPAN_VALUES] span values of positions [start, start + n) of the prefix in `slots`."""
        b = self.block_size
        first, last = start // b, (start + n - 1) // b
        rows = self.span.index_select(0, slots[first : last + 1]).reshape(-1, SPAN_VALUES)
        return rows[start - first * b : start - first * b + n]

    def write_span(self, slots: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """values [n, SPAN_VALUES] of tokens [start, start + n) counted from the first slot's first
        position (each token's value: the prediction for it, see the module docstring); the slots'
        other positions become unknown."""
        b = self.block_size
        flat = self.span.new_full((slots.shape[0] * b, SPAN_VALUES), float("nan"))
        flat[start : start + values.shape[0]] = values.to(flat.device)
        self.span.index_copy_(0, slots, flat.view(-1, b, SPAN_VALUES))

    def copy_slot(self, src_slot: int, dst: "KVPool", dst_slot: int) -> None:
        """One block, every layer (and its hidden states), to a slot of `dst` (another tier); async where possible."""
        non_blocking = self.k.device.type != dst.k.device.type
        dst.k[dst_slot].copy_(self.k[src_slot], non_blocking=non_blocking)  # contiguous: one DMA each
        dst.v[dst_slot].copy_(self.v[src_slot], non_blocking=non_blocking)
        if self.h is not None and dst.h is not None:
            dst.h[dst_slot].copy_(self.h[src_slot], non_blocking=non_blocking)
            dst.span[dst_slot].copy_(self.span[src_slot], non_blocking=non_blocking)


def _register_pinned(t: torch.Tensor) -> bool:
    """Pin t's memory where it lies (cudaHostRegister), exactly its bytes; False where that fails.
    Registered for the life of the process, as the pool that owns it."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
        return int(getattr(err, "value", err)) == 0 and t.is_pinned()
    except Exception:  # noqa: BLE001 - any failure means torch's pinned allocator instead
        return False
