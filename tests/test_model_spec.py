"""ModelSpec.flops: the model FLOPs of a prefill, with and without a cached prefix. Fast; configs only, no weights."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config

from prefillonly.model_spec import ModelSpec

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
