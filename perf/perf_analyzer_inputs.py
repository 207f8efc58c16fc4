"""perf_analyzer `--input-data` JSON for the two workloads (docs/design.md §8), from the seeded
traces of perf/workloads.py: every trace request becomes one data entry, replayed with the
trace's exact token ids.

    .venv/bin/python -m perf.perf_analyzer_inputs post-rec --scale cpu     # -> perf/out/perf_analyzer/post_rec_cpu_s0.json
    .venv/bin/python -m perf.perf_analyzer_inputs credit --scale tiny --out credit.json

One entry per request, in trace order (user-major: a user's posts follow each other, as in the
trace) or, with --arrival-qps, in Poisson arrival order at that rate (users interleaved):

    {"data": [{"input_ids":         {"content": [int, ...], "shape": [n]},
               "allowed_token_ids": {"content": [9230, 2838], "shape": [2]},
               "cache_prefix_len":  {"content": [p], "shape": [1]},
               "user":              {"content": ["u0"], "shape": [1]}}, ...]}

perf_analyzer's format: each input is {"content": flat list, "shape": dims}; "shape" is required
for variable-size (-1) inputs and is the tensor's full shape (the models have max_batch_size 0).
BYTES contents are JSON strings. Inputs the models mark optional and that are absent from the
file are not sent. Both models (`prefillonly`, decoupled: `--streaming`; `prefillonly_sync`,
the forwarder) take the same inputs, so one file serves both.

`user` is the engine's prefix-cache namespace. perf_analyzer loops over its data: on the second
pass every profile would already be cached, which the trace never does (each user's first post
is cold). `repeats` R writes the trace R times with the user namespaced per pass ("p1/u0"): the
token ids repeat, the cache behaviour of the trace (cold first post, warm rest) repeats too;
`namespace` prefixes every user (e.g. one per perf_analyzer run, so runs never share a cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from perf import workloads as wl

OUT_DIR = wl.PERF_DIR / "out" / "perf_analyzer"
MODELS = ("prefillonly", "prefillonly_sync")  # same inputs: one file for both


def _tensor(values: list, shape: list[int] | None = None) -> dict:
    return {"content": list(values), "shape": list(shape) if shape is not None else [len(values)]}


def user_name(user: int, namespace: str = "", repeat: int = 0) -> str:
    return f"{namespace}{f'p{repeat}/' if repeat else ''}u{user}"


def trace_entries(trace: wl.Trace, *, repeats: int = 1, namespace: str = "", with_user: bool = True,
                  with_cache_prefix_len: bool = True) -> list[dict]:
    """One perf_analyzer data entry per request (in arrival order when the trace has arrivals),
    the whole list `repeats` times (pass r > 0 with its own user namespaces)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    allowed = [int(t) for t in trace.allowed_token_ids]
    entries = []
    for rep in range(repeats):
        for r in wl.arrival_order(trace):
            entry = {"input_ids": _tensor([int(t) for t in r.prompt_token_ids]),
                     "allowed_token_ids": _tensor(allowed)}
            if with_cache_prefix_len:
                entry["cache_prefix_len"] = _tensor([int(r.cache_prefix_len)], [1])
            if with_user:
                entry["user"] = _tensor([user_name(r.user, namespace, rep)], [1])
            entries.append(entry)
    return entries


def input_data(trace: wl.Trace, **kwargs) -> dict:
    """The whole --input-data document for `trace` (kwargs: see trace_entries)."""
    return {"data": trace_entries(trace, **kwargs)}


def build_trace(workload: str, scale="cpu", seed: int = 0, arrival_qps: float | None = None) -> wl.Trace:
    trace = wl.generate(workload, scale, seed)
    if arrival_qps is not None:
        trace = wl.with_poisson_arrivals(trace, wl.user_rate_for_qps(trace, arrival_qps))
    return trace


def write_input_data(path, trace: wl.Trace, **kwargs) -> Path:
    """Write the --input-data file for `trace`; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(input_data(trace, **kwargs), f, separators=(",", ":"))
    return path


def default_path(workload: str, scale: str, seed: int, repeats: int = 1, arrival_qps: float | None = None) -> Path:
    name = f"{workload}_{scale}_s{seed}" + (f"_x{repeats}" if repeats != 1 else "") + (
        f"_q{arrival_qps:g}" if arrival_qps is not None else "")
    return OUT_DIR / f"{name}.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Write perf_analyzer --input-data JSON for a seeded trace "
                                            "(same file for prefillonly and prefillonly_sync).")
    p.add_argument("workload", choices=["post-rec", "credit"])
    p.add_argument("--scale", default="cpu", choices=["tiny", "cpu", "paper"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="write the trace this many times, users namespaced per pass")
    p.add_argument("--namespace", default="", help="prefix of every user (prefix-cache namespace)")
    p.add_argument("--arrival-qps", type=float, default=None,
                   help="order requests by Poisson arrivals at this many req/s (default: trace order, user-major)")
    p.add_argument("--no-user", action="store_true", help="leave out the `user` input")
    p.add_argument("--out", type=Path, default=None, help="default: perf/out/perf_analyzer/<workload>_<scale>_s<seed>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    workload = a.workload.replace("-", "_")
    trace = build_trace(workload, a.scale, a.seed, a.arrival_qps)
    out = a.out or default_path(workload, a.scale, a.seed, a.repeats, a.arrival_qps)
    write_input_data(out, trace, repeats=a.repeats, namespace=a.namespace, with_user=not a.no_user)
    print(trace.summary())
    print(f"{len(trace.requests) * a.repeats} entries written to {out} ({out.stat().st_size / 2**20:.1f} MiB); "
          f"use it with `--input-data {out}` against {' or '.join(MODELS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
