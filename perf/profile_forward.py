"""Where one cold forward's time goes: the default model, one prompt of N random tokens, under
the torch profiler, once per attention backend (fresh engine each, same process).

    .venv/bin/python -m perf.profile_forward [--dtype float32] [--tokens 5600] [--backends cpu_flash,sdpa]

Prints the wall time of an unprofiled forward and the profiler's top ops by self time (the
compiled attention kernel appears as prefillonly::cpu_flash_attention).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from prefillonly import Engine, EngineConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.profile_forward")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=5600)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", default="cpu_flash,sdpa")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    for backend in args.backends.split(","):
        engine = Engine(EngineConfig(dtype=args.dtype, threads=args.threads, attention_backend=backend, cache_budget_bytes=0))
        chunk = engine.config.chunk_size
        engine.executor.forward(ids[:512], chunk)  # warm-up
        t0 = time.perf_counter()
        engine.executor.forward(ids, chunk)
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.executor.forward(ids, chunk)
        print(f"== {backend}, {args.dtype}, {args.tokens} tokens: forward {wall:.2f} s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
