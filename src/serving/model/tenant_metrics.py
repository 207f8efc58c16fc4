"""Per-tenant series on Triton's metrics endpoint (API keys on), from TenantGate's counts.

  prefillonly_tenant_requests_total{tenant, outcome}      completed, failed, rate_limited
  prefillonly_tenant_prompt_tokens_total{tenant, source}  computed, cache (each engine request once)
  prefillonly_tenant_queue_seconds_total{tenant}          queue wait summed over the engine requests started
  prefillonly_tenant_started_total{tenant}                engine requests started (mean wait: the ratio)
  prefillonly_tenant_in_flight{tenant}                    requests admitted and not yet answered

A tenant's series appear with its first request. Counters are published as deltas (Triton counters
only go up); `pb_utils` is passed in, so nothing here imports Triton.
"""

from __future__ import annotations

import threading

from .tenant_gate import TenantUsage

# (name, kind, description, labels -> value of a TenantUsage)
_SERIES = [
    ("prefillonly_tenant_requests_total", "COUNTER", "Requests per tenant by outcome", {
        (("outcome", "completed"),): lambda u: u.completed,
        (("outcome", "failed"),): lambda u: u.failed,
        (("outcome", "rate_limited"),): lambda u: u.rate_limited,
    }),
    ("prefillonly_tenant_prompt_tokens_total", "COUNTER", "Prompt tokens per tenant, computed vs from the prefix cache", {
        (("source", "computed"),): lambda u: u.prompt_tokens - u.cached_tokens,
        (("source", "cache"),): lambda u: u.cached_tokens,
    }),
    ("prefillonly_tenant_queue_seconds_total", "COUNTER", "Seconds per tenant its requests waited in the engine's queue",
     {(): lambda u: u.queue_s}),
    ("prefillonly_tenant_started_total", "COUNTER", "Engine requests per tenant that started", {(): lambda u: u.started}),
    ("prefillonly_tenant_in_flight", "GAUGE", "Requests per tenant admitted and not yet answered", {(): lambda u: u.in_flight}),
]


class TenantMetrics:
    def __init__(self, pb_utils):
        self._lock = threading.Lock()
        self._families = {name: (pb_utils.MetricFamily(name=name, description=description,
                                                       kind=getattr(pb_utils.MetricFamily, kind)), kind, series)
                          for name, kind, description, series in _SERIES}
        self._metrics = {}  # (name, tenant, labels) -> Metric
        self._last = {}

    def update(self, usage: dict[str, TenantUsage]) -> None:
        with self._lock:
            for tenant, u in usage.items():
                for name, (family, kind, series) in self._families.items():
                    for labels, value_of in series.items():
                        self._publish(family, kind, (name, tenant, labels), float(value_of(u)))

    def _publish(self, family, kind: str, key: tuple, value: float) -> None:
        last = self._last.get(key)
        if last == value:
            return  # each Metric call is a round trip to Triton: send only what moved
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = family.Metric(labels={"tenant": key[1], **dict(key[2])})
        if kind == "COUNTER":
            if value > (last or 0.0):
                metric.increment(value - (last or 0.0))
        else:
            metric.set(value)
        self._last[key] = value
