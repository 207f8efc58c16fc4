"""Builds and loads the compiled CPU kernels: the fused per-token ops (cpu_ops.cpp) and the
flash-attention kernel (cpu_attention.cpp).

Compiled on first use with torch's own extension builder (gcc + ninja, both in the set-up) and
cached under torch's extensions directory (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), so a machine pays the ~1-2 minute build once; `prefillonly prepare`
(run by scripts/setup.sh) builds it ahead of serving and tests.

If one cannot be built here (no compiler, say), `load()` / `load_attention()` return None, the
reason is logged once and kept in `why_unavailable()`, and the ops fall back to torch (the
attention to SDPA). PREFILLONLY_CPU_KERNELS=0 forces the fallback (to compare the two).

ISA safety. Both modules are compiled for baseline x86-64 (no -m flags) under one name whatever
the building host's CPU, with per-ISA regions inside (`#pragma GCC target`, nothing in a region
but intrinsics and our own inline code), and pick their instruction set at run time from the
CPU's flags: one build runs on any x86-64 host and never executes an instruction it lacks.
The per-token ops have an AVX-512 (F/BW/DQ/VL) and an AVX2+FMA path; a CPU with neither gets
None from `load()` ("the CPU has neither AVX2+FMA nor AVX-512") and the torch ops.
PREFILLONLY_CPU_OPS_ISA=avx512|avx2 forces one path for the ops (an error at the op where the
CPU lacks it); `auto` (the default) takes the best the CPU has (each op also takes isa=..., and
the module lists supported_isas() / compiled_isas(), for tests).
PREFILLONLY_CPU_ATTENTION_ISA=avx512_bf16|avx512|avx2|avx512_pairs|avx2_pairs forces one of
its variants (an error where the CPU lacks it); `auto` (the default) takes the best the CPU has,
a native bf16 dot-product variant only after a self-check against its portable reference
(attention_isa).

Both are built with -fopenmp: their loops split rows with at::parallel_for, which is a header
template and runs serially unless the extension itself is compiled with OpenMP.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from ..hardware import cpu_flags

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_bindings.cpp", _HERE / "cpu_ops.cpp"]  # cpu_ops.cpp includes cpu_vec_*.h, cpu_ops_body.h
OPS_MODULE = "prefillonly_cpu_ops"  # one name and baseline flags on every host: the ISA is picked at run time
OPS_ISA = os.environ.get("PREFILLONLY_CPU_OPS_ISA", "auto")
ATTENTION_SOURCES = [_HERE / "cpu_attention.cpp"]  # includes cpu_vec_*.h, cpu_attention_{softmax,body,pairs}.h
ATTENTION_ISA = os.environ.get("PREFILLONLY_CPU_ATTENTION_ISA", "auto")
_OPENMP = ("-fopenmp",)  # a tuple: torch's load() appends its libraries to the list it is given
_lock = threading.Lock()
_state: dict = {}
_attention_state: dict = {}


def _cpu_flags() -> set[str]:
    """The CPU's /proc/cpuinfo flags (one reader for the whole package: hardware.cpu_flags)."""
    return set(cpu_flags())


def _isa() -> str:
    """The ops' forced path (PREFILLONLY_CPU_OPS_ISA), 'auto' by default. It only selects among the
    paths compiled into the one build; the build itself never depends on the host's flags."""
    return OPS_ISA


def load():
    """The compiled per-token ops, or None when they cannot be built here or the CPU has none of
    their instruction sets."""
    with _lock:
        if "module" not in _state:
            module, error = _build(OPS_MODULE, SOURCES, [])
            if module is not None and not module.supported_isas():
                module, error = None, "the CPU has neither AVX2+FMA nor AVX-512"
                log.warning("prefillonly: compiled CPU ops unavailable, using torch ops (%s)", error)
            if module is not None:
                module.set_default_isa(_isa())
            _state["module"], _state["error"] = module, error
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


# The native variants of the attention kernel, each with the portable path that computes the same
# thing through the instruction's documented semantics (same layout, same bf16 rounding of P):
# a native variant is used only after it agreed with its reference once in this process.
NATIVE_ATTENTION = {"avx512_bf16": "avx512_pairs"}
_FMA_PATHS = ("avx512", "avx2")  # float32-FMA paths, best first


def attention_isa(dtype: torch.dtype) -> str:
    """The kernel variant attention on `dtype` inputs runs on in this process: the ISA forced by
    PREFILLONLY_CPU_ATTENTION_ISA, else the CPU's best (for bfloat16 a native bf16 dot-product
    path once its self-check passed, else the best float32-FMA path)."""
    if ATTENTION_ISA != "auto":
        return ATTENTION_ISA
    key = ("isa", dtype)
    chosen = _attention_state.get(key)  # every attention call asks: no lock once chosen
    if chosen is not None:
        return chosen
    module = load_attention()
    if module is None:
        raise RuntimeError(f"CPU flash attention unavailable: {why_attention_unavailable()}")
    with _lock:
        if key not in _attention_state:
            _attention_state[key] = choose_isa(module.supported_isas(), dtype, lambda isa, *t: _run_kernel(module, isa, *t))
        return _attention_state[key]


def choose_isa(supported: list[str], dtype: torch.dtype, run) -> str:
    """The first native variant in `supported` that passes its self-check for bfloat16, else the
    best float32-FMA path. `run(isa, q, k, v)` computes attention on one variant (injectable so
    the choice can be tested with any set of flags)."""
    fallback = next((isa for isa in _FMA_PATHS if isa in supported), None)
    if fallback is None:
        raise RuntimeError(f"CPU flash attention: no float32 path among {supported}")
    if dtype != torch.bfloat16:
        return fallback
    for native, reference in NATIVE_ATTENTION.items():
        if native in supported and reference in supported:
            problem = self_check_mismatch(native, reference, run)
            if problem is None:
                log.info("prefillonly: CPU attention uses %s (self-check against %s passed)", native, reference)
                return native
            log.warning("prefillonly: CPU attention's %s path disagrees with its portable reference %s (%s); "
                        "using %s instead", native, reference, problem, fallback)
    return fallback


def self_check_mismatch(native: str, reference: str, run) -> str | None:
    """None when `native` computes what `reference` does on small random attentions (odd key
    counts, a cached prefix, GQA, head_dim 64 and 128), else what differed. Both round P to bf16
    the same way, so they agree to float32 accumulation order: within 2 bf16 ulps of the output."""
    g = torch.Generator().manual_seed(1234)
    for hkv, group, lq, prefix, d in ((2, 3, 37, 29, 64), (1, 1, 5, 0, 128), (1, 8, 1, 70, 64)):
        q = torch.randn(hkv * group, lq, d, generator=g).bfloat16()
        k = torch.randn(hkv, prefix + lq, d, generator=g).bfloat16()
        v = torch.randn(hkv, prefix + lq, d, generator=g).bfloat16()
        got, want = run(native, q, k, v).float(), run(reference, q, k, v).float()
        if not torch.isfinite(got).all():
            return f"non-finite output at {lq} queries over {prefix} cached, head_dim {d}"
        err, bound = (got - want).abs().max().item(), 2.0 ** -7 * want.abs().max().item()
        if not err <= bound:
            return f"max difference {err:.3g} over the bound {bound:.3g} at {lq} queries over {prefix} cached, head_dim {d}"
    return None


def _run_kernel(module, isa: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(q)
    module.flash_attention(q, k, v, out, q.shape[-1] ** -0.5, isa, 0, 0)
    return out


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
