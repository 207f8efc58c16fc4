"""One open-loop client harness for latency under load, with a backend per system.

The same code drives every system, so what differs between two latency curves is the server:

    trace = load_trace(...)                                    # identical token ids for all systems
    timed = poisson_schedule(trace, qps=2.0, seed=0)           # the SAME arrival times for every system
    result = run_open_loop(TritonGrpcBackend("127.0.0.1:8001"), timed, label="ours")
    summarize(result)                                          # throughput, mean/P99 latency, errors

* Open loop: request i is sent at t0 + arrival_s(i) whether or not earlier ones have answered
  (a dispatcher thread sleeps until each arrival and hands the request to its own worker
  thread); latency is measured from the SCHEDULED arrival time, so a client that falls behind
  shows up as latency, never as a silently lower offered load.
* Every request is counted exactly once: one Outcome per request id, either ok (with a latency)
  or an error (with the message, and no latency). Errors never enter the latency statistics.
* Backends are small synchronous classes (`score(request, allowed) -> dict`); the harness runs
  each call in a thread. A backend returns what it knows about the answer: prompt_tokens,
  cached_tokens (None if the system does not say), and the allowed tokens' logprobs.

Backends: TritonGrpcBackend (our Triton model over gRPC streaming, through
clients/prefillonly_client.py), VllmOpenAIBackend (vLLM's OpenAI-compatible /v1/completions with
prompt token ids, max_tokens=1, logprobs, allowed_token_ids). Tests use a fake in-process backend.
`prefix_hit_counters` reads the servers' metrics endpoints (prefillonly.serving.host.prometheus).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from clients.transport import json_body, post
from perf import benchutil as bu
from perf import workloads as wl
from prefillonly.serving.host import prometheus

MAX_CLIENT_THREADS = 512  # more in flight than this queue in the client (and count as latency)


# -- schedule -----------------------------------------------------------------------------------
def poisson_schedule(trace: wl.Trace, qps: float, seed: int | None = None, burst_mean: float = 1.0) -> wl.Trace:
    """The trace with Poisson user arrivals giving `qps` requests/s on average (in bursts of
    `burst_mean` users on average: workloads.with_poisson_arrivals).

    The one place a QPS level becomes arrival times: every system replays the result of this
    call, so the same (trace, qps, seed, burst_mean) gives every system the same arrival times."""
    return wl.with_poisson_arrivals(trace, wl.user_rate_for_qps(trace, qps), seed, burst_mean)


# -- outcomes -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    request_id: str
    user: int
    prompt_tokens: int
    arrival_s: float  # scheduled, relative to the run's start
    sent_s: float | None = None  # when the worker actually called the backend
    done_s: float | None = None
    ok: bool = False
    latency_s: float | None = None  # done - scheduled arrival; None for errors
    error: str | None = None
    cached_tokens: int | None = None
    logprobs: dict | None = None  # str(token id) -> logprob, as the backend reports them


@dataclass
class LoadResult:
    label: str
    qps: float | None
    outcomes: list[Outcome]
    wall_s: float  # run start to the last outcome
    metrics_before: dict = field(default_factory=dict)
    metrics_after: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"label": self.label, "qps": self.qps, "wall_s": self.wall_s, "summary": summarize(self),
                "metrics_before": self.metrics_before, "metrics_after": self.metrics_after,
                "outcomes": [asdict(o) for o in self.outcomes]}


class DuplicateOutcomeError(RuntimeError):
    """A request was answered twice: a harness bug, never a system's."""


def run_open_loop(backend, trace: wl.Trace, *, label: str = "", qps: float | None = None, timeout_s: float = 600.0,
                  progress_every: int = 10, log=None, metrics=None) -> LoadResult:
    """Replay `trace` (arrival_s stamped) open-loop against `backend`; one Outcome per request, in trace order.

    timeout_s bounds one request (then it is an error, "timeout"); `metrics` is an optional
    callable returning counters, read before the first and after the last request."""
    log = log or bu.log
    requests = wl.arrival_order(trace)
    if any(r.arrival_s is None for r in requests):
        raise ValueError("the trace has no arrival times: stamp them with poisson_schedule()")
    ids = [r.request_id for r in trace.requests]  # outcomes come back in trace order
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    allowed = list(trace.allowed_token_ids)
    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()
    done_count = [0, 0]  # ok, errors
    metrics_before = _safe_metrics(metrics)

    def record(o: Outcome) -> None:
        with lock:
            if o.request_id in outcomes:
                raise DuplicateOutcomeError(f"request {o.request_id} answered twice")
            outcomes[o.request_id] = o
            done_count[0 if o.ok else 1] += 1
            n = len(outcomes)
        if n % progress_every == 0 or n == len(requests) or not o.ok:
            what = f"{o.request_id} failed: {o.error}" if not o.ok else f"last {o.latency_s:.2f} s"
            log(f"{label}: {n}/{len(requests)} done ({done_count[0]} ok, {done_count[1]} errors) at "
                f"{time.perf_counter() - t0:.1f} s; {what}")

    def one(r: wl.TraceRequest) -> None:
        o = Outcome(r.request_id, r.user, len(r.prompt_token_ids), r.arrival_s)
        o.sent_s = time.perf_counter() - t0
        try:
            answer = backend.score(r, allowed, timeout_s=timeout_s)  # backends pass the deadline to their transport
        except BaseException as e:  # noqa: BLE001 - every failure is an outcome, never a lost request
            o.done_s = time.perf_counter() - t0
            o.error = _error_text(e)
        else:
            o.done_s = time.perf_counter() - t0
            o.ok, o.latency_s = True, o.done_s - o.arrival_s
            o.cached_tokens = answer.get("cached_tokens")
            o.logprobs = answer.get("logprobs")
        record(o)

    log(f"{label}: {len(requests)} requests over {requests[-1].arrival_s:.1f} s of arrivals"
        + (f" ({qps:g} req/s offered)" if qps else ""))
    pool = ThreadPoolExecutor(max_workers=min(MAX_CLIENT_THREADS, len(requests)), thread_name_prefix="harness")
    t0 = time.perf_counter()
    futures = []
    try:
        for r in requests:  # the dispatcher: sleep until each scheduled arrival
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, r))
        for f in futures:
            f.result()  # re-raises only harness bugs (DuplicateOutcomeError); backend errors are outcomes
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    wall = time.perf_counter() - t0
    missing = set(ids) - set(outcomes)
    if missing:  # cannot happen unless a worker died outside `one`'s try
        raise RuntimeError(f"{len(missing)} requests have no outcome: {sorted(missing)[:5]}")
    return LoadResult(label, qps, [outcomes[i] for i in ids], wall, metrics_before, _safe_metrics(metrics))


def _error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:300]


def _safe_metrics(metrics) -> dict:
    if metrics is None:
        return {}
    try:
        return metrics()
    except Exception as e:  # noqa: BLE001 - metrics are extra information, never fatal
        return {"error": _error_text(e)}


# -- statistics ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """numpy's (linear-interpolation) percentile, q in [0, 100]; None for no values."""
    return float(np.percentile(values, q)) if values else None


def summarize(result: LoadResult) -> dict:
    """Throughput and latency over the answered requests; errors counted apart, by message."""
    ok = [o for o in result.outcomes if o.ok]
    errors = [o for o in result.outcomes if not o.ok]
    latencies = [o.latency_s for o in ok]
    kinds = dict(Counter(o.error for o in errors))
    first = min((o.arrival_s for o in result.outcomes), default=0.0)
    last = max((o.done_s for o in ok), default=None)
    span = (last - first) if last is not None else None
    reported = [o for o in ok if o.cached_tokens is not None]
    prompt_ok = sum(o.prompt_tokens for o in reported)
    return {
        "requests": len(result.outcomes),
        "ok": len(ok),
        "errors": len(errors),
        "error_kinds": kinds,
        "offered_qps": result.qps,
        "throughput_rps": len(ok) / span if span else None,  # answered requests / (first arrival .. last answer)
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else None,
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "max_latency_s": max(latencies, default=None),
        "max_send_lag_s": max((o.sent_s - o.arrival_s for o in result.outcomes if o.sent_s is not None), default=None),
        "prompt_tokens": sum(o.prompt_tokens for o in result.outcomes),
        "reported_cached_tokens": sum(o.cached_tokens for o in reported) if reported else None,
        "reported_hit_fraction": (sum(o.cached_tokens for o in reported) / prompt_ok) if prompt_ok else None,
        "wall_s": result.wall_s,
    }


# -- metrics endpoints --------------------------------------------------------------------------
def prefix_hit_counters(system: str, metrics_url: str) -> dict:
    return prefix_hits_from_samples(system, prometheus.scrape(metrics_url))


def prefix_hits_from_samples(system: str, samples) -> dict:
    """Prompt tokens computed and served from the prefix cache, per the system's own counters.

    ours: prefillonly_prompt_tokens_total{source="computed"|"cache"} (Triton's metrics port), and
    the worker's idle gap before each step (prefillonly_step_idle_gap_seconds: sum, count, and
    the steps within 5 ms);
    vLLM: vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (tokens)."""
    if system == "ours":
        computed = prometheus.total(samples, "prefillonly_prompt_tokens_total", source="computed")
        cached = prometheus.total(samples, "prefillonly_prompt_tokens_total", source="cache")
        gap = "prefillonly_step_idle_gap_seconds"
        return {"prompt_tokens": computed + cached, "cached_tokens": cached,
                "idle_gap_s": prometheus.total(samples, f"{gap}_sum"), "steps": prometheus.total(samples, f"{gap}_count"),
                "steps_gap_under_5ms": prometheus.total(samples, f"{gap}_bucket", le="0.005")}
    queries = prometheus.total(samples, "vllm:prefix_cache_queries_total")
    hits = prometheus.total(samples, "vllm:prefix_cache_hits_total")
    return {"prompt_tokens": queries, "cached_tokens": hits}


def idle_gaps(before: dict, after: dict) -> dict | None:
    """Our worker's idle gaps between two prefix_hit_counters readings: mean per step and the
    fraction of steps within 5 ms (None for a system without the metric)."""
    if not before or not after or "steps" not in after or "error" in before or "error" in after:
        return None
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return None
    return {"steps": steps, "mean_idle_gap_ms": 1e3 * (after["idle_gap_s"] - before["idle_gap_s"]) / steps,
            "steps_within_5ms": (after["steps_gap_under_5ms"] - before["steps_gap_under_5ms"]) / steps}


def hit_fraction(before: dict, after: dict) -> float | None:
    """Fraction of prompt tokens from the prefix cache between two prefix_hit_counters readings."""
    if not before or not after or "error" in before or "error" in after:
        return None
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt > 0 else None


# -- backends -----------------------------------------------------------------------------------
class TritonGrpcBackend:
    """Our Triton model over gRPC streaming (decoupled), via clients/prefillonly_client.py.

    One PrefillOnlyClient per worker thread (a tritonclient gRPC client holds one stream at a
    time); each request opens a stream on it, sends, and waits for its one final response."""

    name = "ours"

    def __init__(self, url: str, model: str = "prefillonly", use_cache_boundary: bool = True):
        from clients.prefillonly_client import PrefillOnlyClient  # the repository root is on sys.path (python -m perf...)

        self._client_class = PrefillOnlyClient
        self.url, self.model, self.use_cache_boundary = url, model, use_cache_boundary
        self._local = threading.local()
        self._clients: list = []
        self._lock = threading.Lock()

    def _client(self, timeout_s: float):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._client_class(self.url, protocol="grpc", model=self.model, timeout_s=timeout_s)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        client.timeout_s = timeout_s
        return client

    def score(self, request: wl.TraceRequest, allowed: list[int], timeout_s: float = 600.0) -> dict:
        boundary = request.cache_prefix_len if self.use_cache_boundary else None
        r = self._client(timeout_s).score(list(request.prompt_token_ids), list(allowed), cache_prefix_len=boundary)
        if r.get("prompt_tokens") not in (None, len(request.prompt_token_ids)):
            raise RuntimeError(f"answer for {r.get('prompt_tokens')} prompt tokens, sent {len(request.prompt_token_ids)}")
        return {"prompt_tokens": r.get("prompt_tokens"), "cached_tokens": r.get("cached_tokens"),
                "logprobs": {str(t["id"]): t["logprob"] for t in r.get("tokens", [])}}

    def close(self) -> None:
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()


class VllmOpenAIBackend:
    """vLLM's OpenAI-compatible server: POST /v1/completions with the prompt as token ids,
    max_tokens=1, temperature 0, logprobs, and allowed_token_ids (a vLLM extra field).

    Cached tokens come from usage.prompt_tokens_details.cached_tokens when the server was
    started with --enable-prompt-tokens-details (else None; /metrics has the totals)."""

    name = "vllm"

    def __init__(self, base_url: str, model: str, logprobs: int = 2):
        self.base_url, self.model, self.logprobs = base_url.rstrip("/"), model, logprobs

    def score(self, request: wl.TraceRequest, allowed: list[int], timeout_s: float = 600.0) -> dict:
        body = {"model": self.model, "prompt": list(request.prompt_token_ids), "max_tokens": 1, "temperature": 0,
                "logprobs": self.logprobs, "allowed_token_ids": list(allowed)}
        status, raw, _ = post(f"{self.base_url}/v1/completions", json_body(body), timeout=timeout_s)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {raw.decode(errors='replace')[:300]}")
        out = json.loads(raw)
        usage = out.get("usage") or {}
        if usage.get("prompt_tokens") not in (None, len(request.prompt_token_ids)):
            raise RuntimeError(f"answer for {usage.get('prompt_tokens')} prompt tokens, sent {len(request.prompt_token_ids)}")
        details = usage.get("prompt_tokens_details") or {}
        choice = out["choices"][0]
        lp = choice.get("logprobs") or {}
        top = (lp.get("top_logprobs") or [{}])[0] or {}
        return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens"),
                "text": choice.get("text"), "logprobs": top}

    def close(self) -> None:
        pass
