"""Scheduler benchmark: FCFS vs SJF vs CSJF on the real engine under Poisson load.

    .venv/bin/python -m perf.bench_scheduler                 # cpu-scale post-rec trace, ~6 min
    .venv/bin/python -m perf.bench_scheduler --scale tiny --levels 1.0   # smoke test

The scaled post-recommendation trace (8 users x 10 posts) gets Poisson user arrivals (a user's
requests 0.1 s apart) at several QPS levels around the engine's saturated throughput; each
(policy, level) replays the same arrival times into a fresh Engine (bf16, prefix cache sized to
the profiles, cache_prefix_len = profile) through Engine.submit from a client thread, and
measures each request's latency = completion - arrival. The saturated throughput is measured
first: the whole trace submitted at once under FCFS. Writes the "## Scheduler"
section of perf/RESULTS.md and perf/results/scheduler.json.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

from perf import benchutil as bu
from perf import workloads as wl
from perf.bench_prefix import cache_bytes_for_profiles

SECTION = "## Scheduler"
POLICIES = ("fcfs", "sjf", "csjf")


def make_engine(policy: str, cache_bytes: int, threads: int):
    from prefillonly import Engine, EngineConfig

    return Engine(EngineConfig(dtype="bfloat16", threads=threads, cache_block_size=64, cache_budget_bytes=cache_bytes,
                               scheduling_policy=policy, max_waiting=100_000))


def replay(engine, trace: wl.Trace) -> dict:
    """Submit each request at its arrival time (all at t=0 for an offline trace); wait for all."""
    requests = wl.arrival_order(trace)
    done_at: dict[str, float] = {}
    lock = threading.Lock()
    futures = []
    t0 = time.perf_counter()
    for r in requests:
        if r.arrival_s is not None:
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
        fut = engine.submit(r.prompt_token_ids, trace.allowed_token_ids, cache_prefix_len=r.cache_prefix_len)

        def record(_f, rid=r.request_id):
            with lock:
                done_at[rid] = time.perf_counter() - t0

        fut.add_done_callback(record)
        futures.append(fut)
    errors = sum(1 for f in futures if f.exception(600) is not None)
    wall = max(done_at.values())
    latencies = np.array([done_at[r.request_id] - (r.arrival_s or 0.0) for r in requests])
    stats = engine.cache.stats
    return {"wall_s": wall, "throughput_rps": len(requests) / wall, "mean_latency_s": float(latencies.mean()),
            "p99_latency_s": float(np.percentile(latencies, 99)), "errors": errors,
            "hit_rate": stats.hit_tokens / max(1, stats.hit_tokens + stats.miss_tokens),
            "jct_mean_abs_rel_error": engine.jct.mean_abs_relative_error()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="cpu", choices=sorted(wl.POST_REC_SCALES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levels", default="0.5,0.9,1.2", help="QPS levels as multiples of the saturated throughput")
    p.add_argument("--cache-fraction", type=float, default=1.0,
                   help="prefix cache size as a fraction of all profiles' blocks (< 1: cache pressure, where CSJF's "
                        "re-estimation matters most)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    trace = wl.generate("post_rec", a.scale, a.seed)
    bu.log(trace.summary())
    with make_engine("fcfs", 0, a.threads) as probe:
        cache_bytes = int(a.cache_fraction * cache_bytes_for_profiles(probe.spec, trace, torch.bfloat16))

    with make_engine("fcfs", cache_bytes, a.threads) as engine:
        saturated = replay(engine, trace)
    sat_rps = saturated["throughput_rps"]
    bu.log(f"saturated throughput (offline, fcfs): {sat_rps:.2f} req/s")

    rows = []
    for level in [float(x) for x in a.levels.split(",")]:
        qps = level * sat_rps
        timed = wl.with_poisson_arrivals(trace, wl.user_rate_for_qps(trace, qps))
        for policy in POLICIES:
            with make_engine(policy, cache_bytes, a.threads) as engine:
                r = replay(engine, timed)
            rows.append({"policy": policy, "level": level, "qps": qps, **r})
            bu.log(f"{policy:>4} at {level:.2f}x ({qps:.2f} req/s): mean {r['mean_latency_s']:.2f} s, "
                   f"p99 {r['p99_latency_s']:.2f} s, hit rate {r['hit_rate']:.1%}, {r['throughput_rps']:.2f} req/s")

    data = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(a.threads),
            "trace_summary": trace.summary(), "cache_fraction": a.cache_fraction, "saturated": saturated, "rows": rows}
    out_root = bu.PERF_DIR if a.scale == "cpu" else bu.PERF_DIR / "out" / a.scale
    tag = "" if a.cache_fraction == 1.0 else f"_cache{a.cache_fraction:g}"
    bu.save_json(out_root / "results" / f"scheduler{tag}.json", data)
    section = SECTION if not tag else f"{SECTION}, cache holding {a.cache_fraction:.0%} of the profiles"
    bu.replace_section(out_root / "RESULTS.md", section, render(data))
    bu.log(f"wrote {out_root / 'RESULTS.md'}")
    return 0


def render(data: dict) -> str:
    table = [[r["policy"], f"{r['level']:.2f}x", f"{r['qps']:.2f}", f"{r['throughput_rps']:.2f}", f"{r['mean_latency_s']:.2f}",
              f"{r['p99_latency_s']:.2f}", f"{r['hit_rate']:.1%}", r["errors"],
              "-" if r["jct_mean_abs_rel_error"] is None else f"{r['jct_mean_abs_rel_error']:.0%}"] for r in data["rows"]]
    return "\n".join([
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Machine: {bu.machine_line(data['machine'])}  ",
        f"Trace: {data['trace_summary']}", "",
        f"Real engine (bf16, prefix cache = {data.get('cache_fraction', 1.0):.0%} of the profiles' blocks, cache_prefix_len = "
        f"profile), requests submitted at "
        f"Poisson user arrival times (a user's requests 0.1 s apart); latency = completion - arrival. Saturated "
        f"throughput (whole trace at once, FCFS): {data['saturated']['throughput_rps']:.2f} req/s.", "",
        bu.markdown_table(["policy", "load", "offered req/s", "served req/s", "mean latency s", "P99 latency s",
                           "prefix hit rate", "errors", "JCT estimate error"], table),
        "", "Target (docs/design.md §9): at 0.9x FCFS's saturated throughput, CSJF mean latency <= 0.5x FCFS's with P99 no worse.", "",
    ])


if __name__ == "__main__":
    sys.exit(main())
