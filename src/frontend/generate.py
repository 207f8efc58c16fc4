"""Triton's HTTP generate, passed through with the caller's tenant (API keys on only).

Triton copies chosen request headers into a request's parameters for gRPC and HTTP infer, where the
model reads the tenant Envoy derived from the API key, but not for HTTP generate. So with keys on
the front door sends POST /v2/models/<m>[/versions/<v>]/generate and generate_stream here, and this
passes each one to Triton's own endpoint unchanged except for the tenant: any tenant the client
wrote into the body (a top-level field, which generate makes a parameter, or one in "parameters")
is replaced by TENANT_HEADER's value. Triton's answer comes back as it is, but an error whose code is
rate_limited (over the tenant's quota) becomes the 429 with Retry-After it stands for.
"""

from __future__ import annotations

import json

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..contract.tenants import TENANT_HEADER, retry_after_of
from ..contract.wire import RATE_LIMITED, UNAVAILABLE, code_of
from .tenancy import retry_after_header

_PASSED_RESPONSE_HEADERS = ("content-type",)


def with_tenant(body: bytes, tenant: str | None) -> bytes:
    """The generate body with `tenant` as its only tenant parameter (none when `tenant` is None).
    A body that is not a JSON object goes on as it is: Triton refuses it in its own words."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if not isinstance(doc, dict):
        return body
    doc.pop(TENANT_HEADER, None)
    parameters = doc.get("parameters")
    if isinstance(parameters, dict):
        parameters.pop(TENANT_HEADER, None)
    if tenant is not None:
        if not isinstance(parameters, dict):
            if parameters is not None:  # not an object: Triton refuses it; keep the client's mistake visible
                return json.dumps(doc).encode()
            doc["parameters"] = parameters = {}
        parameters[TENANT_HEADER] = tenant
    return json.dumps(doc).encode()


def _unreachable(e: Exception) -> JSONResponse:
    return JSONResponse({"error": f"{UNAVAILABLE}: the engine could not be reached ({type(e).__name__}); retry"},
                        status_code=503)


def _passed_headers(upstream: httpx.Response) -> dict:
    return {h: upstream.headers[h] for h in _PASSED_RESPONSE_HEADERS if h in upstream.headers}


def _answer(upstream: httpx.Response, content: bytes) -> Response:
    headers = _passed_headers(upstream)
    if upstream.status_code >= 400:  # Triton's generate answers a decoupled model's errors 400, whatever their status
        try:
            message = json.loads(content).get("error", "")
        except (ValueError, AttributeError):
            message = ""
        if isinstance(message, str) and code_of(message) == RATE_LIMITED:
            return Response(content, status_code=429, headers={**headers, **retry_after_header(retry_after_of(message))})
    return Response(content, status_code=upstream.status_code, headers=headers)


def generate_routes(triton_http: str) -> APIRouter:
    """The passthrough to Triton's HTTP endpoint at `triton_http` (host:port)."""
    router = APIRouter()
    client = httpx.AsyncClient(base_url=f"http://{triton_http}", timeout=None)  # a request may score for minutes

    async def generate(request: Request):
        body = with_tenant(await request.body(), request.headers.get(TENANT_HEADER))
        try:
            upstream = await client.post(request.url.path, content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            return _unreachable(e)
        return _answer(upstream, upstream.content)

    async def generate_stream(request: Request):
        body = with_tenant(await request.body(), request.headers.get(TENANT_HEADER))
        call = client.build_request("POST", request.url.path, content=body, headers={"content-type": "application/json"})
        try:
            upstream = await client.send(call, stream=True)
        except httpx.HTTPError as e:
            return _unreachable(e)
        if upstream.status_code != 200:  # an error answer: small, read whole
            content = await upstream.aread()
            await upstream.aclose()
            return _answer(upstream, content)
        return StreamingResponse(upstream.aiter_raw(), status_code=200, background=BackgroundTask(upstream.aclose),
                                 headers=_passed_headers(upstream))

    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        router.add_api_route(prefix + "/generate", generate, methods=["POST"])
        router.add_api_route(prefix + "/generate_stream", generate_stream, methods=["POST"])
    return router

