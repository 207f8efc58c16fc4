"""PrefixKV: the K/V of a prompt prefix for every layer, as the executor consumes and produces it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixKV:
    keys: list[torch.Tensor]  # per layer [kv_heads, length, head_dim], RoPE already applied
    values: list[torch.Tensor]  # per layer [kv_heads, length, head_dim]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
