"""KVPool: preallocated K/V storage for prefix blocks, one slot per block, all layers.

Layout k, v: [layers, slots, kv_heads, block_size, head_dim]. A request's cached prefix is
gathered per layer (index_select over its slots) straight into the executor's K/V buffers,
so only one layer's prefix is ever materialised outside the pool.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False):
        shape = (num_layers, slots, kv_heads, block_size, head_dim)
        self.block_size = block_size
        self.k = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * block_size * head_dim * torch.tensor([], dtype=dtype).element_size()

    def read(self, layer: int, slots: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        """k_dst, v_dst: [kv_heads, n, head_dim] with n <= len(slots) * block_size."""
        n = k_dst.shape[1]
        for pool, dst in ((self.k, k_dst), (self.v, v_dst)):
            blocks = pool[layer].index_select(0, slots)  # [n_blocks, Hkv, B, hd]
            dst.copy_(blocks.transpose(0, 1).reshape(dst.shape[0], -1, dst.shape[2])[:, :n])

    def write(self, layer: int, slots: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """k_src, v_src: [kv_heads, len(slots) * block_size, head_dim]."""
        n_blocks = slots.shape[0]
        for pool, src in ((self.k, k_src), (self.v, v_src)):
            h, _, d = src.shape
            pool[layer].index_copy_(0, slots, src.reshape(h, n_blocks, self.block_size, d).transpose(0, 1))

    def copy_slot(self, src_slot: int, dst: "KVPool", dst_slot: int) -> None:
        """One block, every layer, to a slot of `dst` (another tier); async where possible."""
        non_blocking = self.k.device.type != dst.k.device.type
        dst.k[:, dst_slot].copy_(self.k[:, src_slot], non_blocking=non_blocking)
        dst.v[:, dst_slot].copy_(self.v[:, src_slot], non_blocking=non_blocking)
