"""KernelBackend: the one choice of kernels an engine makes at start, which the executor computes
with and the memory prediction counts by."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import cpu_ext, gpu_support
from prefillonly.kernels.backend import KernelBackend
from prefillonly.kernels.ops import CompiledCpuOps, TorchOps

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def compiled():
    # This machine class has gcc and the set-up installs ninja: a build failure is a defect here.
    assert cpu_ext.load() is not None, cpu_ext.why_unavailable()
    assert cpu_ext.load_attention() is not None, cpu_ext.why_attention_unavailable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernels_where_they_take_the_model(compiled, dtype):
    k = KernelBackend(CPU, dtype, 64, "cpu_flash", "aten")
    assert k.attention_path.name == "cpu_flash" and k.writes_over_q
    assert isinstance(k.ops, CompiledCpuOps) and k.rope_dtype == torch.float32
    assert not k.norm_scratch(qk_norm=False) and k.norm_scratch(qk_norm=True)  # q/k norms are 3-d views: torch path


@pytest.mark.parametrize("head_dim,dtype", [(24, torch.float32), (272, torch.float32), (64, torch.float64)])
def test_attention_the_kernel_does_not_cover_runs_on_torch(compiled, head_dim, dtype):
    k = KernelBackend(CPU, dtype, head_dim, "cpu_flash")
    assert k.attention_path.name == "torch" and not k.writes_over_q
    if dtype == torch.float64:
        assert type(k.ops) is TorchOps and k.rope_dtype == torch.float64 and k.norm_scratch(False)


def test_sdpa_keeps_the_compiled_per_token_ops(compiled):
    k = KernelBackend(CPU, torch.float32, 64, "sdpa")
    assert k.attention_path.name == "torch" and isinstance(k.ops, CompiledCpuOps)


def test_triton_is_chosen_only_where_it_runs():
    k = KernelBackend(CPU, torch.float16, 64, "triton")
    want = "triton" if gpu_support.runs_on(CPU) else "torch"  # CPU: only under TRITON_INTERPRET=1
    assert k.attention_path.name == want and k.ops.name == want


def test_choose_resolves_auto_and_refuses_what_cannot_run():
    chosen = KernelBackend.choose(CPU, torch.float32, 64, 4, 2)
    assert chosen.attention in ("cpu_flash", "sdpa") and chosen.linear in ("aten", "onednn")
    with pytest.raises(ValueError, match="'flash_attn' needs CUDA"):
        KernelBackend.choose(CPU, torch.float32, 64, 4, 2, attention="flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        KernelBackend.choose(CPU, torch.float32, 64, 4, 2, attention="fast")



def test_no_self_check_where_no_triton_kernel_runs():
    assert KernelBackend.choose(CPU, torch.float32, 64, 4, 2).self_check is None
    assert not KernelBackend.choose(CPU, torch.float32, 64, 4, 2).on_torch


def test_the_device_scope_makes_an_indexed_cuda_device_current_and_is_empty_elsewhere():
    """Triton launches on the thread's current CUDA device: an engine on cuda:N computes inside
    torch.cuda.device(N) (entering it needs a GPU: perf/gpu_check.py runs an engine on the last one)."""
    import contextlib

    assert isinstance(gpu_support.device_scope(CPU), contextlib.nullcontext)
    scope = gpu_support.device_scope(torch.device("cuda", 1))
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    gpu_support.synchronize(CPU)  # nothing to wait for, no CUDA call
