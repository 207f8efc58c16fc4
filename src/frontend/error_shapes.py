"""Refusals in each API's own error shape, chosen by the route that was called.

    openai   {"error": {"message", "type", "param", "code"}}   /v1/completions, /v1/models, /v1/rerank,
                                                               /rerank, /generative_scoring, /score
    sglang   {"object": "error", "message", "type", "param", "code"}   /v1/score (SGLang's flat shape)
    cohere   {"message": "..."}                                /v2/rerank
    tei      {"error": "...", "error_type": "..."}             /rerank with a TEI body

Every message starts with the engine's code ("invalid_request: ...", "overloaded: ...") as on
Triton's own routes. Bad input is 400, an unknown model or route 404, not-now (overloaded,
unavailable, restarting) 503, over the tenant's quota (rate_limited) 429 with Retry-After, anything
else 500 (prefillonly.contract.wire.http_status of the engine's code). TEI's statuses are its own: 422 Validation for bad input, 400 Empty for no texts, 429
Overloaded, 424 Backend for an engine error, 503 Unhealthy when no engine answers.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ..contract.tenants import retry_after_of
from ..contract.wire import RATE_LIMITED, http_status
from .tenancy import retry_after_header
from .upstream import UpstreamError


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request", param: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.code, self.param, self.retry_after_s = status, code, param, retry_after_s
        self.message = message if message.startswith(code + ":") else f"{code}: {message}"

    @classmethod
    def from_upstream(cls, e: UpstreamError) -> "APIError":
        if e.code == RATE_LIMITED:  # over the tenant's quota: 429, and when to come back
            return cls(e.message, status=429, code=e.code, retry_after_s=retry_after_of(e.message))
        return cls(e.message, status=http_status(e.code), code=e.code)


_OPENAI_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "BadRequestError", 429: "RateLimitError",
                 503: "ServiceUnavailableError", 500: "InternalServerError"}


def error_response(style: str, error: APIError) -> JSONResponse:
    headers = retry_after_header(error.retry_after_s)
    if style == "cohere":
        return JSONResponse({"message": error.message}, status_code=error.status, headers=headers)
    if style == "tei":
        status, kind = _tei_status(error)
        return JSONResponse({"error": error.message, "error_type": kind}, status_code=status, headers=headers)
    body = {"message": error.message, "type": _OPENAI_TYPES.get(error.status, "BadRequestError"), "param": error.param,
            "code": error.status}
    if style == "sglang":
        return JSONResponse({"object": "error", **body}, status_code=error.status, headers=headers)
    return JSONResponse({"error": body}, status_code=error.status, headers=headers)


def _tei_status(error: APIError) -> tuple[int, str]:
    """TEI's (status, error_type) for an error: its router's own mapping."""
    if error.code == "empty":
        return 400, "Empty"
    if error.status in (400, 422):
        return 422, "Validation"
    if error.status == 404:
        return 404, "Validation"
    if error.code in ("overloaded", RATE_LIMITED):
        return 429, "Overloaded"
    if error.status == 503:
        return 503, "Unhealthy"
    return 424, "Backend"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic's errors as one message naming each field ("documents[3]: Input should be ...")."""
    parts, first = [], None
    for e in errors[:5]:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        # a union's branch names (str, TextDocument, list[int]) are pydantic's, not the user's
        loc = [x for x in loc if not (isinstance(x, str) and (x[:1].isupper() or "[" in x or x in ("str", "int")))]
        name = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"
        first = first or name
        parts.append(f"{name}: {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(dict.fromkeys(parts)) + more, first
