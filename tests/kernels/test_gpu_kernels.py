"""Runs tests/kernels/gpu_kernel_cases.py (the Triton-language kernels against float64 references and the
torch path) in a subprocess: under Triton's interpreter on CPU, which must be switched on before
the kernels are defined, and natively as well when this host has CUDA."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_cases(env_overrides: dict, workers: int = 1) -> str:
    env = dict(os.environ, **env_overrides)
    env.pop("PREFILLONLY_TRITON_KERNELS", None)
    cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *(["-n", str(workers)] if workers > 1 else []), "tests/kernels/gpu_kernel_cases.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    # every case ran: none skipped (a skip would mean triton is missing or the device check failed)
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "deselected" not in summary, summary
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 50, summary
    return summary


def test_gpu_kernels_under_the_interpreter():
    # the interpreter runs each kernel as single-threaded numpy: two pytest-xdist workers run the
    # cases on both cores (~half the time on 2 cores; every case still runs, none is skipped)
    print(_run_cases({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, workers=min(2, os.cpu_count() or 1)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
def test_gpu_kernels_on_cuda():  # pragma: no cover - needs a GPU
    print(_run_cases({"TRITON_INTERPRET": "0"}))
