"""When the Triton-language kernels run, decided in one place.

They run on CUDA tensors of bfloat16 / float16 when the `triton` package imports, unless
PREFILLONLY_TRITON_KERNELS=0 forces the torch ops. On CPU they run only under Triton's
interpreter (TRITON_INTERPRET=1, read by triton when a kernel is defined), which is how the
CPU test suite checks their logic; the compiled CPU kernels (cpu_ext) keep precedence there
for the dtypes they take. float32 and other dtypes always use the torch ops on CUDA.

The interpreter computes with numpy, which has no bfloat16: it adds and multiplies bf16
values as raw 16-bit integers, so bf16 results under it are garbage. Interpreter tests use
float16, which goes through the same kernel code; bf16 is checked on a GPU (perf/gpu_check.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tl.arange needs them, tl.dot wants >= 16


def disabled_by_env() -> bool:
    return os.environ.get("PREFILLONLY_TRITON_KERNELS", "1").strip() == "0"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    """The importable triton's version, or None (not installed, or broken)."""
    try:
        return importlib.import_module("triton").__version__
    except Exception:  # noqa: BLE001 - an unusable triton means "use the torch ops"
        return None


def runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` in this process."""
    if disabled_by_env() or triton_version() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def applies(t: torch.Tensor) -> bool:
    """Whether the per-token Triton kernels take tensors like `t`."""
    return t.dtype in KERNEL_DTYPES and runs_on(t.device)


def attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in KERNEL_DTYPES and head_dim in ATTENTION_HEAD_DIMS and runs_on(device)


def device_scope(device: torch.device):
    """A context in which kernels launch on `device`: Triton launches on the thread's current CUDA
    device, not on its tensors', so an engine on cuda:1 must make that the current device around
    everything it computes (its start-up and its worker's steps); elsewhere nothing to do."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA runs asynchronously): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
