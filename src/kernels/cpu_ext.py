"""Builds and loads the compiled CPU kernels (cpu_ops.cpp).

Compiled on first use with torch's own extension builder (gcc + ninja, both in the set-up) and
cached under torch's extensions directory (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), so a machine pays the ~1-2 minute build once; `prefillonly prepare`
(run by scripts/setup.sh) builds it ahead of serving and tests.

If it cannot be built here (no compiler, say), `load()` returns None, the reason is logged once
and kept in `why_unavailable()`, and every op falls back to its torch implementation.
PREFILLONLY_CPU_KERNELS=0 forces the fallback (to compare the two).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_bindings.cpp", _HERE / "cpu_ops.cpp"]
_lock = threading.Lock()
_state: dict = {}


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
    """The compiled module, or None when it cannot be built here."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build()
        return _state["module"]


def why_unavailable() -> str | None:
    load()
    return _state["error"]


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


def _build():
    if os.environ.get("PREFILLONLY_CPU_KERNELS", "1") == "0":
        return None, "disabled by PREFILLONLY_CPU_KERNELS=0"
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()
        isa, flags = _isa()
        module = load_extension(name=f"prefillonly_cpu_kernels_{isa}", sources=[str(s) for s in SOURCES],
                                extra_cflags=["-O3", *flags], verbose=False)
        return module, None
    except Exception as e:  # no compiler / ninja / headers: the torch ops still work
        text = str(e).strip()
        reason = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
        log.warning("prefillonly: compiled CPU kernels unavailable, using torch ops (%s)", reason)
        return None, reason
