"""Who a call is for, passed on to the engine: the tenant Envoy derived from the API key, and the
key itself (a fleet's front door checks it again).

Envoy (with API keys on) sets TENANT_HEADER on each request from its key, after removing any the
client sent. The frontend's engine calls go out on their own gRPC streams, so the middleware keeps
the two headers in a context variable for the call's duration, and TritonUpstream adds them to each
stream it opens: Triton passes the tenant header on to the model (which isolates the cache and
counts the quota by it), and a fleet's front door, where the frontend's upstream is one, re-checks
the key and sets the tenant again itself.
"""

from __future__ import annotations

import contextvars
import math

from fastapi import FastAPI, Request

from ..contract.tenants import TENANT_HEADER

FORWARDED_HEADERS = (TENANT_HEADER, "authorization")
_forwarded: contextvars.ContextVar[dict] = contextvars.ContextVar("prefillonly_forwarded", default={})


def forwarded_headers() -> dict:
    """The identity headers of the call being answered (empty outside one, or without keys)."""
    return _forwarded.get()


def forward_identity(app: FastAPI) -> None:
    @app.middleware("http")
    async def _identity(request: Request, call_next):
        token = _forwarded.set({h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers})
        try:
            return await call_next(request)
        finally:
            _forwarded.reset(token)


def retry_after_header(seconds: float | None) -> dict:
    """Retry-After in whole seconds (what HTTP allows), at least 1; nothing when unknown."""
    return {} if seconds is None else {"retry-after": str(max(1, math.ceil(seconds)))}
