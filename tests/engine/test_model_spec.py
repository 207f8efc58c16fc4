"""ModelSpec.flops: the model FLOPs of a prefill, with and without a cached prefix. Fast; configs only, no weights."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config

from prefillonly.model.spec import ModelSpec

SHAPES = {
    # Llama-3.1-8B (perf/gpu_check.py's performance model)
    "llama31_8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, architectures=["LlamaForCausalLM"]),
    # SmolLM2-135M (the default model, perf/bench_core.py)
    "smollm2_135m": LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
    # heads x head_dim (512) differs from the hidden size (256): the attention term uses the former
    "qwen3_hd128": Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=128, vocab_size=1000, architectures=["Qwen3ForCausalLM"]),
}


def bench_core_formula(spec: ModelSpec, s: int) -> int:
    """perf/bench_core.py's former model_flops (no prefix): 2·N·S + 2·L·d·S² + 2·hidden·vocab."""
    d = spec.num_heads * spec.head_dim
    return 2 * spec.non_embedding_params() * s + 2 * spec.num_layers * d * s * s + 2 * spec.hidden_size * spec.vocab_size


def gpu_check_formula(spec: ModelSpec, s: int, p: int = 0) -> float:
    """perf/gpu_check.py's former model_flops: 2·N·S + 2·L·d·S·(2P + S) + 2·hidden·vocab, as a float."""
    d = spec.num_heads * spec.head_dim
    return float(2 * spec.non_embedding_params() * s + 2 * spec.num_layers * d * s * (2 * p + s) + 2 * spec.hidden_size * spec.vocab_size)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("s", [1, 150, 2048, 8192, 100_000])
def test_flops_without_prefix_equals_both_former_formulas(shape, s):
    spec = ModelSpec.from_hf_config(SHAPES[shape])
    assert spec.flops(s) == bench_core_formula(spec, s)
    assert isinstance(spec.flops(s), int)
    assert float(spec.flops(s)) == gpu_check_formula(spec, s)
    assert spec.flops(s, prefix_tokens=0) == spec.flops(s)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("s, p", [(150, 14_000), (2048, 16_384), (1, 1), (64, 256)])
def test_flops_with_prefix_equals_gpu_checks_former_formula(shape, s, p):
    spec = ModelSpec.from_hf_config(SHAPES[shape])
    assert float(spec.flops(s, p)) == gpu_check_formula(spec, s, p)
    # each cached token costs the S new queries their QK^T and PV products: 4·L·d·S per cached token
    assert spec.flops(s, p) - spec.flops(s) == 4 * spec.num_layers * spec.q_width * s * p


def gemma3(window: int) -> ModelSpec:
    config = Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, vocab_size=1000, sliding_window=window,
                              architectures=["Gemma3ForCausalLM"])
    return ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("s, p", [(1, 0), (150, 0), (150, 14_000), (2048, 16_384), (7, 3), (1000, 100)])
@pytest.mark.parametrize("window", [1, 7, 512])
def test_flops_of_windowed_layers_count_only_the_keys_in_the_window(s, p, window):
    spec = gemma3(window)
    assert spec.layer_types.count("sliding_attention") == 5 and spec.layer_types[5] == "full_attention"
    full_layer = s * (2 * p + s)
    windowed_layer = sum(min(2 * t + 1, 2 * window) for t in range(p, p + s))  # written out
    want_attention = 2 * spec.q_width * (full_layer + 5 * windowed_layer)
    assert spec.flops(s, p) == 2 * spec.non_embedding_params() * s + want_attention + 2 * spec.hidden_size * spec.vocab_size
    # a window longer than every position is full attention
    assert gemma3(p + s + 1).flops(s, p) == float(gpu_check_formula(gemma3(p + s + 1), s, p))


# What the loader refuses, each with a message naming it and what is supported.
REFUSED = [
    (Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3ForConditionalGeneration"]), "unsupported model architecture"),
    (Gemma2Config(num_hidden_layers=2, hidden_activation="relu", architectures=["Gemma2ForCausalLM"]), "unsupported MLP activation 'relu'"),
    (LlamaConfig(hidden_act="gelu", architectures=["LlamaForCausalLM"]), "unsupported MLP activation 'gelu'"),
    (LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, architectures=["LlamaForCausalLM"]),
     "unsupported rope_type 'dynamic'"),
    (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True, architectures=["Gemma3ForCausalLM"]),
     "use_bidirectional_attention"),
    (Gemma3TextConfig(num_hidden_layers=2, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
        architectures=["Gemma3ForCausalLM"]), "unsupported rope_type 'dynamic'"),
    (LlamaConfig(max_position_embeddings=131072, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 4096, "short_factor": [1.0] * 64,
        "long_factor": [2.0] * 64}, architectures=["LlamaForCausalLM"]), "unsupported rope_type 'longrope' for LlamaForCausalLM"),
    (Phi3Config(num_hidden_layers=2, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 0.03125},
                architectures=["Phi3ForCausalLM"]), "unsupported partial_rotary_factor 0.03125: 3 of 96"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=["multimodal_gemma3", "gemma2_relu", "llama_gelu", "llama_dynamic_rope",
                                                           "gemma3_bidirectional", "gemma3_global_dynamic_rope",
                                                           "llama_longrope", "phi3_odd_rotary_dims"])
def test_unsupported_configs_are_refused_by_name(config, message):
    from prefillonly.contract.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message) as refused:
        ModelSpec.from_hf_config(config)
    assert "supported" in str(refused.value)
