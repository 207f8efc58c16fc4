"""The layers' projections (QKV, o_proj, gate/up, down) and the LM head: y = x @ W.T (+ b) on the
host's best GEMM.

Backends (EngineConfig.linear_backend):
  "aten"    torch.matmul / addmm into the workspace's preallocated buffers (out=). On CPU fp32
            this is MKL's GEMM, on CPU bf16 oneDNN with the plain [out, in] weight, on CUDA cuBLAS.
  "onednn"  oneDNN with each weight reordered once, at load, into the blocked layout its GEMM
            kernels read (torch's own bindings: mkldnn._reorder_linear_weight and
            mkldnn._linear_pointwise, the pair vLLM-CPU's and inductor's CPU linears call). It
            has no out= form: each call allocates its output, so the executor plans no buffer for
            it and memory.py counts the largest output alive at a time instead. CPU only; bf16
            where torch routes bf16 to oneDNN (AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
  "auto"    on CPU onednn unless aten is clearly faster (_ATEN_MARGIN) on the model's own layer-0
            weights at 128 and 512 rows, timed at start (choose); on other devices aten.
Measured on an AMD EPYC Zen4 (avx512_bf16, 2 threads, 2026-12-03, SmolLM2's four projections at
128-2,048 rows): fp32 aten 98-157 GFLOP/s vs oneDNN packed 180-206; bf16 aten 232-390 vs oneDNN
packed 319-413 (perf/RESULTS.md "Linear layers", `python -m perf.bench_linear`).

Library buffers the caller cannot see (torch's allocator never hears of them, so memory.py adds
them from this module): where oneDNN has no native bf16 (no AVX512_BF16 / AMX, or capped by
ONEDNN_MAX_CPU_ISA) it runs a bf16 matmul as a float32 GEMM into a float32 buffer of the whole
output, then converts it: 4 B per output element per call, on either backend (measured: an
8,192 x 576 -> 3,072 bf16 call took 96 MiB beyond its output on aten, 144 MiB with its output on
oneDNN), plus blocks of converted input that grow with the rows (measured under
ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI on an AMD Zen4, 2026-12-03: at most 480 B per row on aten and
90 B on oneDNN-packed over SmolLM2's and the memory tests' shapes at 512 and 8,192 rows; counted
as _EMULATED_BLOCK_BYTES_PER_ROW).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ..hardware import onednn_native_bf16

LINEAR_BACKENDS = ("auto", "aten", "onednn")
log = logging.getLogger("prefillonly")

_TIMED_ROWS = (128, 512)  # a warm suffix and a chunk of a cold prompt
# aten is kept only when it is clearly faster: two processes on one host kind (replicas, a test and
# its server) then pick the same backend even where the two time within noise of each other, and
# so give bit-identical answers (the two round bf16 outputs differently)
_ATEN_MARGIN = 0.9
_EMULATED_BLOCK_BYTES_PER_ROW = 512
_choices: dict[tuple, str] = {}  # one timing per (dtype, layer shapes, threads) in a process


def aten_linear(out: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ w.T (+ b) -> [rows, out_features] with a plain weight, into `out` (returned)."""
    if b is None:
        return torch.matmul(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def onednn_linear(out: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The same with a weight packed by `pack`: a new tensor (`out` is ignored: no out= form)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


_GEMMS = {"aten": aten_linear, "onednn": onednn_linear}


def gemm(backend: str):
    """The one function a concrete backend's calls go through (KernelBackend.gemm): an engine packs
    every weight it passes there for that backend at load (ModelWeights.pack_linears), so no call
    needs to look at a weight's layout."""
    return _GEMMS[backend]


def linear(out: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """aten_linear or onednn_linear by the weight's layout: for callers that hold weights of either
    layout (the self-check, the timed choice, benchmarks, tests); an engine calls its `gemm`."""
    return (onednn_linear if w.layout == torch._mkldnn else aten_linear)(out, x, w, b)


def allocates_output(backend: str) -> bool:
    """Whether the backend's calls allocate their outputs (the workspace then plans none)."""
    return backend == "onednn"


def call_bytes(backend: str, rows: int, out_features: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """Bytes one call over `rows` rows allocates beyond the workspace: its output where the backend
    allocates it, and the library's own buffers (call_scratch_bytes)."""
    own = torch.tensor([], dtype=dtype).element_size() * rows * out_features if allocates_output(backend) else 0
    return call_scratch_bytes(rows, out_features, dtype, device) + own


def pack(w: torch.Tensor, backend: str) -> torch.Tensor:
    """The weight [out, in] as `backend` reads it: oneDNN's blocked layout (an opaque tensor,
    replacing the plain one), or `w` itself (also where it is packed already). A packed weight
    cannot serve aten: ValueError (the backend's gemm reads one layout and never looks)."""
    if w.layout == torch._mkldnn:
        if backend != "onednn":
            raise ValueError(f"a weight packed for oneDNN cannot run on the {backend!r} linear backend: load the weights afresh")
        return w
    if backend != "onednn":
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def weight_nbytes(w: torch.Tensor) -> int:
    """Bytes a weight holds, packed or plain."""
    if w.layout == torch._mkldnn:
        return int(torch.ops.mkldnn._nbytes(w))
    return w.untyped_storage().nbytes()


@functools.lru_cache(maxsize=8)
def why_onednn_unavailable(device_type: str, dtype: torch.dtype) -> str | None:
    """None where the onednn backend runs tensors of `dtype` on `device_type`, else why not."""
    if device_type != "cpu":
        return "it runs on CPU only"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 and bfloat16, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 path on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
    try:  # the self-check: one packed call against aten on the same numbers
        g = torch.Generator().manual_seed(5)
        x, w = torch.randn(7, 48, generator=g).to(dtype), torch.randn(40, 48, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype)
        got = linear(None, x, pack(w, "onednn"), b).float()
        want = torch.addmm(b.float(), x.float(), w.float().t())
    except RuntimeError as e:
        return f"oneDNN's linear failed its self-check: {e}"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * 8):
        return "oneDNN's linear gave wrong numbers in its self-check"
    return None


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype,
                           weights: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> str:
    """The concrete backend for `backend` (an explicit one is checked, auto chosen); `weights`:
    one layer's plain (weight, bias) pairs that auto times on (none: oneDNN where it runs)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; choose one of {', '.join(LINEAR_BACKENDS)}")
    why = why_onednn_unavailable(device.type, dtype)
    if backend == "onednn" and why is not None:
        raise ValueError(f"linear backend 'onednn' is unavailable: {why}")
    if backend != "auto":
        return backend
    if why is not None:
        return "aten"
    return choose(weights, dtype) if weights else "onednn"


def choose(weights: list[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype, time_of=None) -> str:
    """onednn, unless aten runs these (weight, bias) GEMMs at _TIMED_ROWS rows in under
    _ATEN_MARGIN of its time (best of 3), once per process for a given set of shapes.
    `time_of(backend)` is injectable for tests."""
    key = (dtype, tuple((tuple(w.shape), b is not None) for w, b in weights), torch.get_num_threads())
    if time_of is None and key in _choices:
        return _choices[key]
    seconds = {b: time_of(b) for b in ("aten", "onednn")} if time_of else _time_backends(weights, dtype)
    chosen = "aten" if seconds["aten"] < _ATEN_MARGIN * seconds["onednn"] else "onednn"
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for rows in _TIMED_ROWS for w, _ in weights)
    log.info("prefillonly: linear backend %s (%s: aten %.1f ms = %.0f GFLOP/s, onednn %.1f ms = %.0f GFLOP/s, %d GEMMs at %s rows)",
             chosen, str(dtype).removeprefix("torch."), seconds["aten"] * 1e3, flops / seconds["aten"] / 1e9,
             seconds["onednn"] * 1e3, flops / seconds["onednn"] / 1e9, len(weights), "/".join(map(str, _TIMED_ROWS)))
    _choices[key] = chosen
    return chosen


def _time_backends(weights, dtype: torch.dtype, reps: int = 3) -> dict[str, float]:
    """Best-of-`reps` seconds of the GEMMs per backend, the backends interleaved round by round so
    that a burst of other load hits both alike."""
    g = torch.Generator().manual_seed(3)
    calls = {}
    for backend in ("aten", "onednn"):
        calls[backend] = []
        for rows in _TIMED_ROWS:
            for w, b in weights:
                x = torch.randn(rows, w.shape[1], generator=g).to(dtype)
                out = torch.empty(rows, w.shape[0], dtype=dtype)
                calls[backend].append(functools.partial(linear, out, x, pack(w, backend), b))
    best = {backend: float("inf") for backend in calls}
    for round_ in range(reps + 1):  # round 0 warms up: page faults, oneDNN's primitive cache
        for backend, fns in calls.items():
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            if round_:
                best[backend] = min(best[backend], time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=1)
def _bf16_emulated_by_onednn() -> bool:
    """Whether torch sends bf16 GEMMs to oneDNN and oneDNN emulates them here (not native bf16; on
    AVX2 hosts torch's own bf16 GEMM runs instead, whose few blocks `unseen` covers). Fixed for the
    process: oneDNN reads its ISA cap once."""
    return not onednn_native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def call_scratch_bytes(rows: int, out_features: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """Bytes one GEMM call allocates inside the library beyond its output (invisible to torch):
    the float32 copy of the whole output and its converted input blocks where oneDNN emulates bf16
    (see the module's docstring), else none that grows with the call."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not _bf16_emulated_by_onednn():
        return 0
    return 4 * rows * out_features + _EMULATED_BLOCK_BYTES_PER_ROW * rows
