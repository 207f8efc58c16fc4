"""Rotary position embedding tables.

Frequencies come from transformers' own rope initialisers (default, linear, llama3, yarn),
so every rope variant a checkpoint declares is interpreted exactly as transformers does.
"""

from __future__ import annotations

import torch

from .spec import ModelSpec


class RotaryTable:
    """The table of one layer type: `layer_type` picks its parameters where a config has one set per
    type (Gemma 3: a local base for sliding layers, a global one for full layers). LongRoPE keeps two
    sets of frequencies, the short and the long factors: cos_sin(..., long=True) takes the long one
    (a sequence past the original context length, ModelSpec.rope_long). A partial rotary factor
    (Phi-4-mini) makes the tables cover only the rotated leading dims of a head."""

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
            dim = spec.rotary_dim or spec.head_dim
            # same float32 expression as transformers' default initialiser
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling, long_inv_freq = 1.0, None
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, scaling = init(cfg, torch.device("cpu"), layer_type=layer_type)
            long_inv_freq = None
            if spec.rope_switch_length is not None:  # as transformers: the long factors for any length past the switch
                long_inv_freq, _ = init(cfg, torch.device("cpu"), seq_len=spec.rope_switch_length + 1, layer_type=layer_type)
                long_inv_freq = long_inv_freq.float().to(device)
        self.inv_freq = inv_freq.float().to(device)  # [rotated dims / 2]
        self.long_inv_freq = long_inv_freq
        self.scaling = float(scaling)

    def cos_sin(self, start: int, end: int, dtype: torch.dtype, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions [start, end), each [end - start, rotated dims / 2] in `dtype`."""
        inv_freq = self.long_inv_freq if long and self.long_inv_freq is not None else self.inv_freq
        pos = torch.arange(start, end, device=inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)
