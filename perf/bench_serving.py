"""Serving benchmark: the real tritonserver on model_repository/ (default model, bf16)
driven by perf_analyzer and by tritonclient, one command:

    .venv/bin/python -m perf.bench_serving            # full: cpu-scale post-rec trace, ~10-12 min
    .venv/bin/python -m perf.bench_serving --quick    # shorter windows, fewer levels, ~3 min
    .venv/bin/python -m perf.bench_serving --quick --scale tiny   # smoke test, ~2 min

Steps, in this order (low-load measurements first, on a fresh server):
1. Serving overhead at low load: N short prompts (a different one each, cache_prefix_len 0),
   each sent in turn, one call at a time, over gRPC streaming (`prefillonly`), HTTP /generate,
   gRPC unary through the forwarder (`prefillonly_sync`), and to an in-process Engine built from
   the same config.pbtxt parameters (same dtype, threads, cache; EngineConfig.from_strings as
   model.py does) while the server idles. overhead = client end-to-end - in-process engine time
   for the same prompt (median of the per-prompt differences; also the difference of medians).
   Calls go in a shuffled order with short pauses, so neither engine runs while the other's
   OpenMP threads still spin. Triton's per-model statistics are read too, but for the decoupled
   model compute_infer only covers execute(), which hands the request to the engine's queue and
   returns, so it does not hold the engine time; for the forwarder compute_infer is the whole
   forwarded call. A rate sweep's perf_analyzer runs with --max-threads 64: it keeps one request
   in flight per thread, and its default 4 capped the load below the asked rate.
2. Waiting requests through the forwarder: K concurrent plain gRPC infers (long prompt, each
   different) at `prefillonly_sync`; the metrics endpoint is scraped every 50 ms meanwhile for
   the engine's `prefillonly_waiting_requests` gauge and Triton's pending-request counts.
3. perf_analyzer, gRPC streaming on `prefillonly`, scaled post-recommendation trace: concurrency
   sweep (1, 2, 4, 8), then a Poisson request-rate sweep at multiples of the saturated
   throughput (the best of the concurrency sweep); then a short concurrency run on
   `prefillonly_sync` over plain gRPC and HTTP. One perf_analyzer run per level, each with its
   own input file (perf/perf_analyzer_inputs.py): the trace's token ids, user-major, repeated
   with per-level, per-pass user namespaces, so every level sees the trace's cache behaviour
   (each user's first post cold, the rest warm) instead of a cache warmed by earlier levels.
   Errors = perf_analyzer's exit status and the requests Triton counted as failed.

Writes perf_analyzer's CSVs and serving.json under perf/results/serving/ and the
"## Serving" section of perf/RESULTS.md (with --quick or another scale: under
perf/out/<scale>[_quick]/ instead).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from clients.transport import MODEL, SYNC_MODEL, GrpcStream, http_generate, infer_inputs
from perf import benchutil as bu
from perf import perf_analyzer_inputs as pai
from perf import workloads as wl
from prefillonly.serving.host import prometheus
from prefillonly.serving.host.model_settings import engine_settings
from prefillonly.serving.host.server_tree import TRITON_SERVER_VERSION

SECTION = "## Serving"
REPO = bu.REPO_ROOT / "model_repository"
OVERHEAD_TARGET_MS = 5.0
RATE_THREADS = 64  # perf_analyzer --max-threads in request-rate mode (bounds the requests in flight)


# -- the server's metrics and statistics -------------------------------------------------------------
def scrape(metrics_url: str) -> list[prometheus.Sample]:
    """Every sample of the server's metrics endpoint (retried while its port opens, as the tests do)."""
    return prometheus.scrape(metrics_url, timeout_s=30, attempts=50)


def model_stats(http_url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=30) as r:
        return json.loads(r.read())["model_stats"][0]["inference_stats"]


def stats_delta_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per request of each Triton statistic between two readings."""
    out = {}
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        n = after[key]["count"] - before[key]["count"]
        out[key] = (after[key]["ns"] - before[key]["ns"]) / n / 1e6 if n else float("nan")
    out["count"] = after["success"]["count"] - before["success"]["count"]
    return out


def outcome_counts(values: list[prometheus.Sample], model: str) -> dict[str, float]:
    return {"success": prometheus.total(values, "nv_inference_request_success", model=model),
            "failure": prometheus.total(values, "nv_inference_request_failure", model=model),
            "computed": prometheus.total(values, "prefillonly_prompt_tokens_total", source="computed"),
            "cached": prometheus.total(values, "prefillonly_prompt_tokens_total", source="cache")}


def wait_idle(server, model: str = MODEL, timeout: float = 600.0) -> None:
    """Until the engine has nothing waiting and Triton's counts for `model` stop moving (a run
    that ended over saturation leaves a backlog that must not leak into the next level)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        values = scrape(server.metrics_url)
        counts = outcome_counts(values, model)
        now = (prometheus.total(values, "prefillonly_waiting_requests"), counts["success"], counts["failure"])
        if last is not None and now == last and now[0] == 0:
            return
        last = now
        time.sleep(1.0)
    bu.log(f"warning: server not idle after {timeout:.0f} s")


# -- 1. serving overhead at low load -------------------------------------------------------------
def short_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(wl.LOW_TOKEN_ID, wl.SMOLLM2_VOCAB_SIZE, size=length).tolist() + wl.POST_REC_SUFFIX_IDS
            for _ in range(n)]


def request(ids: list[int], user: str | None = None) -> dict:
    """The scoring request of a prompt's token ids: the trace's two answers, nothing kept in the cache."""
    return {"input_ids": ids, "allowed_token_ids": wl.ALLOWED_TOKEN_IDS, "cache_prefix_len": 0, **({"user": user} if user else {})}


def answered(call, ids: list[int]) -> float:
    """Seconds until `call(request)` has its final answer (a server's refusal raises)."""
    t0 = time.perf_counter()
    error = call(request(ids))
    if error:
        raise RuntimeError(f"request failed: {error}")
    return time.perf_counter() - t0


def measure_overhead(server, n: int, length: int, seed: int, gap_s: float = 0.25) -> dict:
    import tritonclient.grpc as grpcclient

    from prefillonly import Engine, EngineConfig

    prompts = short_prompts(n + 3, length, seed)  # 3 warm-up prompts first
    warm, prompts = prompts[:3], prompts[3:]
    stream = GrpcStream(server.grpc_url)
    unary = grpcclient.InferenceServerClient(server.grpc_url)
    settings = engine_settings(REPO / MODEL)
    bu.log(f"in-process Engine with the server's settings {settings}")
    engine = Engine(EngineConfig.from_strings(settings))

    def grpc_stream(r):
        return stream.call(r, 300)[1]

    def http(r):
        status, reply = http_generate(server.http_url, r, 300)
        return None if status == 200 else reply

    def grpc_unary(r):
        unary.infer(SYNC_MODEL, infer_inputs(grpcclient, r))

    def in_process(r):
        engine.score(r["input_ids"], r["allowed_token_ids"], cache_prefix_len=0)

    calls = {"grpc_stream": grpc_stream, "http_generate": http, "grpc_unary_forwarder": grpc_unary, "engine": in_process}
    times: dict[str, list[float]] = {k: [] for k in calls}
    try:
        for call in calls.values():
            for ids in warm:
                answered(call, ids)
        stats0 = {m: model_stats(server.http_url, m) for m in (MODEL, SYNC_MODEL)}
        # interleaved, prompt by prompt, one call at a time in a shuffled order, with a pause
        # before each: the two engines never run together, neither runs while the other's
        # OpenMP threads still spin after a forward, and load from elsewhere on the host hits
        # every style alike
        order = random.Random(seed)
        for ids in prompts:
            for style in order.sample(list(calls), len(calls)):
                time.sleep(gap_s)
                times[style].append(answered(calls[style], ids))
        stats1 = {m: model_stats(server.http_url, m) for m in (MODEL, SYNC_MODEL)}
        threads = engine.config.threads
    finally:
        engine.close()
        stream.close()
        unary.close()
    engine_s = times.pop("engine")
    engine_ms = 1e3 * statistics.median(engine_s)
    rows = []
    for style, ts in times.items():
        diffs = [1e3 * (a - b) for a, b in zip(ts, engine_s)]
        rows.append({"style": style, "e2e_median_ms": 1e3 * statistics.median(ts), "e2e_p90_ms": 1e3 * float(np.percentile(ts, 90)),
                     "engine_median_ms": engine_ms, "overhead_ms": 1e3 * statistics.median(ts) - engine_ms,
                     "overhead_paired_median_ms": statistics.median(diffs),
                     "overhead_paired_iqr_ms": [float(np.percentile(diffs, 25)), float(np.percentile(diffs, 75))]})
    return {"requests": n, "gap_s": gap_s, "prompt_tokens": length + len(wl.POST_REC_SUFFIX_IDS), "engine_threads": threads,
            "settings": settings, "rows": rows, "engine_s": engine_s, "times_s": times,
            "triton_stats_stream_ms": stats_delta_ms(stats0[MODEL], stats1[MODEL]),
            "triton_stats_forwarder_ms": stats_delta_ms(stats0[SYNC_MODEL], stats1[SYNC_MODEL])}


# -- 2. waiting requests through the forwarder ------------------------------------------------------
def forwarder_waiting(server, k: int, length: int, seed: int) -> dict:
    import tritonclient.grpc as grpcclient

    prompts = short_prompts(k, length, seed)
    barrier = threading.Barrier(k + 1)
    errors: list[str] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        inputs = infer_inputs(grpcclient, request(prompts[i], user=f"fw{k}-{i}"))
        barrier.wait()
        t0 = time.perf_counter()
        try:
            client.infer(SYNC_MODEL, inputs, client_timeout=600)
            with lock:
                latencies.append(time.perf_counter() - t0)
        except Exception as e:  # counted, reported
            with lock:
                errors.append(str(e)[:200])
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    samples = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                v = scrape(server.metrics_url)
            except OSError:
                continue
            samples.append({"waiting": prometheus.total(v, "prefillonly_waiting_requests"),
                            "pending_sync": prometheus.total(v, "nv_inference_pending_request_count", model=SYNC_MODEL),
                            "pending_engine_model": prometheus.total(v, "nv_inference_pending_request_count", model=MODEL)})
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    barrier.wait()
    watcher.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    peak = lambda key: max((s[key] for s in samples), default=0)  # noqa: E731
    return {"k": k, "prompt_tokens": length + len(wl.POST_REC_SUFFIX_IDS), "answered": len(latencies), "failed": len(errors),
            "errors": errors[:5], "wall_s": wall, "max_latency_s": max(latencies, default=float("nan")),
            "max_waiting": peak("waiting"), "max_pending_sync": peak("pending_sync"),
            "max_pending_engine_model": peak("pending_engine_model"), "samples": len(samples)}


# -- 3. perf_analyzer sweeps ---------------------------------------------------------------------------
def pa_level(server, out_dir: Path, trace: wl.Trace, *, name: str, level: str, model: str, protocol: str, mode: str,
             value: float, window_ms: int, repeats: int) -> dict:
    """One perf_analyzer run at one load level (its own input file and user namespaces)."""
    from perf.perf_analyzer import read_perf_analyzer_csv, run_perf_analyzer

    tag = f"{name}_{level}"
    inputs = pai.write_input_data(bu.PERF_DIR / "out" / "perf_analyzer" / f"bench_serving_{tag}.json", trace,
                                  repeats=repeats, namespace=f"{tag}/")
    csv_path = out_dir / f"{tag}.csv"
    url = server.grpc_url if protocol.startswith("grpc") else server.http_url.removeprefix("http://")
    args = ["-m", model, "-u", url, "-i", "grpc" if protocol.startswith("grpc") else "http", "--input-data", inputs,
            "--measurement-mode", "time_windows", "-p", window_ms, "-s", "999", "--max-trials", "3", "-f", csv_path]
    if protocol == "grpc-stream":
        args.append("--streaming")
    if mode == "concurrency":
        args += ["--concurrency-range", int(value)]
    else:
        # one request in flight per perf_analyzer thread in rate mode: with the default 4 threads
        # and second-long latencies it sent well below the asked rate (measured: 2.1 of 3 req/s,
        # p50 2.1 s vs 2.8 req/s, p50 0.45 s with 16 threads)
        args += ["--request-rate-range", f"{value:.3f}", "--request-distribution", "poisson", "--max-threads", RATE_THREADS]
    before = outcome_counts(scrape(server.metrics_url), MODEL)
    before_model = outcome_counts(scrape(server.metrics_url), model)
    t0 = time.perf_counter()
    pa = run_perf_analyzer(args, timeout=30 * window_ms / 1000 + 300)
    wait_idle(server)
    elapsed = time.perf_counter() - t0
    after_values = scrape(server.metrics_url)
    after, after_model = outcome_counts(after_values, MODEL), outcome_counts(after_values, model)
    inputs.unlink(missing_ok=True)
    (out_dir / f"{tag}.log").write_text(pa.stdout[-20000:] + ("\n--- stderr ---\n" + pa.stderr[-5000:] if pa.stderr.strip() else ""))
    rows = read_perf_analyzer_csv(csv_path) if csv_path.is_file() else []  # numbers even when some requests failed
    computed, cached = after["computed"] - before["computed"], after["cached"] - before["cached"]
    row = {"name": name, "model": model, "protocol": protocol, "mode": mode, "value": value, "rc": pa.returncode,
           "csv": csv_path.name, "elapsed_s": elapsed,
           "failed": after_model["failure"] - before_model["failure"], "served": after_model["success"] - before_model["success"],
           "hit_rate": cached / (computed + cached) if computed + cached else float("nan")}
    if rows:
        r = rows[0]
        latency_cols = ["Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                        "Server Compute Infer", "Server Compute Output", "Client Recv"]
        row.update({"throughput_rps": float(r["Inferences/Second"]), "p50_ms": float(r["p50 latency"]) / 1e3,
                    "p90_ms": float(r["p90 latency"]) / 1e3, "p99_ms": float(r["p99 latency"]) / 1e3,
                    "avg_ms": sum(float(r.get(c) or 0) for c in latency_cols) / 1e3})
    else:
        row["pa_error"] = (pa.stdout[-1500:] + pa.stderr[-1500:]).strip()
    return row


def merge_csvs(out_dir: Path, rows: list[dict], name: str) -> None:
    """One CSV per sweep (perf_analyzer's columns, one row per level) from the per-level CSVs."""
    lines: list[str] = []
    for r in rows:
        path = out_dir / r["csv"]
        if r["name"] != name or not path.is_file():
            continue
        text = path.read_text().strip().splitlines()
        if not lines:
            lines.append(text[0])
        lines += text[1:]
    if lines:
        (out_dir / f"{name}.csv").write_text("\n".join(lines) + "\n")
        for r in rows:
            if r["name"] == name:
                (out_dir / r["csv"]).unlink(missing_ok=True)


def log_row(r: dict) -> None:
    level = f"concurrency {r['value']:g}" if r["mode"] == "concurrency" else f"{r['value']:.2f} req/s offered"
    if "throughput_rps" in r:
        bu.log(f"  {r['model']} {r['protocol']} {level}: {r['throughput_rps']:.2f} req/s, p50 {r['p50_ms']:.0f} ms, "
               f"p99 {r['p99_ms']:.0f} ms, failed {r['failed']:.0f}, rc {r['rc']}, hit rate {r['hit_rate']:.0%} "
               f"({r['elapsed_s']:.0f} s)")
    else:
        bu.log(f"  {r['model']} {r['protocol']} {level}: perf_analyzer rc {r['rc']}: {r.get('pa_error', '')[-400:]}")


# -- report ------------------------------------------------------------------------------------------------
def render(data: dict) -> str:
    o = data.get("overhead")
    lines = [f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Machine: {bu.machine_line(data['machine'])}  ",
             f"Server: tritonserver {TRITON_SERVER_VERSION} (nvidia-pytriton wheel) on model_repository/, default model, engine settings "
             f"from config.pbtxt ({', '.join(f'{k}={v}' for k, v in data['settings'].items() if v)}); perf_analyzer {TRITON_SERVER_VERSION} "
             f"(tritonclient wheel).  ", f"Trace: {data['trace_summary']}", ""]
    if data.get("sweeps"):
        table = []
        for r in data["sweeps"]:
            level = (f"c={r['value']:g}" if r["mode"] == "concurrency"
                     else f"{r.get('level', 0):g}x = {r['value']:.2f} req/s offered")
            if "throughput_rps" in r:
                table.append([r["model"], r["protocol"], level, f"{r['throughput_rps']:.2f}", f"{r['p50_ms']:.0f}",
                              f"{r['p99_ms']:.0f}", f"{r['avg_ms']:.0f}", f"{r['failed']:.0f}" + ("" if r["rc"] == 0 else f" (rc {r['rc']})"),
                              f"{r['hit_rate']:.0%}"])
            else:
                table.append([r["model"], r["protocol"], level, "-", "-", "-", "-", f"rc {r['rc']}", "-"])
        sat = data.get("saturated_rps")
        lines += [
            "### perf_analyzer sweeps",
            "",
            f"perf_analyzer `--measurement-mode time_windows -p {data['window_ms']}` (result = last 3 windows), one run per "
            f"level, each replaying the trace's token ids user-major with its own user namespaces (`user` input = prefix-cache "
            f"namespace, trace repeated x{data['repeats']} with a namespace per pass), so every level sees the trace's cache "
            f"behaviour: each user's first post computes its profile, the rest hit it. Request-rate levels: Poisson "
            f"arrivals (`--max-threads {RATE_THREADS}`: perf_analyzer keeps one request in flight per thread) at "
            f"{', '.join(f'{x:g}' for x in data['rate_levels'])} x the saturated throughput "
            + (f"({sat:.2f} req/s, the best of the concurrency sweep). " if sat else ". ")
            + "Latencies are perf_analyzer's client-side (send to final response); failed = requests Triton counted as "
            "failed for the model (and perf_analyzer's exit status when non-zero); hit rate = prompt tokens served from "
            "the prefix cache over all prompt tokens of the level (engine metrics).",
            "",
            bu.markdown_table(["model", "call", "load", "served req/s", "p50 ms", "p99 ms", "mean ms", "failed", "prefix hit rate"],
                              table),
            "",
            f"CSVs (perf_analyzer's columns, latencies in µs) and perf_analyzer's output per level: "
            f"`{data.get('results_dir', 'perf/results/serving')}/`.",
            "",
        ]
    if o:
        rows = [[r["style"], f"{r['e2e_median_ms']:.1f}", f"{r['e2e_p90_ms']:.1f}", f"{r['engine_median_ms']:.1f}",
                 f"{r['overhead_ms']:.1f}", f"{r['overhead_paired_median_ms']:.1f}",
                 "{:.1f} .. {:.1f}".format(*r.get("overhead_paired_iqr_ms", [float("nan")] * 2))] for r in o["rows"]]
        ts, tf = o["triton_stats_stream_ms"], o["triton_stats_forwarder_ms"]
        best = next(r["overhead_paired_median_ms"] for r in o["rows"] if r["style"] == "grpc_stream")
        lines += [
            "### Serving overhead at low load",
            "",
            f"{o['requests']} prompts, each a different {o['prompt_tokens']}-token prompt (random ids + the post-rec "
            f"question, cache_prefix_len 0, so nothing is cached), each sent in turn, one call at a time in a shuffled "
            f"order with {o.get('gap_s', 0):g} s pauses (so no engine runs while the other's OpenMP threads still spin), "
            f"through every call style and to an in-process `Engine` built from the same config.pbtxt parameters (EngineConfig.from_strings, "
            f"as model.py does; {o['engine_threads'] or 'default'} torch threads, like the server's) while the server idles. "
            f"Overhead = client end-to-end time - in-process engine time for the same prompt, median over the prompts "
            f"(\"paired\"; also the difference of the medians). Triton's own statistics cannot give the engine time for the decoupled model: its execute() "
            f"returns once the request is queued, so compute_infer there is {ts['compute_infer']:.2f} ms/request (queue "
            f"{ts['queue']:.2f} ms); for the forwarder compute_infer ({tf['compute_infer']:.1f} ms) is the whole forwarded "
            f"call.",
            "",
            bu.markdown_table(["call", "e2e p50 ms", "e2e p90 ms", "engine p50 ms", "p50 difference ms", "paired overhead ms",
                               "paired p25 .. p75 ms"], rows),
            "",
            f"Target (docs/design.md §9): overhead <= {OVERHEAD_TARGET_MS:g} ms per request at low load over gRPC streaming: "
            f"{'met' if best <= OVERHEAD_TARGET_MS else 'missed'} ({best:.1f} ms, paired"
            + ("; below zero: the overhead is under the noise of the engine time on this shared host" if best < 0 else "")
            + ").",
            "",
        ]
    if data.get("forwarder"):
        rows = [[f["k"], f["prompt_tokens"], f"{f['answered']}", f"{f['failed']}", f"{f['max_waiting']:.0f}",
                 f"{f['max_waiting'] + 1:.0f}" if f["max_waiting"] else "-",
                 f"{f['max_pending_sync']:.0f}", f"{f['wall_s']:.1f}", f"{f['max_latency_s']:.1f}"] for f in data["forwarder"]]
        held = max((f["max_waiting"] + 1 for f in data["forwarder"] if f["max_waiting"]), default=0)
        failed = sum(f["failed"] for f in data["forwarder"])
        lines += [
            "### Waiting requests through the non-decoupled forwarder",
            "",
            f"K concurrent plain gRPC infers at `{SYNC_MODEL}` (config: {data.get('sync_instances', '?')} instances), each a "
            "different long prompt (cache_prefix_len 0); the metrics endpoint scraped every 50 ms while they ran. "
            "`prefillonly_waiting_requests` counts the engine's queue without the request it is running (the gauge is "
            "refreshed by the model when it answers or rejects a request); Triton's `nv_inference_pending_request_count` "
            f"for `{SYNC_MODEL}` counts requests Triton holds because every forwarder instance is busy.",
            "",
            bu.markdown_table(["K", "prompt tokens", "answered", "failed", "max engine waiting", "in engine at once (+ running)",
                               "max pending in Triton (forwarder)", "wall s", "slowest s"], rows),
            "",
            f"The forwarder kept up to {held:.0f} requests in the engine at once (its instance count bounds it: each instance "
            f"blocks on the request it forwards); requests beyond that waited in Triton's queue for a free instance. "
            f"{failed} of {sum(f['k'] for f in data['forwarder'])} failed. The decoupled model itself has no such bound "
            f"(execute() returns at once; the engine's max_waiting refuses the excess as overloaded).",
            "",
        ]
    return "\n".join(lines)


def sync_instances() -> int | None:
    m = re.search(r"instance_group\s*\[\s*\{[^}]*count:\s*(\d+)", (REPO / SYNC_MODEL / "config.pbtxt").read_text())
    return int(m.group(1)) if m else None


# -- main --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 s windows, fewer levels, fewer requests (~3 min at cpu scale)")
    p.add_argument("--scale", default="cpu", choices=sorted(wl.POST_REC_SCALES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-ms", type=int, default=None, help="perf_analyzer window (default 10000, quick 5000)")
    p.add_argument("--concurrency", default=None, help="default 1,2,4,8 (quick 1,4)")
    p.add_argument("--rate-levels", default=None, help="x saturated throughput (default 0.5,0.8,1.0,1.2; quick 0.5,1.0)")
    p.add_argument("--sync-concurrency", default=None, help="forwarder runs, gRPC and HTTP (default 1,4; quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="trace passes per input file (default 8, quick 3)")
    p.add_argument("--overhead-requests", type=int, default=None, help="default 50 (quick 15)")
    p.add_argument("--overhead-prompt", type=int, default=64, help="random tokens of the overhead prompts (+ question)")
    p.add_argument("--forwarder-k", default=None, help="default 4,8,16,32 (quick 4,16)")
    p.add_argument("--forwarder-prompt", type=int, default=None, help="default 2000 tokens (quick 1000)")
    p.add_argument("--skip", default="", help="comma list of overhead, forwarder, sweeps (all perf_analyzer runs), rate, sync")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    q = a.quick
    window_ms = a.window_ms or (5000 if q else 10000)
    concurrency = [int(x) for x in (a.concurrency or ("1,4" if q else "1,2,4,8")).split(",") if x]
    rate_levels = [float(x) for x in (a.rate_levels or ("0.5,1.0" if q else "0.5,0.8,1.0,1.2")).split(",") if x]
    sync_conc = [int(x) for x in (a.sync_concurrency or ("2" if q else "1,4")).split(",") if x]
    repeats = a.repeats or (3 if q else 8)
    n_overhead = a.overhead_requests or (15 if q else 50)
    forwarder_k = [int(x) for x in (a.forwarder_k or ("4,16" if q else "4,8,16,32")).split(",") if x]
    forwarder_prompt = a.forwarder_prompt or (1000 if q else 2000)
    if a.scale == "tiny":
        forwarder_prompt = min(forwarder_prompt, 300)
    skip = set(filter(None, a.skip.split(",")))
    # a SIGTERM (e.g. `timeout`) unwinds through running_server's finally, which stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from perf.perf_analyzer import perf_analyzer_path
    from prefillonly.serving.host.triton_server import running_server

    out_root = bu.PERF_DIR if a.scale == "cpu" and not q else bu.PERF_DIR / "out" / (a.scale + ("_quick" if q else ""))
    out_dir = out_root / "results" / "serving"
    if "sweeps" not in skip and out_dir.is_dir():
        for old in [*out_dir.glob("*.csv"), *out_dir.glob("*.log")]:
            old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = wl.generate("post_rec", a.scale, a.seed)
    bu.log(trace.summary())
    bu.log(f"perf_analyzer: {perf_analyzer_path()}")
    settings = engine_settings(REPO / MODEL)
    data = {"command": bu.command_line(), "date": bu.now_iso(), "quick": q, "trace_summary": trace.summary(),
            "settings": settings, "window_ms": window_ms, "repeats": repeats, "rate_levels": rate_levels,
            "sync_instances": sync_instances(), "results_dir": str(out_dir.relative_to(bu.REPO_ROOT))}
    threads = int(settings["threads"]) if settings.get("threads", "").isdigit() else None
    import torch

    data["machine"] = bu.machine_info(threads or torch.get_num_threads())

    server_log = bu.PERF_DIR / "out" / "serving" / "tritonserver.log"
    server_log.parent.mkdir(parents=True, exist_ok=True)
    server_log.write_text("")
    t_start = time.perf_counter()
    bu.log(f"starting tritonserver on {REPO} (log: {server_log})")
    with running_server(REPO, ready_timeout=600, stop_timeout=60, log_path=server_log) as server:
        bu.log(f"ready in {time.perf_counter() - t_start:.0f} s: http {server.http_url}, grpc {server.grpc_url}")

        if "overhead" not in skip:
            bu.log(f"[1/3] serving overhead: {n_overhead} sequential requests per call style, then in-process")
            data["overhead"] = o = measure_overhead(server, n_overhead, a.overhead_prompt, a.seed)
            for r in o["rows"]:
                bu.log(f"  {r['style']}: e2e p50 {r['e2e_median_ms']:.1f} ms, engine p50 {r['engine_median_ms']:.1f} ms, "
                       f"overhead {r['overhead_ms']:.1f} ms (paired {r['overhead_paired_median_ms']:.1f} ms)")
            bu.log(f"  Triton stats, decoupled model: {o['triton_stats_stream_ms']}; forwarder: {o['triton_stats_forwarder_ms']}")

        if "forwarder" not in skip:
            bu.log(f"[2/3] forwarder: K concurrent plain infers at {SYNC_MODEL}, {forwarder_prompt}-token prompts")
            data["forwarder"] = []
            for k in forwarder_k:
                f = forwarder_waiting(server, k, forwarder_prompt, a.seed + k)
                data["forwarder"].append(f)
                bu.log(f"  K={k}: {f['answered']} answered, {f['failed']} failed, max engine waiting {f['max_waiting']:.0f}, "
                       f"max pending in Triton for {SYNC_MODEL} {f['max_pending_sync']:.0f}, {f['wall_s']:.1f} s")
                wait_idle(server)

        if "sweeps" not in skip:
            sweeps = data["sweeps"] = []
            common = dict(window_ms=window_ms, repeats=repeats)
            bu.log(f"[3/3] perf_analyzer concurrency sweep {concurrency}, gRPC streaming, {window_ms} ms windows")
            for c in concurrency:
                sweeps.append(pa_level(server, out_dir, trace, name="concurrency_grpc-stream", level=f"c{c}", model=MODEL,
                                       protocol="grpc-stream", mode="concurrency", value=c, **common))
                log_row(sweeps[-1])
            sat = max((r.get("throughput_rps", 0) for r in sweeps), default=0)
            data["saturated_rps"] = sat or None
            if sat and "rate" not in skip:
                bu.log(f"perf_analyzer request-rate sweep at {rate_levels} x {sat:.2f} req/s (Poisson)")
                for level in rate_levels:
                    sweeps.append(pa_level(server, out_dir, trace, name="rate_grpc-stream", level=f"{level:g}x", model=MODEL,
                                           protocol="grpc-stream",
                                           mode="rate", value=level * sat, **common))
                    sweeps[-1]["level"] = level
                    log_row(sweeps[-1])
            else:
                bu.log("no throughput from the concurrency sweep: request-rate sweep skipped")
            if "sync" not in skip:
                bu.log(f"perf_analyzer on {SYNC_MODEL}: concurrency {sync_conc} over gRPC and HTTP")
            for protocol in (("grpc", "http") if "sync" not in skip else ()):
                for c in sync_conc:
                    sweeps.append(pa_level(server, out_dir, trace, name=f"sync_{protocol}", level=f"c{c}", model=SYNC_MODEL,
                                           protocol=protocol,
                                           mode="concurrency", value=c, **common))
                    log_row(sweeps[-1])
            for name in ("concurrency_grpc-stream", "rate_grpc-stream", "sync_grpc", "sync_http"):
                merge_csvs(out_dir, sweeps, name)
    data["wall_s"] = time.perf_counter() - t_start
    bu.save_json(out_dir / "serving.json", data)
    bu.replace_section(out_root / "RESULTS.md", SECTION, render(data))
    bu.log(f"done in {data['wall_s']:.0f} s; wrote {out_dir} and {out_root / 'RESULTS.md'}")
    failed = sum(r["failed"] for r in data.get("sweeps", [])) + sum(r["rc"] != 0 for r in data.get("sweeps", []))
    failed += sum(f["failed"] for f in data.get("forwarder", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
