"""EngineConfig validation: each bad value is a ConfigError naming the setting."""

from __future__ import annotations

import json

import pytest

from prefillonly import ConfigError, EngineConfig, UnsupportedModelError
from prefillonly.model.spec import ModelSpec


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dtype="int8"), "dtype 'int8'"),
        (dict(device="tpu"), "device 'tpu'"),
        (dict(dtype="float16"), "float16 is only supported on CUDA"),
        (dict(chunk_size="abc"), "chunk_size must be an integer"),
        (dict(chunk_size=-1), "chunk_size must be >= 0"),
        (dict(max_input_len=0), "max_input_len must be >= 1"),
        (dict(threads=0), "threads must be >= 1"),
        (dict(attention_backend="magic"), "attention_backend 'magic'"),
        (dict(head_dtype="bfloat16"), "head_dtype 'bfloat16' unknown; choose one of float32, model"),
        (dict(model="/no/such/folder"), "does not exist"),
    ],
)
def test_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_string_settings_and_aliases():
    c = EngineConfig.from_strings({"dtype": "bf16", "chunk_size": "none", "max_input_len": "40_000", "threads": "2"})
    assert (c.dtype, c.chunk_size, c.max_input_len, c.threads) == ("bfloat16", None, 40000, 2)
    assert EngineConfig(chunk_size=0).chunk_size is None
    assert EngineConfig.from_strings({"head_dtype": "FP32"}).head_dtype == "float32"  # the dtype aliases
    assert EngineConfig.from_strings({"head_dtype": "model"}).head_dtype == "model"
    assert EngineConfig.from_strings({"head_dtype": ""}).head_dtype == "float32"  # unset: the default
    with pytest.raises(ConfigError, match="unknown engine setting"):
        EngineConfig.from_strings({"chunk": "5"})


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelSpec.from_folder(str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelSpec.from_folder(str(tmp_path))


def test_engine_config_is_the_one_home_of_the_defaults():
    """The scheduler, the simulator and the CLI take their defaults from EngineConfig's fields."""
    import argparse

    from perf import simulate as sim
    from prefillonly import cli
    from prefillonly.scheduler import JctEstimator, Scheduler

    config = EngineConfig()
    scheduler = Scheduler("csjf", JctEstimator())
    assert (scheduler.max_waiting, scheduler.lambda_tokens_per_s) == (config.max_waiting, config.lambda_tokens_per_s)
    assert sim.SimConfig().lambda_tokens_per_s == config.lambda_tokens_per_s and sim.DEFAULT_BLOCK == config.cache_block_size
    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    assert cli._config(parser.parse_args([])) == config  # every flag's default is the field's
    assert EngineConfig.default_of("cache_dir") == config.cache_dir
    with pytest.raises(KeyError, match="no setting 'max_wait'"):
        EngineConfig.default_of("max_wait")


def test_an_empty_limit_in_the_model_config_is_the_default_not_no_limit():
    """The model config's "" (or "none") for a request limit means its default: a None limit would
    fail every request with a TypeError instead of a clear refusal."""
    config = EngineConfig.from_strings({"max_items": "", "max_waiting": "none", "max_allowed_tokens": ""})
    default = EngineConfig()
    assert (config.max_items, config.max_waiting, config.max_allowed_tokens) == (
        default.max_items, default.max_waiting, default.max_allowed_tokens)
