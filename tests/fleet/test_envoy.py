"""The Envoy front door (prefillonly.serving.host.envoy) with the real envoy binary: its config passes
`envoy --mode validate`; in front of a tiny HTTP upstream it refuses oversized bodies (sized or
chunked) with 413 and Triton's JSON error shape, strips triton_grpc_error, and answers 503
"unavailable" when the upstream is gone; in front of a real tritonserver HTTP generate, a gRPC
stream (with the crash-prone header stripped) and health checks work through it."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from clients.transport import GrpcStream, post_json
from prefillonly.serving.host.addresses import free_ports
from prefillonly.serving.host.envoy import EnvoyProxy
from prefillonly.serving.host.envoy_config import (FrontDoor, ProxyError, Upstream, endpoint_files, envoy_config,
                                                   validate_config)
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.triton_server import running_server

REPO = Path(__file__).resolve().parents[2] / "model_repository"
LIMIT = 100_000


def test_config_validates_for_one_and_three_upstreams_and_a_broken_one_is_refused_with_envoys_reason():
    one = envoy_config(FrontDoor([Upstream("127.0.0.1", 8100, 8101)]))
    three = envoy_config(FrontDoor([Upstream("127.0.0.1", 8100, 8101), Upstream("localhost", 8200, 8201),
                                    Upstream("triton-3.internal", 8300, 8301)], host="0.0.0.0", max_request_bytes=LIMIT))
    assert [c["type"] for c in one["static_resources"]["clusters"]] == ["STATIC", "STATIC"]
    # three replicas are a fleet: an affinity cluster and a least-request one per protocol (tests/fleet/test_deploy.py)
    assert [(c["name"], c["type"]) for c in three["static_resources"]["clusters"]] == [
        ("triton_http_affinity", "STRICT_DNS"), ("triton_http", "STRICT_DNS"),
        ("triton_grpc_affinity", "STRICT_DNS"), ("triton_grpc", "STRICT_DNS")]
    validate_config(one)
    validate_config(three)

    broken = json.loads(json.dumps(one))
    broken["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    with pytest.raises(ProxyError, match="NO_SUCH_POLICY"):
        validate_config(broken)


def test_each_replica_is_hashed_by_one_key_in_every_cluster_and_live_endpoints_come_from_files(tmp_path):
    ips = [Upstream("127.0.0.1", 8100 + 10 * i, 8101 + 10 * i) for i in range(3)]
    config = envoy_config(FrontDoor(ips))
    keys = {}
    for c in config["static_resources"]["clusters"]:
        endpoints = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
        keys[c["name"]] = [e["metadata"]["filter_metadata"]["envoy.lb"]["hash_key"] for e in endpoints]
    # the HTTP address names the replica in its gRPC cluster too: a user's HTTP and gRPC requests meet
    assert all(k == [u.key for u in ips] for k in keys.values()), keys
    assert [u.key for u in ips] == ["127.0.0.1:8100", "127.0.0.1:8110", "127.0.0.1:8120"]
    assert config["static_resources"]["clusters"][0]["lb_policy"] == "MAGLEV"  # the default
    # a DNS name resolves to many replicas: one key for all of them would stack them on one spot
    dns = envoy_config(FrontDoor([Upstream("replicas.internal", 8000, 8001)], fleet=True))
    assert all("metadata" not in e for c in dns["static_resources"]["clusters"]
               for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"])

    live = FrontDoor(ips, live_endpoints=True)
    with pytest.raises(ValueError, match="endpoints_dir"):
        envoy_config(live)
    with pytest.raises(ValueError, match="live_endpoints"):
        FrontDoor([Upstream("replicas.internal", 8000, 8001)], live_endpoints=True)
    config = envoy_config(live, tmp_path)
    clusters = config["static_resources"]["clusters"]
    assert {c["type"] for c in clusters} == {"EDS"} and not any("load_assignment" in c for c in clusters)
    files = endpoint_files(live)
    paths = {c["eds_cluster_config"]["eds_config"]["path_config_source"]["path"] for c in clusters}
    assert paths == {str(tmp_path / name) for name in files}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        (resource,) = json.loads(text)["resources"]
        assert [e["metadata"]["filter_metadata"]["envoy.lb"]["hash_key"] for e in resource["endpoints"][0]["lb_endpoints"]] == \
            [u.key for u in ips]
    validate_config(config)


# ---------------------------------------------------------------------------------------------
# a tiny upstream


class _Echo(http.server.BaseHTTPRequestHandler):
    """GET /v2/health/ready: 200. POST /status/503: a 503 of the upstream's own. Other POSTs: the
    body's length and the headers received, as JSON."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, status, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        # no keep-alive: a kept connection's handler thread would go on answering (health checks
        # included) after the server was shut down
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200 if self.path == "/v2/health/ready" else 404, {})

    def do_POST(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/status/503":
            self._reply(503, {"error": "overloaded: the upstream's own answer"})
        else:
            self._reply(200, {"length": len(body), "headers": {k.lower(): v for k, v in self.headers.items()}})


def request(url, body: bytes | None = None, headers=None, chunks=None, path="/v2/models/echo/generate"):
    """(status, headers, decoded JSON body) of a POST through http.client (chunked when `chunks`)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        if chunks is not None:
            conn.request("POST", path, body=iter(chunks), headers=headers or {}, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def host_health(proxy: EnvoyProxy) -> dict[str, str]:
    """'cluster/host:port' -> Envoy's health_flags for it ('healthy', '/failed_active_hc', ...)."""
    with urllib.request.urlopen(f"{proxy.admin_url}/clusters", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {f"{name}/{host}": value for name, host, key, value in
            (line.split("::", 3) for line in lines if "::health_flags::" in line) if key == "health_flags"}


def wait_health(proxy, cluster, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = {k: v for k, v in host_health(proxy).items() if k.startswith(cluster + "/")}
        if got and set(got.values()) == {want}:
            return
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def test_front_door_bounds_bodies_strips_the_header_and_says_unavailable(tmp_path):
    import tritonclient.grpc as grpcclient

    up_port, dead_grpc_port = free_ports(2)
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", up_port), _Echo)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    front = FrontDoor([Upstream("127.0.0.1", up_port, dead_grpc_port)], http_port=0, grpc_port=0,
                      max_request_bytes=LIMIT, health_check_interval_s=0.2)
    proxy = EnvoyProxy(front, log_path=tmp_path / "envoy.log").start()
    try:
        proxy.wait_ready(30)
        # ready means the first health-check round is done: the live upstream takes traffic at once
        status, _, reply = request(proxy.http_url, b"x" * (LIMIT - 1000),
                                   headers={"triton_grpc_error": "true", "X-Kept": "yes"})
        assert status == 200 and reply["length"] == LIMIT - 1000, (status, reply)
        assert "triton_grpc_error" not in reply["headers"] and reply["headers"]["x-kept"] == "yes", reply

        status, headers, reply = request(proxy.http_url, b"x" * (LIMIT + 1))
        assert status == 413 and headers["content-type"] == "application/json", (status, dict(headers))
        assert reply["error"].startswith("invalid_request: ") and f"{LIMIT} bytes" in reply["error"], reply

        status, headers, reply = request(proxy.http_url, chunks=[b"y" * 10_000] * 11)  # chunked, 110,000 bytes
        assert status == 413 and reply["error"].startswith("invalid_request: "), (status, reply)
        status, _, reply = request(proxy.http_url, chunks=[b"y" * 10_000] * 9)
        assert status == 200 and reply["length"] == 90_000, (status, reply)

        # the upstream's own 503 passes through untouched: the mappers rewrite Envoy's replies only
        status, _, reply = request(proxy.http_url, b"{}", path="/status/503")
        assert (status, reply) == (503, {"error": "overloaded: the upstream's own answer"})

        # nothing listens on the gRPC port: its health check failed, so Envoy has no healthy host
        assert all(v == "/failed_active_hc" for k, v in host_health(proxy).items() if k.startswith("triton_grpc/"))
        with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
            with pytest.raises(grpcclient.InferenceServerException) as info:
                client.is_server_live()
        assert info.value.status() == "StatusCode.UNAVAILABLE" and info.value.message().startswith("unavailable: "), \
            info.value

        upstream.shutdown()
        upstream.server_close()
        # at once (connect refused, health not yet failed) and after the health check took it out
        for _ in range(2):
            status, headers, reply = request(proxy.http_url, b"{}")
            assert status == 503 and headers["content-type"] == "application/json", (status, dict(headers), reply)
            assert reply["error"].startswith("unavailable: ") and "retry" in reply["error"], reply
            wait_health(proxy, "triton_http", "/failed_active_hc")
    finally:
        upstream.server_close()
        rc = proxy.stop()
    assert rc == 0 and proxy.poll() == 0 and proxy.stop() == 0  # stopped, idempotent


def test_in_front_of_a_real_tritonserver(tmp_path, small_served_model):
    repo = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), model=small_served_model,
                                 dtype="float32", threads="1")
    with running_server(repo, ready_timeout=180) as server:
        front = FrontDoor([Upstream("127.0.0.1", server.http_port, server.grpc_port)], http_port=0, grpc_port=0,
                          health_check_interval_s=0.5)
        with EnvoyProxy(front).start().wait_ready(30) as proxy:
            # Envoy's own health checks of both ports passed (the gRPC one via grpc.health.v1)
            assert set(host_health(proxy).values()) == {"healthy"}, host_health(proxy)
            with urllib.request.urlopen(f"{proxy.http_url}/v2/health/ready", timeout=10) as r:
                assert r.status == 200

            status, reply = post_json(f"{proxy.http_url}/v2/models/prefillonly/generate",
                                      {"text_input": "Hi", "allowed_tokens": [" Yes"]})
            assert status == 200 and "chosen_token" in reply, (status, reply)

            # a body over Triton's ~4 MiB crash size never reaches it
            status, reply = post_json(f"{proxy.http_url}/v2/models/prefillonly/generate",
                                      {"text_input": "x" * 4_500_000, "allowed_tokens": [" Yes"]})
            assert status == 413 and reply["error"].startswith("invalid_request: "), (status, reply)
            assert server.poll() is None and server.is_ready()

            good, bad = {"text_input": "Hi", "allowed_tokens": " Yes"}, {"text_input": "Hi"}
            with GrpcStream(proxy.grpc_url, headers={"triton_grpc_error": "true"}) as stream:
                assert stream.client.is_server_ready()
                stream.send(good, request_id="good-1")
                stream.send(bad, request_id="bad")
                stream.send(good, request_id="good-2")
                # answers come in any order (the bad request fails before the first one is scored);
                # an in-stream error carries no request id, a result does
                got = [stream.get(timeout=60) for _ in range(3)]
            errors = [error for result, error in got if error is not None]
            results = {result.get_response().id: result for result, error in got if error is None}
            # the header was stripped: Triton sent the error in the stream instead of ending it (sent
            # straight to Triton 2.51, the same three requests end the stream and the server dies)
            assert len(errors) == 1 and errors[0].message().startswith("invalid_request"), errors
            assert set(results) == {"good-1", "good-2"}, results
            assert all(r.as_numpy("chosen_token") is not None for r in results.values())
        assert server.poll() is None

