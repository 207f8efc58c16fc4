"""ModelSpec: the shape of a supported decoder-only checkpoint, read from its HF config.

Only what the forward pass needs. transformers parses config.json (we never re-implement
config parsing); this module validates that the architecture is one we implement and turns
it into plain numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import ConfigError, UnsupportedModelError

# architecture name -> family. All four share the Llama weight layout; the flags below
# (biases, q/k norm) are what differs.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# rope types whose frequencies do not depend on the sequence length
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    num_layers: int
    hidden_size: int  # d
    intermediate_size: int  # F (MLP width)
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # None = full attention at every length
    hf_config: object  # the transformers config, kept for rope init and the reference model

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width

    @property
    def context_length(self) -> int:
        """Longest prompt the model computes exactly (full attention, trained positions)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def non_embedding_params(self) -> int:
        """N of the model-FLOP count (docs/design.md §7): the per-token linear layers, no embedding/lm_head."""
        d, f = self.hidden_size, self.intermediate_size
        per_layer = d * self.qkv_width + self.q_width * d + 3 * d * f
        return self.num_layers * per_layer

    def flops(self, new_tokens: int, prefix_tokens: int = 0) -> int:
        """Model FLOPs of one prefill: `new_tokens` (S) computed after `prefix_tokens` (P) cached.

        2·N·S for the linear layers (N = non_embedding_params()), 2·L·d·S·(2P + S) for causal
        attention (d = heads x head_dim: QK^T and PV over the P cached keys and the causal half
        of the S new ones, 4·d·S·P + 2·d·S² per layer), and 2·hidden·vocab for the lm_head on the
        last position only (a prefill-only request scores one next token)."""
        s, p = new_tokens, prefix_tokens
        linear = 2 * self.non_embedding_params() * s
        attention = 2 * self.num_layers * self.q_width * s * (2 * p + s)
        lm_head = 2 * self.hidden_size * self.vocab_size
        return linear + attention + lm_head

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        archs = list(getattr(config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported model architecture {archs or getattr(config, 'model_type', '?')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported MLP activation {config.hidden_act!r}; only SwiGLU (silu)")
        window = getattr(config, "sliding_window", None)
        if family in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
            window = None
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=arch,
            family=family,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            hf_config=config,
        )

    @classmethod
    def from_folder(cls, folder: str) -> "ModelSpec":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model folder {folder!r} has no config.json")
        with open(path) as f:
            archs = json.load(f).get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            # fail before transformers tries to import an arbitrary model class
            raise UnsupportedModelError(
                f"unsupported model architecture {archs!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(folder))
