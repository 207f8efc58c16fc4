"""What the Triton model exports on Triton's Prometheus endpoint (:8002/metrics), from
Engine.stats(). Kept apart from model.py so the mapping is one table; `update` takes the
pb_utils module so nothing here imports Triton.

Counters are published as deltas of the engine's cumulative counts (Triton counters only go up),
counted from the stats the model passes at start (so the warm-up request is not a served one).
Request latency is a histogram (pb_utils.MetricFamily.HISTOGRAM, Triton 2.51+) observed by the
model as each request is answered. prefillonly_engine_info is an "info" gauge (always 1) whose
labels carry what the engine chose at start: its compute dtype and why (dtype="auto" picks per
host) and its attention and linear backends (timed per host), which /v2/models/prefillonly/config cannot show (it has the config.pbtxt's "auto").
"""

from __future__ import annotations

import threading
import time

from ...stats import EngineStats


# (name, kind, description, labels -> function of stats returning the value)
_METRICS = [
    ("prefillonly_waiting_requests", "GAUGE", "Requests waiting in the engine's queue", {(): lambda s: s.waiting}),
    ("prefillonly_requests_total", "COUNTER", "Requests by outcome", {
        (("outcome", "completed"),): lambda s: s.counters.completed,
        (("outcome", "failed"),): lambda s: s.failed,
        (("outcome", "overloaded"),): lambda s: s.counters.rejected["overloaded"],
        (("outcome", "deadline_exceeded"),): lambda s: s.counters.rejected["deadline_exceeded"],
        (("outcome", "cancelled"),): lambda s: s.counters.cancelled,
        (("outcome", "engine_closed"),): lambda s: s.counters.rejected["engine_closed"],
    }),
    ("prefillonly_prompt_tokens_total", "COUNTER", "Prompt tokens computed vs served from the prefix cache", {
        (("source", "computed"),): lambda s: s.computed_prompt_tokens,
        (("source", "cache"),): lambda s: s.cache.hit_tokens if s.cache else 0,
    }),
    ("prefillonly_cache_bytes", "GAUGE", "Prefix-cache bytes in use per tier", {
        (("tier", "1"),): lambda s: s.cache_bytes_in_use.get(1, 0),
        (("tier", "2"),): lambda s: s.cache_bytes_in_use.get(2, 0),
    }),
    ("prefillonly_cache_blocks_total", "COUNTER", "Prefix-cache block events", {
        (("event", event),): (lambda s, event=event: getattr(s.cache, f"blocks_{event}") if s.cache else 0)
        for event in ("evicted", "offloaded", "restored")
    }),
    ("prefillonly_memory_budget_bytes", "GAUGE", "Memory the engine may use: weights, activation budget, cache tiers", {
        (("kind", kind),): (lambda s, kind=kind: s.budget_bytes.get(kind, 0))
        for kind in ("weights", "activation", "cache_tier1", "cache_tier2")
    }),
    ("prefillonly_jct_estimate_error", "GAUGE", "Mean absolute relative error of the JCT estimate", {
        (): lambda s: s.jct_mean_abs_rel_error or 0.0,
    }),
    ("prefillonly_queued_work_seconds", "GAUGE", "Seconds of work queued: the running step's rest and the waiting requests' JCT estimates as they will run", {
        (): lambda s: s.queued_work_s,
    }),
    ("prefillonly_jct_coefficient", "GAUGE", "The fitted JCT model a + b*u + k*u*(u + 2c) (0 before a fit)", {
        (("term", term),): (lambda s, term=term: getattr(s.jct_coefficients, term) if s.jct_coefficients else 0.0)
        for term in ("fixed_s", "per_token_s", "attention_s")
    }),
    ("prefillonly_tokens_per_second", "GAUGE", "Prompt tokens computed per second since the last update", {}),
    ("prefillonly_warmup_seconds", "GAUGE", "Seconds the warm-up request took before the model reported ready", {}),
]

_INFO = "prefillonly_engine_info"


def engine_info_labels(stats: EngineStats) -> dict[str, str]:
    """The labels of prefillonly_engine_info: the engine's compute dtype and why it was chosen, and
    the attention and linear backends and the score head it runs ("auto" resolved per host at start),
    and the Triton kernels' start-up check (what fell back to torch, if anything)."""
    return {"dtype": stats.dtype, "dtype_reason": stats.dtype_reason, "attention_backend": stats.attention_backend,
            "linear_backend": stats.linear_backend, "score_head": stats.score_head,
            "kernel_check": stats.kernel_check or "none run"}


_LATENCY = "prefillonly_request_latency_seconds"
# queue: received -> the engine starts it; total: received -> answered (requests the engine took)
_LATENCY_PHASES = ("queue", "total")
_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# forward steps: uncached tokens computed and requests per step (how much batching happens), and
# the worker's idle gap before each step (time its work waited while the worker was not computing:
# picking, bookkeeping; near zero when answers are delivered off the worker)
_STEP_HISTOGRAMS = {
    "prefillonly_step_tokens": ("Prompt tokens computed per forward step", [2 ** i for i in range(4, 16)],
                                lambda r: r.tokens),
    "prefillonly_step_requests": ("Requests per forward step", [1, 2, 4, 8, 16, 32, 64, 128, 256], lambda r: r.requests),
    "prefillonly_step_idle_gap_seconds": ("Seconds the engine's worker was not computing while the step's work waited",
                                          [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0],
                                          lambda r: r.idle_gap_s),
}


class EngineMetrics:
    def __init__(self, pb_utils, baseline: EngineStats):
        """baseline: Engine.stats() at start; counters count from there."""
        self._lock = threading.Lock()
        self._metrics = {}  # (name, labels) -> (metric, kind, value_of)
        self._families = []  # kept alive: a collected family takes its metrics off the endpoint
        for name, kind, description, series in _METRICS:
            family = self._family(pb_utils, name, kind, description)
            for labels, value_of in (series or {(): None}).items():
                self._metrics[(name, labels)] = (family.Metric(labels=dict(labels)), kind, value_of)
        latency = self._family(pb_utils, _LATENCY, "HISTOGRAM", "Request latency: queue wait and total")
        self._latency = {p: latency.Metric(labels={"phase": p}, buckets=_LATENCY_BUCKETS) for p in _LATENCY_PHASES}
        self._steps = {}
        for name, (description, buckets, _) in _STEP_HISTOGRAMS.items():
            self._steps[name] = self._family(pb_utils, name, "HISTOGRAM", description).Metric(labels={}, buckets=buckets)
        # constant for the engine's life: one series, value 1, the choices in its labels
        info = self._family(pb_utils, _INFO, "GAUGE", "Engine choices made at start (labels; value 1): compute dtype and why, attention and linear backends")
        self._info = info.Metric(labels=engine_info_labels(baseline))
        self._info.set(1)
        self._steps_seen = baseline.steps
        self._last = {key: float(value_of(baseline)) for key, (_, kind, value_of) in self._metrics.items()
                      if kind == "COUNTER"}
        self._rate_at = (time.monotonic(), baseline.tokens_computed)
        self.update(baseline)

    def _family(self, pb_utils, name, kind, description):
        family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
        self._families.append(family)
        return family

    def set_warmup_seconds(self, seconds: float) -> None:
        self._metrics[("prefillonly_warmup_seconds", ())][0].set(seconds)

    def observe_latency(self, queue_s: list[float], total_s: float) -> None:
        """One answered request: its engine calls' queue waits (one per prompt that started) and its total time."""
        for wait in queue_s:
            self._latency["queue"].observe(wait)
        self._latency["total"].observe(total_s)

    def update(self, stats: EngineStats) -> None:
        with self._lock:
            for key, (metric, kind, value_of) in self._metrics.items():
                if value_of is None:
                    continue
                value = float(value_of(stats))
                # Each Metric call is a round trip to Triton (IPC), made on the response path:
                # send only what moved.
                if kind == "COUNTER":
                    delta = value - self._last.get(key, 0.0)
                    if delta > 0:
                        metric.increment(delta)
                elif value != self._last.get(key):
                    metric.set(value)
                self._last[key] = value
            self._observe_steps(stats)
            now, computed = time.monotonic(), stats.tokens_computed
            then, before = self._rate_at
            if now - then >= 1.0:
                self._metrics[("prefillonly_tokens_per_second", ())][0].set((computed - before) / (now - then))
                self._rate_at = (now, computed)

    def _observe_steps(self, stats: EngineStats) -> None:
        """The steps run since the last update (stats keeps the most recent ones; a burst
        longer than that between two updates loses the oldest from the histograms only)."""
        new = stats.steps - self._steps_seen
        if new <= 0:
            return
        for record in stats.recent_steps[-new:]:
            for name, (_, _, value_of) in _STEP_HISTOGRAMS.items():
                self._steps[name].observe(value_of(record))
        self._steps_seen = stats.steps
