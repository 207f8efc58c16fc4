"""Fleet benchmark: 3 real tritonserver replicas behind a real Envoy on this host,
the post-recommendation trace from many users, one command:

    .venv/bin/python -m perf.bench_fleet            # ~6-8 min on 2 cores (skewed, with the picker: ~35 min)
    .venv/bin/python -m perf.bench_fleet --quick    # fewer users, a smoke run (no RESULTS.md)

Steps, all on the same 3 replicas (the default model, float32, one thread each, a prefix
cache large enough for every profile):
1. Envoy's own cost at low load, paired and in alternating order: Triton's readiness GET (no
   engine work: the proxy's own cost) and short scoring requests, each straight to a replica
   and through Envoy; overhead = the median of the paired differences.
2. The fleet's saturated rate: the whole trace offered at once through Envoy (affinity),
   throughput = requests / makespan.
3. Open-loop Poisson load at 0.8x that rate, the same arrivals for each routing policy in turn
   (Envoy restarted with that policy's config in between): affinity (Maglev on
   x-prefillonly-user, bounded load 1.5x the mean: the default), affinity with a 3x bound,
   least request, round robin, and the endpoint picker (its own process; affinity when it
   fails); throughput, mean / P99
   latency, the fleet's hit rate (cached tokens / prompt tokens as the replicas report them) and
   requests per replica. Each run uses its own cache namespaces (the `user` field), so no run
   finds another's profiles cached.
4. The same trace on one engine (a replica queried directly) at a quarter of the rate: the hit
   rate a single engine gets on it, which affinity should match (the target: within 5 points).

--replica-cores X puts each replica in a CPU slice of its own (perf/cpu_slices.py: a cgroup quota
of X cores), so the replicas behave as separate machines instead of sharing the host's cores;
Envoy, the picker and the load generator run in what is left. The picker run's decision log is
kept beside the JSON (perf/results/fleet/<name>_picker_decisions.jsonl).

Writes perf/results/fleet/fleet.json and the "## Fleet behind Envoy" section of
perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from clients.transport import http_generate, json_body, post, result_documents, routing_headers
from perf import benchutil as bu
from perf import harness
from perf import workloads as wl
from perf.cpu_slices import CpuSlices
from prefillonly.serving.host.envoy_config import REPLICA_HEADER, FrontDoor, Upstream
from prefillonly.serving.host.envoy import EnvoyProxy
from prefillonly.serving.host.fleet import LocalFleet
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.picker_process import PickerProcess, write_members

SECTION = "## Fleet behind Envoy"
SKEWED_SECTION = "## Fleet behind Envoy, skewed users in bursts"  # --zipf / --burst runs keep their own table
REPO = bu.REPO_ROOT / "model_repository"
OUT = bu.PERF_DIR / "results" / "fleet"
# (label, routing, hash_balance_factor): the default affinity config first, then a looser bound;
# "picker": the endpoint picker (prefillonly.serving.picker) in front, affinity as its fallback
POLICIES = (("affinity", "affinity", 150), ("affinity, bound 3x", "affinity", 300), ("least_request", "least_request", 150),
            ("round_robin", "round_robin", 150), ("picker", "affinity", 150))
REPLICAS = 3


class FleetBackend:
    """HTTP generate through Envoy (or straight to a replica), the request's user as the cache
    namespace and, when `header`, as x-prefillonly-user. Records which replica answered."""

    def __init__(self, url: str, namespace: str, header: bool):
        self.url, self.namespace, self.header = url, namespace, header
        self.replicas: Counter = Counter()
        self._lock = threading.Lock()

    def score(self, request: wl.TraceRequest, allowed: list[int], timeout_s: float = 600.0) -> dict:
        fields = {"input_ids": list(request.prompt_token_ids), "allowed_token_ids": list(allowed),
                  "user": f"{self.namespace}-u{request.user}", "cache_prefix_len": request.cache_prefix_len}
        status, raw, headers = post(f"{self.url}/v2/models/prefillonly/generate", json_body(fields),
                                    routing_headers(fields) if self.header else None, timeout_s)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        with self._lock:
            self.replicas[headers.get(REPLICA_HEADER, "direct")] += 1
        (doc,) = result_documents(json.loads(raw)["result_json"])
        return {"prompt_tokens": doc["prompt_tokens"], "cached_tokens": doc["cached_tokens"], "logprobs": None}


def _front(fleet: LocalFleet, routing: str, factor: int, picker: str | None = None) -> FrontDoor:
    return FrontDoor([Upstream("127.0.0.1", r.http_port, r.grpc_port) for r in fleet.replicas], routing=routing,
                     hash_balance_factor=factor, http_port=0, grpc_port=0, picker=picker)


def _start_picker(fleet: LocalFleet, folder: Path) -> PickerProcess:
    """The endpoint picker over the fleet's replicas (their HTTP ports and metrics)."""
    members = folder / "picker-members.json"
    write_members(members, [{"key": u.key, "destination": f"{u.host}:{u.http_port}", "metrics_url": fleet.replicas[i].metrics_url}
                            for i, u in zip(fleet.members, fleet.upstreams)])
    return PickerProcess(members, log_path=folder / "picker.log", decisions_log=folder / "picker-decisions.jsonl").start().wait_ready()


def _paired(n: int, call_direct, call_envoy) -> dict:
    """n pairs, alternating which goes first; seconds of each call; the median paired difference."""
    direct, via = [], []
    for i in range(n):
        calls = [(direct, call_direct), (via, call_envoy)]
        if i % 2:
            calls.reverse()
        for out, call in calls:
            t = time.perf_counter()
            call(i)
            out.append(time.perf_counter() - t)
    diffs = sorted(v - d for v, d in zip(via, direct))
    return {"n": n, "direct_median_ms": 1e3 * statistics.median(direct), "envoy_median_ms": 1e3 * statistics.median(via),
            "paired_overhead_median_ms": 1e3 * statistics.median(diffs), "paired_overhead_p90_ms": 1e3 * diffs[int(0.9 * (n - 1))]}


def envoy_overhead(fleet: LocalFleet, n: int, seed: int) -> dict:
    """Envoy's hop, paired and alternating: (a) Triton's readiness GET (no engine work, so the
    difference is the proxy's own), straight to replica 0 vs through Envoy to it (replica 0's
    users only); (b) a short scoring request, straight vs through Envoy (all replicas idle)."""
    import random

    def get(url):
        with urllib.request.urlopen(url, timeout=60) as r:
            r.read()

    def generate(url, i):
        rng = random.Random(seed * 100_000 + i)
        status, reply = http_generate(url, {"input_ids": [rng.randrange(100, 40000) for _ in range(16)],
                                            "allowed_token_ids": [9230, 2838], "user": f"overhead-{i}", "cache_prefix_len": 0}, 60)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {reply}")
        time.sleep(0.05)

    direct_url = fleet.replicas[0].http_url
    health = _paired(10 * n, lambda i: get(f"{direct_url}/v2/health/ready"), lambda i: get(f"{fleet.http_url}/v2/health/ready"))
    scoring = _paired(n, lambda i: generate(direct_url, i), lambda i: generate(fleet.http_url, i))
    return {"health": health, "scoring": scoring}


def run(backend, trace: wl.Trace, label: str, qps: float | None, seed: int, burst: float = 1.0) -> dict:
    stamped = harness.poisson_schedule(trace, qps, seed, burst) if qps else wl.with_poisson_arrivals(trace, 1e9, seed)
    result = harness.run_open_loop(backend, stamped, label=label, qps=qps, progress_every=50, log=bu.log)
    s = harness.summarize(result)
    s["label"], s["per_replica"] = label, dict(sorted(backend.replicas.items()))
    counts = list(backend.replicas.values())
    s["replica_imbalance"] = max(counts) / statistics.mean(counts) if counts else None
    bu.log(f"{label}: thr {s['throughput_rps']:.3g} req/s, mean {s['mean_latency_s']:.3g} s, P99 {s['p99_latency_s']:.3g} s, "
           f"hit {s['reported_hit_fraction']:.1%}, per replica {s['per_replica']}, errors {s['errors']}")
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--posts", type=int, default=6)
    p.add_argument("--profile-mean", type=float, default=1000)
    p.add_argument("--load", type=float, default=0.8, help="multiple of the fleet's saturated rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf", type=float, default=0.0, help="skewed users: post counts Zipf with this exponent (e.g. 1.0; 0: uniform)")
    p.add_argument("--burst", type=float, default=1.0, help="users arrive in bursts of this many on average (1: plain Poisson)")
    p.add_argument("--replica-cores", type=float, default=None,
                   help="each replica in a CPU slice of this many cores (a cgroup quota; needs root), e.g. 0.55")
    p.add_argument("--policies", default=",".join(label for label, _, _ in POLICIES),
                   help="comma list of the routing policies to run (labels as in the table); affinity is always run")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    users = a.users or (9 if a.quick else 24)
    scale = wl.PostRecScale(users=users, posts_per_user=a.posts if not a.quick else 3, profile_mean=a.profile_mean,
                            posts_zipf=a.zipf)
    wanted = {"affinity"} | {s.strip() for s in a.policies.split(",") if s.strip()}
    unknown = wanted - {label for label, _, _ in POLICIES}
    if unknown:
        raise SystemExit(f"unknown --policies {sorted(unknown)}; choose from {[label for label, _, _ in POLICIES]}")
    policies = [p for p in POLICIES if p[0] in wanted]
    trace = wl.generate_post_rec(scale, a.seed)
    bu.log(f"trace: {len(trace.requests)} requests from {users} users, {sum(len(r.prompt_token_ids) for r in trace.requests):,} tokens")
    skewed = bool(a.zipf) or a.burst != 1.0
    name, section = ("fleet_skewed", SKEWED_SECTION) if skewed else ("fleet", SECTION)
    t0 = time.perf_counter()
    slices = CpuSlices(a.replica_cores) if a.replica_cores else None  # fails here, before minutes of set-up
    decisions, throttled = None, None
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, slices or contextlib.nullcontext():
        repo = copy_model_repository(REPO, Path(tmp) / "repo", dtype="float32", threads="1")
        with LocalFleet(repo, replicas=REPLICAS, log_dir=Path(tmp)).start() as fleet:
            bu.log(f"fleet up in {time.perf_counter() - t0:.0f} s")
            if slices:
                for i, replica in enumerate(fleet.replicas):
                    moved = slices.add(f"replica-{i}", replica.pid)
                    bu.log(f"replica {i}: {len(moved)} processes in a {a.replica_cores:g}-core CPU slice")
            overhead = envoy_overhead(fleet, 12 if a.quick else 60, a.seed)
            bu.log(f"Envoy hop: paired median {overhead['health']['paired_overhead_median_ms']:.3f} ms on a readiness GET, "
                   f"{overhead['scoring']['paired_overhead_median_ms']:.2f} ms on a short scoring request")
            sat = run(FleetBackend(fleet.http_url, "sat", True), trace, "saturation (affinity, all at once)", None, a.seed)
            qps = a.load * sat["throughput_rps"]
            runs, picker = [], None
            for k, (label, routing, factor) in enumerate(policies):
                if label == "picker":
                    picker = _start_picker(fleet, Path(tmp))
                if k:  # the same replicas, Envoy reconfigured
                    fleet.proxy.stop()
                    fleet.proxy = EnvoyProxy(_front(fleet, routing, factor, picker.address if picker else None)).start().wait_ready()
                backend = FleetBackend(fleet.http_url, f"run{k}", header=routing == "affinity")
                s = run(backend, trace, label, qps, a.seed, a.burst)
                s["routing"], s["hash_balance_factor"] = label, factor
                runs.append(s)
            if picker is not None:
                picker.stop()
                decisions = (Path(tmp) / "picker-decisions.jsonl").read_text()
            single = run(FleetBackend(fleet.replicas[0].http_url, "single", False), trace, "one engine (direct)",
                         qps / REPLICAS, a.seed, a.burst)
            throttled = slices.throttled_s() if slices else None
    data = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(1), "replicas": REPLICAS,
            "trace": {"users": users, "posts_per_user": scale.posts_per_user, "profile_mean": scale.profile_mean,
                      "requests": len(trace.requests), "posts_zipf": a.zipf, "burst_mean": a.burst,
                      "max_posts_per_user": max(wl.post_counts(scale, a.seed))},
            "picker_decided": decisions.count("\n") if decisions is not None else None,
            "replica_cores": a.replica_cores, "throttled_s": throttled,
            "overhead": overhead, "saturation": sat, "offered_qps": qps, "load": a.load, "runs": runs, "single_engine": single,
            "wall_s": time.perf_counter() - t0}
    if a.quick:
        print(render(data))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    bu.save_json(OUT / f"{name}.json", data)
    if decisions is not None:
        (OUT / f"{name}_picker_decisions.jsonl").write_text(decisions)
    bu.replace_section(bu.PERF_DIR / "RESULTS.md", section, render(data))
    bu.log(f"wrote perf/results/fleet/{name}.json and the RESULTS.md section {section!r}")
    return 0


def render(data: dict) -> str:
    m, t = data["machine"], data["trace"]
    o, oh = data["overhead"]["scoring"], data["overhead"]["health"]
    by = {r["routing"]: r for r in data["runs"]}
    aff, lr = by["affinity"], by.get("least_request")
    single = data["single_engine"]
    slice_note = (f", each in a CPU slice of {data['replica_cores']:g} cores (a cgroup quota; held back "
                  + ", ".join(f"{s:.0f}" for s in data["throttled_s"].values()) + " s by it over the whole bench)"
                  if data.get("replica_cores") else "")
    lines = [
        f"Command: `{data['command']}` ({data['date']}; {bu.machine_line(m)}). {data['replicas']} tritonserver replicas "
        f"(default model, float32, 1 thread each{slice_note}) behind Envoy 1.40 on one host; post-recommendation trace, {t['users']} "
        f"users x {t['posts_per_user']} posts (profiles ~{t['profile_mean']:.0f} tokens), {t['requests']} requests; "
        f"Poisson users at {data['load']:g}x the fleet's saturated {data['saturation']['throughput_rps']:.3g} req/s "
        f"(affinity, whole trace at once) = {data['offered_qps']:.3g} req/s, same arrivals for every policy."
        + (f" Skewed users: post counts Zipf (s = {t['posts_zipf']:g}, the hottest user {t['max_posts_per_user']} posts), users "
           f"arriving in bursts of {t.get('burst_mean', 1):g} on average." if t.get("posts_zipf") or t.get("burst_mean", 1) != 1 else ""), "",
        "| routing | throughput req/s | mean s | P99 s | fleet hit rate | requests per replica | imbalance | errors |",
        "|---|---|---|---|---|---|---|---|"]
    for r in data["runs"] + [dict(single, routing="one engine, direct (1/3 of the rate)")]:
        lines.append(f"| {r['routing']} | {r['throughput_rps']:.3g} | {r['mean_latency_s']:.3g} | {r['p99_latency_s']:.3g} | "
                     f"{r['reported_hit_fraction']:.1%} | {', '.join(str(v) for v in r['per_replica'].values())} | "
                     f"{(r['replica_imbalance'] or 1):.2f} | {r['errors']} |")
    gap = 100 * (single["reported_hit_fraction"] - aff["reported_hit_fraction"])
    lines += ["", f"Envoy's hop at low load, paired and in alternating order: on Triton's readiness GET ({oh['n']} pairs; no "
              f"engine work) median {oh['paired_overhead_median_ms']:.3f} ms (P90 {oh['paired_overhead_p90_ms']:.3f} ms; "
              f"direct {oh['direct_median_ms']:.2f} ms); on a 16-token scoring request ({o['n']} pairs) median "
              f"{o['paired_overhead_median_ms']:.2f} ms (P90 {o['paired_overhead_p90_ms']:.2f} ms; direct "
              f"{o['direct_median_ms']:.1f} ms, through Envoy {o['envoy_median_ms']:.1f} ms: the engine's own spread "
              f"dominates this one).", "",
              "Targets: affinity's hit rate within 5 points of one engine's: "
              f"{aff['reported_hit_fraction']:.1%} vs {single['reported_hit_fraction']:.1%} ({gap:+.1f} points below: "
              f"{'met' if gap <= 5 else 'missed'}); "
              + (f"mean latency <= 0.6x least-request's: {aff['mean_latency_s'] / lr['mean_latency_s']:.2f}x "
                 f"({'met' if aff['mean_latency_s'] <= 0.6 * lr['mean_latency_s'] else 'missed'}); " if lr else "")
              + f"Envoy overhead <= 1 ms: {oh['paired_overhead_median_ms']:.3f} ms on the readiness GET "
              f"({'met' if oh['paired_overhead_median_ms'] <= 1 else 'missed'})."]
    if "picker" in by:
        pk = by["picker"]
        lines += ["", f"The endpoint picker against affinity (Maglev, bounded 1.5x) on the same arrivals: mean "
                  f"{pk['mean_latency_s'] / aff['mean_latency_s']:.2f}x, P99 {pk['p99_latency_s'] / aff['p99_latency_s']:.2f}x, "
                  f"hit rate {pk['reported_hit_fraction']:.1%} vs {aff['reported_hit_fraction']:.1%} (one engine's "
                  f"{single['reported_hit_fraction']:.1%}); issue 37's targets: P99 <= 0.7x, mean <= 0.8x, hit >= one engine's."
                  + (f" The picker decided {data['picker_decided']} of the run's {pk['requests']} requests"
                     + (" (the rest went by Envoy's fallback, Maglev, after its 0.2 s message timeout)."
                        if data["picker_decided"] < pk["requests"] else ".") if data.get("picker_decided") is not None else "")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
