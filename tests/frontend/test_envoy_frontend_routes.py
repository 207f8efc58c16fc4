"""Which paths the front door sends to the scoring frontend, and the error shape of Envoy's own
replies there (prefillonly.serving.host.envoy_config FRONTEND_ROUTES, LOCAL_REPLY_STYLES): through
the real serve stack (Envoy, the supervised tritonserver and the frontend, on the small model),
GET /health, /info, /version and POST /score and the embedding and classification paths reach the frontend, and a body over
max_request_bytes gets 413 in the route's API shape (OpenAI, Cohere, TEI, Triton's) while the
server goes on serving. Envoy's 503 (no healthy upstream) is checked on a front door whose
upstreams are all down, without a server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from clients.transport import post
from prefillonly.serving.host.addresses import free_ports
from prefillonly.serving.host.envoy import EnvoyProxy
from prefillonly.serving.host.envoy_config import DEFAULT_MAX_REQUEST_BYTES, FrontDoor, Upstream
from prefillonly.contract.wire import REPLICA_HEADER


TOO_LARGE = json.dumps({"model": "plain", "query": "q", "documents": ["x" * (DEFAULT_MAX_REQUEST_BYTES + 1000)]}).encode()


def get(url: str) -> tuple[int, bytes, object]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def answered_by_port(headers) -> int:
    """The port of the upstream that answered (the front door's replica header: host:port)."""
    return int(headers[REPLICA_HEADER].rsplit(":", 1)[1])


def test_health_info_version_and_score_go_to_the_frontend(stack):
    status, raw, headers = get(f"{stack.http_url}/health")
    assert status == 200 and json.loads(raw)["ready"] is True, (status, raw)
    assert answered_by_port(headers) == stack.frontend.port
    for path in ("/info", "/version"):
        status, raw, headers = get(stack.http_url + path)
        assert answered_by_port(headers) == stack.frontend.port, (path, status, raw[:300])
    for path in ("/score", "/v2/embed", "/embed", "/predict", "/classify", "/pooling"):
        status, raw, headers = post(stack.http_url + path, b"{}")
        assert answered_by_port(headers) == stack.frontend.port, (path, status, raw[:300])
    # Triton's own paths (all under /v2/) still go to Triton
    status, _, headers = get(f"{stack.http_url}/v2/health/ready")
    assert status == 200 and answered_by_port(headers) == stack.server.http_port


def openai_shape(reply: dict, status: int) -> str:
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    kind = {413: "BadRequestError", 503: "ServiceUnavailableError"}[status]
    assert reply["error"]["type"] == kind and reply["error"]["param"] is None and reply["error"]["code"] == status, reply
    return reply["error"]["message"]


def cohere_shape(reply: dict, status: int) -> str:
    assert set(reply) == {"message"}, reply
    return reply["message"]


def tei_shape(reply: dict, status: int) -> str:
    assert set(reply) == {"error", "error_type"}, reply
    assert reply["error_type"] == {413: "Validation", 503: "Unhealthy"}[status], reply
    return reply["error"]


def triton_shape(reply: dict, status: int) -> str:
    assert set(reply) == {"error"} and isinstance(reply["error"], str), reply
    return reply["error"]


SHAPES = {"/v1/rerank": openai_shape, "/score": openai_shape, "/generative_scoring": openai_shape,
          "/v1/decisions": openai_shape, "/v1/systemone": openai_shape, "/v1/embeddings": openai_shape,
          "/classify": openai_shape, "/pooling": openai_shape, "/v2/rerank": cohere_shape, "/v2/embed": cohere_shape,
          "/rerank": tei_shape, "/embed": tei_shape, "/predict": tei_shape, "/v2/models/prefillonly/generate": triton_shape}


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank", "/v2/models/prefillonly/generate", "/v1/decisions",
                                  "/v1/systemone", "/v2/embed", "/embed", "/classify"])
def test_too_large_body_is_refused_in_the_routes_error_shape(stack, path):
    status, raw, headers = post(stack.http_url + path, TOO_LARGE)
    assert status == 413 and headers["content-type"] == "application/json", (status, raw[:300])
    message = SHAPES[path](json.loads(raw), 413)
    assert message.startswith("invalid_request") and "max_request_bytes" in message, message


def test_still_serving_after_the_refusals(stack):
    status, raw, _ = post(f"{stack.http_url}/v1/rerank", json.dumps({"model": "plain", "query": "q", "documents": ["a"]}).encode())
    assert status == 200 and len(json.loads(raw)["results"]) == 1, (status, raw[:300])
    assert stack.server.poll() is None and stack.restarts == 0


def test_no_healthy_upstream_is_a_503_in_the_routes_error_shape():
    """Nothing listens on any upstream port: every cluster has no healthy host."""
    http_port, grpc_port, frontend_port = free_ports(3)
    front = FrontDoor([Upstream("127.0.0.1", http_port, grpc_port, frontend_port)], http_port=0, grpc_port=0,
                      health_check_interval_s=0.2)
    with EnvoyProxy(front).start().wait_ready(30) as proxy:
        for path, shape in {**SHAPES, "/rerank?raw_scores=true": tei_shape, "/health": triton_shape}.items():
            status, raw, headers = post(proxy.http_url + path, b"{}")
            assert status == 503 and headers["content-type"] == "application/json", (path, status, raw[:300])
            message = shape(json.loads(raw), 503)
            assert message.startswith("unavailable: ") and "retry" in message, (path, message)
