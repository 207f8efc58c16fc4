"""Batched prefill: what packing several requests into one forward step buys, and the
max_batch_tokens sweep that picks the CPU default.

From the repository root, with the project's venv:

    .venv/bin/python -m perf.bench_batching                    # all three parts (~25 min on 2 quiet cores)
    .venv/bin/python -m perf.bench_batching --parts step       # in-process step timings only (~2 min)
    .venv/bin/python -m perf.bench_batching --quick            # smoke test (tiny traces; perf/out/, not the results)

Parts (float32 by default: on hosts without native bf16 matmuls, e.g. AVX2-only, bf16 measures
torch's slow bf16 matmul, not batching; --dtype bfloat16 where the CPU has AVX512-BF16/AMX):
  step     one forward step of B warm requests (170 new tokens over a 2,048-token cached profile,
           the post-recommendation shape) vs the same B requests one forward each, and B cold
           170-token requests likewise; same process, interleaved, medians.
  offline  perf/eval.py's post-recommendation and credit traces through the Engine, all requests
           at once, for each --budgets value (1 = one request per step), each run a fresh process,
           interleaved over --reps.
  load     the post-recommendation trace under Poisson load through Triton (perf/harness.py, the
           same arrival times for every budget) at --qps (default: the offline post-rec throughput
           at max_batch_tokens 1, i.e. the unbatched engine's saturated rate), one fresh server per budget.
Results: perf/results/batching/*.json and the "## Batched prefill" section of perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from perf import benchutil as bu
from perf import harness
from perf import eval as ev  # perf/eval.py: its traces, fresh-process offline runner and Triton load level

SECTION = "## Batched prefill"
BUDGETS = (1, 512, 2048, 8192)
STEP_SIZES = (1, 4, 12, 24)


def results_dir(args) -> Path:
    return (bu.PERF_DIR / "out" / "batching-quick") if args.quick else (bu.PERF_DIR / "results" / "batching")


# == step ========================================================================================
def cmd_step(args) -> dict:
    """In-process: B requests in one forward_batch vs one forward each (warm and cold)."""
    import torch

    from prefillonly import Engine, EngineConfig
    from prefillonly.worker.executor import ForwardBatch, Sequence

    torch.manual_seed(0)
    engine = Engine(EngineConfig(dtype=args.dtype, threads=args.threads, cache_budget_bytes=0))
    ex, vocab = engine.executor, engine.spec.vocab_size
    profile_len, new = (256, 40) if args.quick else (2048, 170)
    profile = ex.forward(torch.randint(100, vocab, (profile_len,)), 2048, capture=(0, profile_len)).captured
    rows = []
    for kind in ("warm", "cold"):
        for b in (STEP_SIZES[:2] if args.quick else STEP_SIZES):
            seqs = [Sequence(torch.randint(100, vocab, (new,)), prefix=profile if kind == "warm" else None) for _ in range(b)]
            singles, batched = [], []
            for _ in range(1 if args.quick else 3):  # interleaved
                t0 = time.perf_counter()
                for s in seqs:
                    ex.forward(s.token_ids, 2048, prefix=s.prefix)
                singles.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ex.forward_batch(ForwardBatch(seqs), 2048)
                batched.append(time.perf_counter() - t0)
            one, step = bu.median(singles), bu.median(batched)
            rows.append(dict(kind=kind, requests=b, new_tokens=new, cached_tokens=profile_len if kind == "warm" else 0,
                             singles_s=one, step_s=step, ratio=step / one))
            bu.log(f"step {kind} x{b}: one by one {one:.3f} s, one step {step:.3f} s ({step / one:.2f}x)")
    engine.close()
    data = dict(header(args), rows=rows)
    bu.save_json(results_dir(args) / "step.json", data)
    return data


# == offline ======================================================================================
def cmd_offline(args) -> dict:
    traces = {w: ev.ensure_trace(w, eval_args(args)) for w in ("post_rec", "credit")}
    runs = []
    for rep in range(args.reps):
        for w, (trace, path) in traces.items():
            for budget in args.budgets:
                a = eval_args(args, max_batch_tokens=budget)
                out = bu.PERF_DIR / "out" / "batching" / f"{w}_b{budget}_rep{rep}.json"
                bu.log(f"offline {w}, max_batch_tokens {budget}, rep {rep + 1}/{args.reps}")
                r = ev.run_fresh_process("_ours-offline", path, out, a, args.timeout)
                runs.append(dict(workload=w, budget=budget, rep=rep, wall_s=r["wall_s"], steps=r["steps"],
                                 requests=r["requests"], tokens_computed=r["tokens_computed"], cached_tokens=r["cached_tokens"]))
                bu.log(f"  {r['wall_s']:.1f} s wall, {r['steps']} steps for {r['requests']} requests")
    data = dict(header(args), traces={w: t.summary() for w, (t, _) in traces.items()}, runs=runs)
    bu.save_json(results_dir(args) / "offline.json", data)
    return data


# == load ===========================================================================================
def cmd_load(args) -> dict:
    trace, _ = ev.ensure_trace("post_rec", eval_args(args))
    qps, basis = args.qps, "given with --qps"
    if not qps:
        offline = bu.load_json(results_dir(args) / "offline.json")
        walls = [r["wall_s"] for r in offline.get("runs", []) if r["workload"] == "post_rec" and r["budget"] == 1]
        if not walls:
            raise SystemExit("no offline post-rec run at max_batch_tokens 1: run the offline part first or pass --qps")
        qps, basis = len(trace.requests) / bu.median(walls), "the offline post-rec throughput at max_batch_tokens 1"
    timed = harness.poisson_schedule(trace, qps, args.seed)
    levels = []
    for budget in args.budgets:
        bu.log(f"load at {qps:.3f} req/s, max_batch_tokens {budget}")
        d = ev.run_level("ours", timed, qps, eval_args(args, max_batch_tokens=budget))
        levels.append(dict(budget=budget, summary=d["summary"], arrivals_sha=d["arrivals_sha"]))
    data = dict(header(args), trace=trace.summary(), qps=qps, qps_basis=basis, levels=levels)
    bu.save_json(results_dir(args) / "load.json", data)
    return data


def eval_args(args, max_batch_tokens: int | None = None) -> argparse.Namespace:
    """The namespace perf/eval.py's helpers read."""
    return argparse.Namespace(scale="tiny" if args.quick else "cpu", seed=args.seed, threads=args.threads, dtype=args.dtype,
                              max_batch_tokens=max_batch_tokens, quick=args.quick, timeout=args.timeout)


def header(args) -> dict:
    return {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(args.threads), "dtype": args.dtype}


# == report ==========================================================================================
def render(args) -> str:
    rdir = results_dir(args)
    step, offline, load = (bu.load_json(rdir / f"{n}.json") for n in ("step", "offline", "load"))
    lines = []
    if step.get("rows"):
        lines += [f"### One step vs one forward per request (in process, {step['dtype']})", "",
                  f"`{step['command']}` — {step['date']}; {bu.machine_line(step['machine'])}.", "",
                  bu.markdown_table(["requests", "new tokens each", "cached tokens each", "one by one s", "one step s", "step / one by one"],
                                    [[f"{r['kind']} x{r['requests']}", r["new_tokens"], f"{r['cached_tokens']:,}", f"{r['singles_s']:.3f}",
                                      f"{r['step_s']:.3f}", f"{r['ratio']:.2f}"] for r in step["rows"]]), ""]
    if offline.get("runs"):
        rows = []
        for w in offline["traces"]:
            base = bu.median([r["wall_s"] for r in offline["runs"] if r["workload"] == w and r["budget"] == 1] or [0]) or None
            for budget in sorted({r["budget"] for r in offline["runs"]}):
                runs = [r for r in offline["runs"] if r["workload"] == w and r["budget"] == budget]
                wall = bu.median([r["wall_s"] for r in runs])
                rows.append([w, f"{budget:,}", len(runs), f"{wall:.2f}", ", ".join(f"{r['wall_s']:.1f}" for r in runs),
                             f"{runs[0]['requests'] / wall:.3f}", f"{bu.median([r['steps'] for r in runs]):.0f}",
                             f"{wall / base:.2f}" if base else "-"])
        lines += [f"### Offline, by max_batch_tokens ({offline['dtype']})", "",
                  f"`{offline['command']}` — {offline['date']}; {bu.machine_line(offline['machine'])}.", "",
                  *[f"- {w}: {s}" for w, s in offline["traces"].items()], "",
                  "Every request submitted at once to a fresh Engine process (default config but dtype and max_batch_tokens), "
                  "wall time to the last answer; budgets interleaved within each repetition.", "",
                  bu.markdown_table(["trace", "max_batch_tokens", "runs", "median s", "walls s", "req/s", "steps",
                                     "time / unbatched"], rows), ""]
    if load.get("levels"):
        same = len({lv["arrivals_sha"] for lv in load["levels"]}) == 1
        rows = [[f"{lv['budget']:,}", f"{lv['summary']['ok']}/{lv['summary']['requests']}", str(lv["summary"]["errors"]),
                 ev.fmt(lv["summary"]["throughput_rps"], ".3f"), ev.fmt(lv["summary"]["mean_latency_s"]),
                 ev.fmt(lv["summary"]["p50_latency_s"]),
                 ev.fmt(lv["summary"]["p99_latency_s"])] for lv in load["levels"]]
        lines += [f"### Under Poisson load, by max_batch_tokens ({load['dtype']})", "",
                  f"`{load['command']}` — {load['date']}; {bu.machine_line(load['machine'])}.", "",
                  f"{load['trace']}; offered {load['qps']:.3f} req/s ({load['qps_basis']}); "
                  f"{'the same arrival times for every budget' if same else 'WARNING: arrival digests differ'}. "
                  "tritonserver with `model_repository/prefillonly` (dtype and max_batch_tokens set), gRPC streaming, "
                  "a fresh server per budget (perf/eval.py's load level).", "",
                  bu.markdown_table(["max_batch_tokens", "answered", "errors", "throughput req/s", "mean latency s", "P50 s", "P99 latency s"], rows), ""]
    body = "\n".join(lines) if lines else "No results yet: run `python -m perf.bench_batching`."
    target = (bu.PERF_DIR / "out" / "batching-quick" / "RESULTS.md") if args.quick else (bu.PERF_DIR / "RESULTS.md")
    bu.replace_section(target, SECTION, body)
    bu.log(f"wrote the {SECTION!r} section of {target}")
    return body


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="step,offline,load", help="comma list of step, offline, load (default all); the report always follows")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help=f"max_batch_tokens values (default {','.join(map(str, BUDGETS))})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--qps", type=float, help="offered load of the load part (default: the unbatched offline post-rec rate)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="tiny traces, 1 rep; results under perf/out/batching-quick/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    if 1 not in args.budgets:
        args.budgets.insert(0, 1)  # the unbatched engine is the baseline of every ratio
    if args.quick:
        args.reps = 1
    parts = {"step": cmd_step, "offline": cmd_offline, "load": cmd_load}
    for name in [x for x in args.parts.split(",") if x]:
        parts[name](args)
    print(SECTION + "\n\n" + render(args))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
