"""The projections' GEMM backends (kernels.linear): numbers against float64, packing, the timed
choice, and what each backend leaves to the workspace and the memory prediction."""

from __future__ import annotations

import pytest
import torch

from prefillonly.config import EngineConfig
from prefillonly.contract.errors import ConfigError
from prefillonly.hardware import onednn_native_bf16
from prefillonly.kernels.linear import (LINEAR_BACKENDS, allocates_output, call_scratch_bytes, choose, linear, pack,
                                        resolve_linear_backend, weight_nbytes, why_onednn_unavailable)
from prefillonly.model.spec import ModelSpec
from prefillonly.model.weights import ModelWeights
from prefillonly.worker.workspace import plan_workspace

from ..conftest import FAMILY_CONFIGS

CPU = torch.device("cpu")
SHAPES = [(1, 48, 40), (7, 576, 960), (130, 100, 333), (257, 1536, 576)]  # rows, in, out: odd sizes on purpose


def _backends(dtype):
    """Every concrete backend that runs `dtype` here (aten always; onednn where oneDNN takes it)."""
    return ["aten"] + (["onednn"] if why_onednn_unavailable("cpu", dtype) is None else [])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_float64_on_every_backend(dtype, rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    x, w = torch.randn(rows, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    # fp32: accumulation order only; bf16: the output's one rounding to bf16 (2^-8 relative) on
    # fp32 accumulation of exact bf16 products
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for backend in _backends(dtype):
        out = torch.empty(rows, n, dtype=dtype)
        got = linear(out, x, pack(w, backend), b)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert (got is out) == (not allocates_output(backend)), backend
        err = ((got.double() - want).abs() / (want.abs() + 1)).max().item()
        assert err <= tol, f"{backend} {dtype} {rows}x{k}->{n} bias={bias}: relative error {err:.2e}"


def test_packing_replaces_the_plain_weights_and_keeps_their_size():
    cls_name, kwargs = FAMILY_CONFIGS["llama_gqa_llama3rope_untied"]
    import transformers

    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    for backend in _backends(torch.float32):
        weights = ModelWeights.random(spec, torch.float32, CPU)
        plain = weights.nbytes()
        pairs = weights.layers[0].projections()
        assert [tuple(w.shape) for w, _ in pairs] == [(spec.qkv_width, spec.hidden_size), (spec.hidden_size, spec.q_width),
                                                      (2 * spec.intermediate_size, spec.hidden_size),
                                                      (spec.hidden_size, spec.intermediate_size)]
        weights.pack_linears(backend)
        packed = [w for layer in weights.layers for w, _ in layer.projections()]
        assert all((w.layout == torch._mkldnn) == (backend == "onednn") for w in packed), backend
        # oneDNN's blocked layout may pad, never shrink; small configs pad by little
        assert plain <= weights.nbytes() <= plain * 1.5, (backend, plain, weights.nbytes())
        assert weights.pack_linears(backend) is weights  # a second call leaves packed weights as they are
        assert all(weight_nbytes(w) > 0 for w in packed)


def test_auto_chooses_the_faster_and_explicit_choices_are_checked():
    w = [(torch.randn(40, 48), None)]
    assert choose(w, torch.float32, time_of={"aten": 2.0, "onednn": 1.0}.get) == "onednn"
    assert choose(w, torch.float32, time_of={"aten": 1.0, "onednn": 2.0}.get) == "aten"
    assert choose(w, torch.float32, time_of={"aten": 0.95, "onednn": 1.0}.get) == "onednn"  # a near tie: the same everywhere
    for backend in ("aten", "onednn"):
        if backend in _backends(torch.float32):
            assert resolve_linear_backend(backend, CPU, torch.float32) == backend
    assert resolve_linear_backend("auto", CPU, torch.float32, w) in _backends(torch.float32)
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'"):
        resolve_linear_backend("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="CPU only"):  # checked before anything touches the device
        resolve_linear_backend("onednn", torch.device("cuda"), torch.bfloat16)
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.bfloat16) == "aten"
    assert why_onednn_unavailable("cpu", torch.float16) is not None
    with pytest.raises(ConfigError, match="linear_backend 'fast' unknown"):
        EngineConfig(linear_backend="fast")
    assert EngineConfig(linear_backend="oneDNN").linear_backend == "onednn" and "onednn" in LINEAR_BACKENDS


def test_an_allocating_backend_plans_no_projection_outputs():
    cls_name, kwargs = FAMILY_CONFIGS["llama_gqa_llama3rope_untied"]
    import transformers

    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    kept = plan_workspace(spec, 100, 32, torch.float32)
    dropped = plan_workspace(spec, 100, 32, torch.float32, linear_outputs=False)
    for name in ("qkv", "proj", "gate_up"):
        assert kept.shapes[name][0][0] == 32 and dropped.shapes[name][0][0] == 0, name
    assert {k: v for k, v in kept.shapes.items() if k not in ("qkv", "proj", "gate_up")} == \
        {k: v for k, v in dropped.shapes.items() if k not in ("qkv", "proj", "gate_up")}


def test_onednn_native_bf16_follows_the_cpu_and_the_isa_cap():
    bf16_cpu, plain_cpu = {"avx512f", "avx512_bf16"}, {"avx512f", "avx512bw"}
    assert onednn_native_bf16(bf16_cpu, {})
    assert onednn_native_bf16({"amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"})
    assert not onednn_native_bf16(plain_cpu, {})
    assert not onednn_native_bf16(bf16_cpu, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"})
    assert not onednn_native_bf16(bf16_cpu, {"DNNL_MAX_CPU_ISA": "AVX2"})
    assert onednn_native_bf16(bf16_cpu, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})


def test_call_scratch_is_counted_only_where_bf16_is_emulated():
    assert call_scratch_bytes(512, 3072, torch.float32) == 0
    assert call_scratch_bytes(512, 3072, torch.bfloat16, "cuda") == 0
    emulated = (not onednn_native_bf16()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert call_scratch_bytes(512, 3072, torch.bfloat16) == ((4 * 3072 + 512) * 512 if emulated else 0)
