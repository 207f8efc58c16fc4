"""Rotary position embedding tables.

Frequencies come from transformers' own rope initialisers (default, linear, llama3, yarn),
so every rope variant a checkpoint declares is interpreted exactly as transformers does.
"""

from __future__ import annotations

import torch

from .model_spec import ModelSpec


class RotaryTable:
    """The table of one layer type: `layer_type` picks its parameters where a config has one set per
    type (Gemma 3: a local base for sliding layers, a global one for full layers)."""

    def __init__(self, spec: ModelSpec, device: torch.device, layer_type: str | None = None):
        cfg = spec.hf_config
        rope = getattr(cfg, "rope_parameters", None) or {}
        if layer_type is not None and isinstance(rope.get(layer_type), dict):
            rope = rope[layer_type]
        else:
            layer_type = None  # one set for every layer
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            dim = spec.head_dim
            # same float32 expression as transformers' default initialiser
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), layer_type=layer_type)
        self.inv_freq = inv_freq.float().to(device)  # [head_dim / 2]
        self.scaling = float(scaling)

    def cos_sin(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions [start, end), each [end - start, head_dim / 2] in `dtype`."""
        pos = torch.arange(start, end, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)
