"""Shared fixtures: small random checkpoints of every supported family, the default model; and
the suite's tiers: every test file lives in its layer's folder (and gets a marker of that name)
and the quick files are also `fast`, so `bash scripts/test.sh -m fast` runs the one-to-two-minute tier alone
and `-m serving` (or engine, kernels, cache_scheduler, frontend, fleet, house) one layer."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# the layers: each test file lives in the folder of its layer (a file elsewhere fails the collection)
LAYERS = ("engine", "kernels", "cache_scheduler", "serving", "frontend", "fleet", "house")
# no server, no long forward (a test of theirs that takes more than a few seconds is marked heavy
# and left to the full suite): under a minute together on 2 cores
FAST = {"test_request", "test_scheduler", "test_dependency_groups", "test_simulator", "test_config", "test_limits",
        "test_protocol", "test_inflight", "test_import_graph", "test_docs_match_tree", "test_envoy_hashing", "test_workloads",
        "test_host_table", "test_model_spec", "test_perf_cli", "test_frontend_presets", "test_batching", "test_prefix_cache",
        "test_linear", "test_dtype_auto", "test_wire", "test_kernel_backend", "test_code_shape", "test_pooling_files", "test_bench_pooling", "test_tenant_keys", "test_bench_tenants"}
# The files that take longest (about 40 s to 2 minutes each on 2 cores, slowest first): started
# first, so that parallel workers (scripts/test.sh) end on short files instead of one worker
# finishing a long file alone. Then the other server and model files, then the fast tier.
SLOWEST_FIRST = ("test_memory", "test_gpu_kernels", "test_fleet", "test_faults", "test_triton_server", "test_eval_harness",
                 "test_triton_lifecycle", "test_frontend", "test_pooling_routes", "test_decisions", "test_score_precision",
                 "test_picker_fleet", "test_batching", "test_perf_inputs")


def pytest_configure(config):
    for layer in LAYERS:
        config.addinivalue_line("markers", f"{layer}: tests of the {layer} layer (the files in tests/{layer}/)")
    config.addinivalue_line("markers", "fast: the quick tier (tests/conftest.py FAST): bash scripts/test.sh -m fast")
    config.addinivalue_line("markers", "heavy: a test of a FAST file that takes more than a few seconds: the full suite "
                                       "runs it, the fast tier leaves it out")


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = item.path.parent.name
        if layer not in LAYERS:
            raise pytest.UsageError(f"{item.path.name} is in no layer: move it into one of tests/{{{','.join(LAYERS)}}}/")
        item.add_marker(layer)
        if item.path.stem in FAST and item.get_closest_marker("heavy") is None:
            item.add_marker("fast")
    # the slowest files first, the quick ones last (a file's tests stay together, in their order)
    items.sort(key=_start_order)


def _start_order(item) -> tuple[int, bool]:
    stem = item.path.stem
    return (SLOWEST_FIRST.index(stem) if stem in SLOWEST_FIRST else len(SLOWEST_FIRST), stem in FAST)

# name -> (config class name, config kwargs). Small but with every feature switched on:
# GQA, llama3 rope scaling, linear rope scaling, q/k/v bias, q/k norm with head_dim != d/heads,
# tied and untied heads.
_SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=300, max_position_embeddings=1024, rms_norm_eps=1e-5)
FAMILY_CONFIGS = {
    "llama_gqa_llama3rope_untied": ("LlamaConfig", dict(_SMALL, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "llama_mha_tied": ("LlamaConfig", dict(_SMALL, num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral_gqa_linear_rope": ("MistralConfig", dict(_SMALL, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2_bias_tied": ("Qwen2Config", dict(_SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qknorm_untied": ("Qwen3Config", dict(_SMALL, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)),
    # Gemma 3: local (8-key window, base 1e4) and global (linear-scaled base 1e6) layers, q/k norm,
    # (1 + w) norms, the four norms a layer, scaled embeddings, query_pre_attn_scalar, GeGLU, tied
    "gemma3_window_two_ropes": ("Gemma3TextConfig", dict(_SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8, query_pre_attn_scalar=20,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})),
    # Gemma 2: alternating windowed / full layers, attention and final soft-capping (caps small
    # enough that these weights' scores and logits reach them)
    "gemma2_softcap_window": ("Gemma2Config", dict(_SMALL, num_key_value_heads=1, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # Phi-3: fused qkv_proj and gate_up_proj, every layer windowed (Phi-3-mini's 2,047 keys: here 8)
    "phi3_fused_window": ("Phi3Config", dict(_SMALL, num_key_value_heads=2, sliding_window=8, pad_token_id=0,
                                             tie_word_embeddings=False)),
    # Phi-4-mini-like: LongRoPE (short factors up to 64 tokens, long past them: the 130-token prompts
    # switch) and a partial rotary factor (12 of each head's 16 dims rotate), tied
    "phi3_longrope_partial": ("Phi3Config", dict(_SMALL, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=True,
        original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.2, 3.4, 5.1, 7.7, 11.6]})),
}


def make_hf_model(name: str, seed: int = 0):
    """A transformers model of FAMILY_CONFIGS[name] with every parameter randomised (norms too)."""
    return make_random_model(*FAMILY_CONFIGS[name], seed=seed)


def make_random_model(cls_name: str, kwargs: dict, seed: int = 0, auto: str = "AutoModelForCausalLM", **from_config):
    """A transformers model of config class `cls_name`(**kwargs), every parameter randomised; `auto`:
    the Auto class that builds it (AutoModel: the bare model; AutoModelForSequenceClassification)."""
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config, dtype=torch.float32, **from_config)
    model.config.architectures = [type(model).__name__]  # e.g. Gemma3TextConfig -> Gemma3ForCausalLM
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory):
    """name -> folder of a saved random checkpoint (config.json + model.safetensors)."""
    out = {}
    for name in FAMILY_CONFIGS:
        folder = tmp_path_factory.mktemp(name)
        make_hf_model(name).save_pretrained(folder)
        out[name] = str(folder)
    return out


@pytest.fixture(scope="session")
def default_model_path():
    from prefillonly.config import default_cache_dir
    from prefillonly.model.default_model import ensure_default_model

    return ensure_default_model(default_cache_dir())


@pytest.fixture(scope="session")
def default_engine():
    """The default model in float32 on a fixed GEMM library: linear_backend "auto" times aten against
    oneDNN at start, and where they run close (an Intel Xeon with AMX) a loaded host picks either.
    MKL's float32 GEMM (aten) rounds by the rows of the call, so a warm span (fewer rows computed)
    then differs from its cold run by 1.3e-5 where oneDNN's packed GEMM agrees to 1e-5 (measured,
    2026-12-06): the tests must not lean on which one a timing chose."""
    from prefillonly import Engine, EngineConfig
    from prefillonly.kernels.linear import why_onednn_unavailable

    linear = "onednn" if why_onednn_unavailable("cpu", torch.float32) is None else "aten"
    with Engine(EngineConfig(dtype="float32", threads=2, linear_backend=linear)) as engine:
        yield engine


# The kernels fixed where a served model's numbers are compared with another process's (an in-process
# Engine, another replica): "auto" times the GEMM libraries and the CPU attention backends at start,
# and where two are close (or the host is busy) two processes may pick differently, which changes
# float32 answers by rounding (~1e-5 in a logprob).
SAME_KERNELS = dict(linear_backend="aten", attention_backend="cpu_flash")

# A small Llama with the default model's vocabulary (so its tokenizer fits) and context length:
# the Triton server tests run on it (loads in well under a second; short prompts take
# milliseconds, a full 8K-token one a few seconds on one thread, long enough to fill a queue).
SERVING_CONFIG = ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True))
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def small_served_model(tmp_path_factory, default_model_path):
    """Folder of a small random-weight Llama checkpoint with the default model's tokenizer."""
    import shutil

    folder = tmp_path_factory.mktemp("small_served_model")
    make_random_model(*SERVING_CONFIG).save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(default_model_path, name)):
            shutil.copy(os.path.join(default_model_path, name), folder)
    return str(folder)
