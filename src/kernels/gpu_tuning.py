"""Tile sizes of the Triton attention kernel: a tuned choice cached on disk, else a default.

Tuning never happens inside a timed run or a request: `tune_attention` (run by
perf/gpu_check.py before it times anything, or by hand) times each candidate on a shape and
writes the fastest to <cache dir>/triton_tiles.json, keyed by device name, triton version,
head_dim and dtype. `attention_tiles` reads that file once per process.

A choice is (BLOCK_M, BLOCK_N, num_warps, num_stages). The defaults are the usual Hopper/Ampere
flash-attention tiles (128 queries x 64 keys, 8 warps for head_dim 128); they are not measured
here (no GPU on the build hosts). Under the interpreter small tiles keep the CPU tests quick.
"""

from __future__ import annotations

import json
import os
import time

import torch

from ..contract.paths import default_cache_dir
from .gpu_support import interpreting, triton_version

CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 4)]
_DEFAULTS = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}
_INTERPRETER_TILES = (32, 32, 1, 1)  # tl.dot needs >= 16; 32 keeps the interpreter quick
_loaded: dict | None = None


def tiles_file() -> str:
    return os.path.join(default_cache_dir(), "triton_tiles.json")


def _key(head_dim: int, dtype: torch.dtype, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|triton {triton_version()}|d{head_dim}|{str(dtype).removeprefix('torch.')}"


def _tuned() -> dict:
    global _loaded
    if _loaded is None:
        try:
            with open(tiles_file()) as f:
                _loaded = json.load(f)
        except (OSError, ValueError):
            _loaded = {}
    return _loaded


def attention_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda" and interpreting():
        return _INTERPRETER_TILES
    tuned = _tuned().get(_key(head_dim, dtype, device))
    return tuple(tuned) if tuned else _DEFAULTS[head_dim]


def tune_attention(run, head_dim: int, dtype: torch.dtype, device: torch.device, reps: int = 5,
                   candidates=CANDIDATES) -> dict:
    """Time `run(tiles)` (one attention call with those tiles) for each candidate, keep the
    fastest for this key on disk; returns {tiles: seconds or error} for the report."""
    timings = {}
    for tiles in candidates:
        if tiles[0] * head_dim > 128 * 256 or tiles[1] * head_dim > 128 * 256:  # too much shared memory
            continue
        try:
            run(tiles)  # compile + warm
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                run(tiles)
            torch.cuda.synchronize(device)
            timings[tiles] = (time.perf_counter() - t0) / reps
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            timings[tiles] = f"{type(exc).__name__}: {exc}"[:200]
    ok = {t: s for t, s in timings.items() if isinstance(s, float)}
    if ok:
        best = min(ok, key=ok.get)
        table = dict(_tuned())
        table[_key(head_dim, dtype, device)] = list(best)
        os.makedirs(os.path.dirname(tiles_file()), exist_ok=True)
        tmp = tiles_file() + ".tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, tiles_file())
        global _loaded
        _loaded = table
    return timings
