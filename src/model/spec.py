"""ModelSpec: the shape of a supported decoder-only checkpoint, read from its HF config.

Only what the forward pass needs. transformers parses config.json (we never re-implement
config parsing); this module validates that the architecture is one we implement and turns
it into plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.checkpoint import CLASSIFIER_HEAD, GEMMA, SUPPORTED_ARCHITECTURES, head_of, label_names, read_config
from ..contract.errors import ConfigError, UnsupportedModelError

LAYER_TYPES = ("full_attention", "sliding_attention")
# MLP activations by config name -> ours: SwiGLU's silu, Gemma's tanh-approximated GELU
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# rope types whose frequencies do not depend on the sequence length, and LongRoPE (Phi-3.5, Phi-4-mini),
# whose short or long factors are chosen by a sequence's whole length (ModelSpec.rope_switch_length)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
    # Gemma 2/3 (defaults: the Llama-like families)
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; () = every layer full attention
    rope_per_layer_type: bool = False  # RoPE parameters per layer type (Gemma 3), else one set for all
    rotary_dim: int | None = None  # leading dims of each head RoPE rotates (Phi-4-mini: 3/4); None = all
    rope_switch_length: int | None = None  # LongRoPE: a sequence longer than this uses the long factors
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    embed_scale: float | None = None  # embeddings are multiplied by it (Gemma: sqrt(hidden_size), in the model dtype)
    norm_plus_one: bool = False  # RMSNorm weights are stored as w and used as (1 + w) (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma): see the executor
    activation: str = "silu"  # gated MLP activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    attention_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) before the log-softmax (Gemma 2)
    # what the checkpoint ends in (contract.checkpoint): "lm" (scores tokens), "embedding" (a bare
    # model: pooled hidden states) or "classifier" (a `score` head over the last token's hidden state)
    head: str = "lm"
    labels: tuple[str, ...] = ()  # a classifier's label names, by id (id2label)
    # a classifier's scores -> probabilities: softmax (single-label), sigmoid (multi-label) or none
    # (regression, and a one-label head without a problem type: a reward model's raw score)
    label_activation: str = "softmax"

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer`'s attention, 0 for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return 0

    def rope_long(self, sequence_length: int) -> bool:
        """Whether a sequence of this many tokens (prefix included) rotates with LongRoPE's long
        factors: past the original context length, as transformers switches for the whole forward."""
        return self.rope_switch_length is not None and sequence_length > self.rope_switch_length

    def rope_table(self, layer: int) -> str | None:
        """Which RoPE table `layer` uses: its layer type where the parameters differ by type, else None."""
        return self.layer_types[layer] if self.rope_per_layer_type else None

    @property
    def rope_tables(self) -> int:
        return len({self.rope_table(i) for i in range(self.num_layers)})

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

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
        """Longest prompt the model computes exactly (full attention, trained positions): a
        window of every layer (Mistral, Qwen2's) bounds it; per-layer windows (Gemma) do not."""
        if self.sliding_window is not None and not self.layer_types:
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
        last position only (a prefill-only request scores one next token). Written per query at
        position t, a layer's attention is 2·d·(2t + 1): a sliding-window layer counts
        2·d·min(2t + 1, 2W) (its queries see at most W keys)."""
        s, p = new_tokens, prefix_tokens
        linear = 2 * self.non_embedding_params() * s
        full = s * (2 * p + s)  # sum of 2t + 1 over t in [P, P + S)
        attention = 2 * self.q_width * sum(_windowed_pairs(p, s, self.layer_window(i)) if self.layer_window(i) else full
                                           for i in range(self.num_layers))
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
        gemma = family in GEMMA
        rope = getattr(config, "rope_parameters", None) or {}
        rope_per_type = bool(gemma and rope and set(rope) <= set(LAYER_TYPES))
        _check_rope_types(rope, rope_per_type, family, arch)
        activation = _activation(config, gemma, arch)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window, layer_types, rotary_dim, switch = _attention_layout(config, family, rope, head_dim)
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
            qk_norm=family in ("qwen3", "gemma3"),
            sliding_window=int(window) if window else None,
            hf_config=config,
            layer_types=layer_types,
            rope_per_layer_type=rope_per_type,
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            rope_switch_length=switch,
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
            embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            activation=activation,
            attention_softcap=_cap(getattr(config, "attn_logit_softcapping", None)) if gemma else None,
            final_softcap=_cap(getattr(config, "final_logit_softcapping", None)) if gemma else None,
            head=head_of(arch),
            **(_classifier_head(config) if head_of(arch) == CLASSIFIER_HEAD else {}),
        )

    @classmethod
    def from_folder(cls, folder: str) -> "ModelSpec":
        read_config(folder)  # fail before transformers tries to import an arbitrary model class
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(folder))


def _check_rope_types(rope: dict, per_type: bool, family: str, arch: str) -> None:
    for params in (rope.values() if per_type else [rope]):
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES or (rope_type == "longrope" and family != "phi3"):
            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r} for {arch}; supported: {', '.join(SUPPORTED_ROPE_TYPES)} "
                f"(longrope on Phi-3 only)"
            )


def _activation(config, gemma: bool, arch: str) -> str:
    """The gated MLP's activation: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU), else refused."""
    act_name = getattr(config, "hidden_activation", None) if gemma else getattr(config, "hidden_act", "silu")
    activation = ACTIVATIONS.get(act_name)
    if activation is None or (gemma != (activation == "gelu_tanh")):
        raise UnsupportedModelError(f"unsupported MLP activation {act_name!r} for {arch}; "
                                    f"supported: silu (Llama, Mistral, Qwen), gelu_pytorch_tanh (Gemma)")
    return activation


def _attention_layout(config, family: str, rope: dict, head_dim: int) -> tuple:
    """(sliding window or None, per-layer types, rotary dims or None, LongRoPE's switch length or
    None) as the family reads them from its config; what the kernels cannot honour is refused."""
    gemma = family in GEMMA
    window = getattr(config, "sliding_window", None)
    if family in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    layer_types = tuple(getattr(config, "layer_types", None) or ()) if gemma else ()
    rotary_dim = switch = None
    if family == "phi3":
        partial = float(rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise UnsupportedModelError(f"unsupported partial_rotary_factor {partial}: {rotary_dim} of {head_dim} "
                                        f"head dims; supported: an even count of them")
        if rope.get("rope_type") == "longrope":
            switch = int(rope["original_max_position_embeddings"])
        if window:  # every layer windowed (Phi-3-mini's 2,047): the kernels honour it at any length
            layer_types = ("sliding_attention",) * config.num_hidden_layers
    if gemma:
        if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"unsupported layer_types {list(layer_types)!r}; each layer one of {', '.join(LAYER_TYPES)}")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("use_bidirectional_attention is not supported (prefill-only scoring is causal)")
        if "sliding_attention" in layer_types and not window:
            raise UnsupportedModelError("sliding_attention layers without a sliding_window")
    return window, layer_types, rotary_dim, switch


def _classifier_head(config) -> dict:
    """A sequence classifier's labels (id2label in id order) and how its scores become probabilities,
    as transformers' loss reads problem_type (None: regression for one label, else single-label)."""
    n = int(config.num_labels)
    labels = label_names(getattr(config, "id2label", None), n)
    problem = getattr(config, "problem_type", None) or ("regression" if n == 1 else "single_label_classification")
    activation = {"regression": "none", "single_label_classification": "softmax", "multi_label_classification": "sigmoid"}.get(problem)
    if activation is None:
        raise UnsupportedModelError(f"unsupported problem_type {problem!r}; supported: regression, single_label_classification, "
                                    "multi_label_classification")
    return {"labels": labels, "label_activation": activation}


def _cap(value) -> float | None:
    return float(value) if value else None


def _windowed_pairs(p: int, s: int, window: int) -> int:
    """sum of min(2t + 1, 2·window) over t in [p, p + s): 2t + 1 while t < window, then 2·window."""
    m = min(max(window, p), p + s)
    return (m * m - p * p) + 2 * window * (p + s - m)
