"""The Triton model's per-tenant admission and accounting (API keys on; see prefillonly.contract.tenants).

Each tenant has a quota per replica: requests in flight at once (taken at admission, given back
when the final response is sent) and requests per second (a token bucket holding one second's
worth, so a tenant may burst that many at once). A request over either is answered at once with
`rate_limited: ...; retry after S s` (RateLimitedError): Triton's status UNAVAILABLE, which the
frontend's routes and its generate passthrough answer as HTTP 429 with Retry-After. Counting here,
in the engine's own process, keeps the bound exact for every way in: HTTP generate and infer, each
request on a gRPC stream (which Envoy sees as one long request), the scoring APIs.

Quotas come from the tenants file the serve command writes (TENANTS_FILE_ENV), re-read when it
changes (checked at most every RELOAD_CHECK_S): new quotas apply to new requests; a request in
flight keeps its slot. A tenant the file does not list gets its default quota. Requests without a
tenant (no keys, or the supervisor's own liveness probe on Triton's internal port) are not counted.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from ...contract.errors import RateLimitedError
from ...contract.tenants import Quota, rate_limited_message, read_tenants

RELOAD_CHECK_S = 0.5
IN_FLIGHT_RETRY_AFTER_S = 1.0  # when a slot frees is not known ahead: come back in a second


@dataclass
class TenantUsage:
    """One tenant's counts since start (what the metrics publish)."""
    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    rate_limited: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0  # summed over the requests the engine started
    started: int = 0


class _Bucket:
    """Requests per second: `rate` tokens a second, at most max(rate, 1) held."""

    def __init__(self, rate: float, now: float):
        self.rate, self.tokens, self.at = rate, max(rate, 1.0), now

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        self.tokens = min(max(self.rate, 1.0), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class TenantGate:
    def __init__(self, tenants_file: str | None, clock=time.monotonic):
        self.path = tenants_file
        self.clock = clock
        self._lock = threading.Lock()
        self._quotas: dict[str, Quota] = {}
        self._default = Quota()
        self._mtime: float | None = None
        self._checked_at = -RELOAD_CHECK_S
        self._buckets: dict[str, _Bucket] = {}
        self.usage: dict[str, TenantUsage] = {}
        if self.path is not None:
            self._reload(self.clock())

    @property
    def enabled(self) -> bool:
        """Whether tenants exist here (the server has API keys)."""
        return self.path is not None

    def admit(self, tenant: str | None):
        """Take a slot of `tenant`'s quota, or raise RateLimitedError. Returns what gives it back
        (call it once, when the final response is sent); None for a request without a tenant."""
        if tenant is None or not self.enabled:
            return None
        with self._lock:
            now = self.clock()
            self._reload(now)
            quota = self._quotas.get(tenant, self._default)
            usage = self.usage.setdefault(tenant, TenantUsage())
            wait = self._over(tenant, quota, usage, now)
            if wait is not None:
                usage.rate_limited += 1
                raise RateLimitedError(rate_limited_message(wait[0], wait[1]), wait[1])
            usage.in_flight += 1
        return lambda: self._release(usage)

    def _over(self, tenant: str, quota: Quota, usage: TenantUsage, now: float):
        """(what is over, retry after s) or None; takes a token of the rate when within both."""
        if quota.in_flight is not None and usage.in_flight >= quota.in_flight:
            return f"tenant {tenant!r} has {usage.in_flight} requests in flight, its quota", IN_FLIGHT_RETRY_AFTER_S
        if quota.rps is not None:
            bucket = self._buckets.get(tenant)
            if bucket is None or bucket.rate != quota.rps:
                bucket = self._buckets[tenant] = _Bucket(quota.rps, now)
            wait = bucket.take(now)
            if wait > 0:
                return f"tenant {tenant!r} is over its quota of {quota.rps:g} requests per second", wait
        return None

    def _release(self, usage: TenantUsage) -> None:
        with self._lock:
            usage.in_flight -= 1

    def finished(self, tenant: str | None, futures, error, queue_s: list[float]) -> None:
        """Count an answered request: its outcome, the queue wait of each engine request it made that
        started, and, answered, their prompt tokens (those from the cache apart; from its Futures,
        each engine request once)."""
        if tenant is None or not self.enabled:
            return
        done = [f for f in futures if getattr(f, "started_at", None) is not None] if error is None else []
        prompt = sum(f.prompt_tokens for f in done)
        cached = sum(f.cached_tokens for f in done)
        with self._lock:
            usage = self.usage.setdefault(tenant, TenantUsage())
            if error is None:
                usage.completed += 1
            else:
                usage.failed += 1
            usage.prompt_tokens += prompt
            usage.cached_tokens += cached
            usage.queue_s += sum(queue_s)
            usage.started += len(queue_s)

    def snapshot(self) -> dict[str, TenantUsage]:
        with self._lock:
            return {t: TenantUsage(**vars(u)) for t, u in self.usage.items()}

    def _reload(self, now: float) -> None:
        """Re-read the tenants file if it changed (a stat at most every RELOAD_CHECK_S). A file that
        cannot be read keeps the quotas in use."""
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime:
                return
            with open(self.path) as f:
                self._quotas, self._default = read_tenants(f.read())
            self._mtime = mtime
        except (OSError, ValueError, KeyError, TypeError):
            return

