"""What this host can do, for the choices made from it: the compute dtype `dtype="auto"` picks.

A leaf module: no torch, no tensors, nothing imported but the standard library, so config
validation, the CLI and the kernels' build can all ask it cheaply.

    resolve_dtype("auto", "cpu")            # ("float32", "auto: float32 (CPU lacks ...)") on an AVX2-only CPU
    resolve_dtype("auto", "cpu", {"amx_bf16"})  # flags injectable (tests)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

# /proc/cpuinfo flags of a native bf16 dot product (VDPBF16PS; AMX TDPBF16PS). Without one, a
# bf16 matmul is converted to float32 piece by piece and runs several times slower than float32.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=4)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo (x86 Linux) as a set; empty when unreadable or
    absent (other OSes, other architectures). Read once per process (cpu_flags.cache_clear())."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(requested: str, device: str, flags: Iterable[str] | None = None) -> tuple[str, str]:
    """(dtype, reason) for the dtype asked for on `device` ("cpu", "cuda", "cuda:N").

    An explicit dtype is returned as is (reason "explicit"; validating it is the caller's
    business). "auto": bfloat16 on CUDA; on CPU bfloat16 where the CPU has a native bf16 dot
    product (BF16_DOT_FLAGS), else float32. `flags`: the CPU's flags; None = cpu_flags()."""
    if requested != "auto":
        return requested, "explicit"
    if str(device).startswith("cuda"):
        return "bfloat16", "auto: bfloat16 (CUDA device)"
    have = set(cpu_flags() if flags is None else flags)
    native = [f for f in BF16_DOT_FLAGS if f in have]
    if native:
        return "bfloat16", f"auto: bfloat16 (CPU has {' and '.join(native)}: native bf16 dot product)"
    return "float32", (f"auto: float32 (CPU lacks {' and '.join(BF16_DOT_FLAGS)}: "
                       "bf16 has no native dot product here)")


# oneDNN's ISA names from AVX512_CORE_BF16 up (its ONEDNN_MAX_CPU_ISA values): a cap at one of
# these still lets it use the CPU's bf16 instructions; a lower cap makes it emulate bf16.
_ONEDNN_BF16_ISAS = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                               "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                               "AVX10_2_512_AMX_2", "ALL", "DEFAULT", ""})


def onednn_native_bf16(flags: Iterable[str] | None = None, environ: dict | None = None) -> bool:
    """Whether oneDNN runs bf16 matmuls on the CPU's bf16 dot product here: the CPU has one
    (BF16_DOT_FLAGS) and no ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) caps oneDNN
    below AVX512_CORE_BF16. Where it is False oneDNN emulates bf16 through float32 buffers
    (kernels.linear.call_scratch_bytes says how large)."""
    env = os.environ if environ is None else environ
    have = set(cpu_flags() if flags is None else flags)
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return any(f in have for f in BF16_DOT_FLAGS) and cap in _ONEDNN_BF16_ISAS
