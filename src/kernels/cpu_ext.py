"""Builds and loads the compiled CPU kernels: the fused per-token ops (cpu_ops.cpp) and the
flash-attention kernel (cpu_attention.cpp).

Compiled on first use with torch's own extension builder (gcc + ninja, both in the set-up) and
cached under torch's extensions directory (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), so a machine pays the ~1-2 minute build once; `prefillonly prepare`
(run by scripts/setup.sh) builds it ahead of serving and tests.

If one cannot be built here (no compiler, say), `load()` / `load_attention()` return None, the
reason is logged once and kept in `why_unavailable()`, and the ops fall back to torch (the
attention to SDPA). PREFILLONLY_CPU_KERNELS=0 forces the fallback (to compare the two).

ISA safety. The per-token ops are compiled for the ISA of the host that builds them (ATen's
Vectorized is only as wide as its CPU_CAPABILITY), under a module name that includes that ISA, so
a host with other flags builds and loads its own copy instead of running foreign instructions.
The attention kernel is compiled for baseline x86-64 with per-ISA regions inside and picks its
instruction set at run time from the CPU's flags: one build runs anywhere.
PREFILLONLY_CPU_ATTENTION_ISA=avx2|avx512 forces one of its paths (an error where the CPU
lacks it); `auto` (the default) takes the best the CPU has.

Both are built with -fopenmp: their loops split rows with at::parallel_for, which is a header
template and runs serially unless the extension itself is compiled with OpenMP.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_bindings.cpp", _HERE / "cpu_ops.cpp"]
ATTENTION_SOURCES = [_HERE / "cpu_attention.cpp"]  # includes cpu_attention_body.h
ATTENTION_ISA = os.environ.get("PREFILLONLY_CPU_ATTENTION_ISA", "auto")
_OPENMP = ("-fopenmp",)  # a tuple: torch's load() appends its libraries to the list it is given
_lock = threading.Lock()
_state: dict = {}
_attention_state: dict = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _isa() -> tuple[str, list[str]]:
    """ATen's Vectorized<float> is only as wide as the CPU_CAPABILITY it is compiled for."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"]
    return "generic", []


def load():
    """The compiled per-token ops, or None when they cannot be built here."""
    with _lock:
        if "module" not in _state:
            isa, flags = _isa()
            _state["module"], _state["error"] = _build(f"prefillonly_cpu_kernels_{isa}", SOURCES, flags)
        return _state["module"]


def why_unavailable() -> str | None:
    load()
    return _state["error"]


def load_attention():
    """The compiled flash-attention kernel, or None when it cannot be built here or the CPU has
    none of its instruction sets (then attention runs on torch SDPA)."""
    with _lock:
        if "module" not in _attention_state:
            module, error = _build("prefillonly_cpu_attention", ATTENTION_SOURCES, [])
            if module is not None and not module.supported_isas():
                module, error = None, "the CPU has neither AVX2+FMA nor AVX-512"
            _attention_state["module"], _attention_state["error"] = module, error
        return _attention_state["module"]


def why_attention_unavailable() -> str | None:
    load_attention()
    return _attention_state["error"]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits beside the venv's python,
    which is not on PATH when the venv is not activated (Triton's python backend stub)."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        return
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build(name: str, sources: list[Path], flags: list[str]):
    if os.environ.get("PREFILLONLY_CPU_KERNELS", "1") == "0":
        return None, "disabled by PREFILLONLY_CPU_KERNELS=0"
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()
        module = load_extension(name=name, sources=[str(s) for s in sources], extra_cflags=["-O3", *_OPENMP, *flags],
                                extra_ldflags=list(_OPENMP), verbose=False)
        return module, None
    except Exception as e:  # no compiler / ninja / headers: the torch ops still work
        text = str(e).strip()
        reason = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
        log.warning("prefillonly: compiled CPU kernel %s unavailable, using torch ops (%s)", name, reason)
        return None, reason
