"""dtype="auto" (the default): bfloat16 on CUDA and on CPUs with a native bf16 dot product, else
float32 (prefillonly.hardware). The rule is tested on mocked CPU flags; on this host only through
resolve_dtype with the real flags, so the tests hold on AVX2-only, AVX-512 and AMX hosts alike."""

from __future__ import annotations

import logging

import pytest
import torch

from prefillonly import ConfigError, Engine, EngineConfig
from prefillonly.hardware import cpu_flags, resolve_dtype
from prefillonly.kernels import score_head

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags,want,needle", [
    (AVX2_ONLY, "float32", "lacks avx512_bf16 and amx_bf16"),
    ({"avx2", "fma", "avx512f"}, "float32", "lacks avx512_bf16 and amx_bf16"),  # AVX-512 without bf16
    (set(), "float32", "lacks"),  # flags unreadable
    ({"avx512f", "avx512_bf16"}, "bfloat16", "has avx512_bf16"),
    ({"amx_bf16"}, "bfloat16", "has amx_bf16"),
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "has avx512_bf16 and amx_bf16"),
])
def test_auto_on_cpu_follows_the_bf16_dot_product_flags(flags, want, needle):
    dtype, reason = resolve_dtype("auto", "cpu", flags)
    assert dtype == want
    assert reason.startswith(f"auto: {want} (") and needle in reason


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(device):
    assert resolve_dtype("auto", device, AVX2_ONLY) == ("bfloat16", "auto: bfloat16 (CUDA device)")


@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("flags", [AVX2_ONLY, {"avx512f", "avx512_bf16"}, {"amx_bf16"}])
def test_an_explicit_dtype_is_honoured(requested, flags):
    assert resolve_dtype(requested, "cpu", flags) == (requested, "explicit")
    assert resolve_dtype(requested, "cuda", flags) == (requested, "explicit")


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvmx flags\t: ept vpid\nflags\t\t: fpu avx2 fma avx512_bf16\nbugs\t\t: spectre_v1\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(cpuinfo)) == frozenset({"fpu", "avx2", "fma", "avx512_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    (tmp_path / "noflags").write_text("Features\t: fp asimd bf16\n")  # e.g. aarch64
    assert cpu_flags(str(tmp_path / "noflags")) == frozenset()
    assert isinstance(cpu_flags(), frozenset)


def test_auto_is_the_default_and_resolves_to_this_hosts_choice():
    want, reason = resolve_dtype("auto", "cpu", cpu_flags())
    assert EngineConfig.default_of("dtype") == "auto"
    for config in (EngineConfig(), EngineConfig(dtype="auto"), EngineConfig(dtype="AUTO"),
                   EngineConfig.from_strings({"dtype": "auto"}), EngineConfig.from_strings({"dtype": ""})):
        assert (config.requested_dtype, config.dtype, config.dtype_reason) == ("auto", want, reason)
        assert config.torch_dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[want]
        assert config == EngineConfig(dtype=want)  # the same engine settings as the explicit dtype


@pytest.mark.parametrize("requested,want", [("float32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16")])
def test_explicit_config_dtype_is_kept_on_any_host(requested, want):
    config = EngineConfig(dtype=requested)
    assert (config.requested_dtype, config.dtype, config.dtype_reason) == (want, want, "explicit")


def test_float16_stays_cuda_only_and_bad_dtypes_name_auto():
    with pytest.raises(ConfigError, match="float16 is only supported on CUDA"):
        EngineConfig(dtype="float16")
    with pytest.raises(ConfigError, match="choose one of auto, float32"):
        EngineConfig(dtype="int8")


def test_engine_with_auto_equals_the_explicit_dtype_it_resolved_to(default_model_path, caplog):
    """The default config's engine (dtype auto) computes exactly what one built with the dtype
    auto chose does, and reports the choice: start-up log, stats(), the metrics' info labels."""
    from prefillonly.serving.model.metrics import engine_info_labels

    want, reason = resolve_dtype("auto", "cpu", cpu_flags())
    prompt, allowed = "Is the sky blue on a clear day? Answer:", [" Yes", " No", " Maybe"]
    with caplog.at_level(logging.INFO, logger="prefillonly"):
        # one attention backend for both: "auto" times cpu_flash against sdpa at start, and on a host
        # where they run close the two engines may pick differently (equal within 1e-5, not exactly)
        with Engine(EngineConfig(threads=2, cache_budget_bytes=0, attention_backend="sdpa")) as auto:
            got = auto.score(prompt, allowed, top_k=3)
            stats = auto.stats()
    assert auto.dtype == EngineConfig(dtype=want).torch_dtype
    assert (stats.dtype, stats.dtype_reason) == (want, reason)
    assert engine_info_labels(stats) == {"dtype": want, "dtype_reason": reason, "attention_backend": "sdpa",
                                         "linear_backend": stats.linear_backend, "score_head": stats.score_head,
                                         "kernel_check": "none run"}  # no Triton kernel runs on CPU
    assert stats.kernel_check == ""
    assert stats.linear_backend in ("aten", "onednn")
    assert stats.score_head == ("linear" if want == "float32" else score_head.choose(torch.device("cpu"), torch.bfloat16))
    assert f"dtype {want} ({reason})" in [r.getMessage() for r in caplog.records if r.name == "prefillonly"]
    with Engine(EngineConfig(dtype=want, threads=2, cache_budget_bytes=0, attention_backend="sdpa")) as explicit:
        ref = explicit.score(prompt, allowed, top_k=3)
        assert explicit.stats().dtype_reason == "explicit"
    assert [(t.id, t.logprob, t.prob) for t in got.tokens] == [(t.id, t.logprob, t.prob) for t in ref.tokens]  # exactly
    assert [(t.id, t.logprob) for t in got.top_k] == [(t.id, t.logprob) for t in ref.top_k]
    assert got.chosen == ref.chosen
