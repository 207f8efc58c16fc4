"""Server lifecycle with the prefillonly model on the small random-weight checkpoint: a full queue
refuses at once with the best status each call style allows, a client that cancels a waiting
request takes it out of the queue, and SIGTERM answers every request in flight."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from clients.transport import GrpcStream, post_json, unary_infer
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.prometheus import scrape_metrics
from prefillonly.serving.host.triton_server import running_server

REPO = Path(__file__).resolve().parents[2] / "model_repository"
LONG = [5] * 8000  # token ids: a few seconds of work on one thread on the small model
WAITING = 'prefillonly_waiting_requests'
CANCELLED = 'prefillonly_requests_total{outcome="cancelled"}'
HI = {"text_input": "Hi", "allowed_tokens": [" Yes"]}


def post(url, body, timeout=120):
    """HTTP generate on the prefillonly model: (status, body, seconds it took)."""
    t0 = time.perf_counter()
    status, reply = post_json(f"{url}/v2/models/prefillonly/generate", body, timeout)
    return status, reply, time.perf_counter() - t0


def in_background(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)), daemon=True)
    t.start()
    return t, out


def wait_for_metric(server, key, value, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (got := scrape_metrics(server.metrics_url).get(key)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got == value, f"{key} is {got}, expected {value}"


def stream_one(url, headers=None):
    """One request over a fresh gRPC stream: the InferenceServerException it got (or None)."""
    with GrpcStream(url, headers) as stream:
        return stream.call(HI, 30)[1]


def unary_error(protocol, url):
    """The exception a plain (unary) infer through the forwarder raises."""
    with pytest.raises(Exception) as info:
        unary_infer(url, HI, 30, protocol)
    return info.value


def test_full_queue_refused_at_once_with_status_per_call_style_and_cancel_frees_it(tmp_path, small_served_model):
    """max_waiting=1: one request runs, one waits (over a gRPC stream), the next is refused.
    Status per call style (Triton 2.51, see docs/serving.md "Errors"): forwarder HTTP /infer 503 and gRPC
    unary UNAVAILABLE; HTTP generate can only give 400 (Triton reads the status after freeing it)
    and a gRPC stream only a message, or UNAVAILABLE closing the stream when the client asks with
    the triton_grpc_error header. Every message starts with "overloaded". Then the waiting
    request's stream is cancelled: it leaves the queue, and the server keeps serving."""
    repo = copy_model_repository(REPO, tmp_path / "repo", model=small_served_model, dtype="float32",
                                 threads="1", max_waiting="1")
    with running_server(repo, ready_timeout=180) as server:
        busy, busy_out = in_background(post, server.http_url, {"input_ids": LONG, "allowed_token_ids": [1]})
        time.sleep(1.0)  # the long request is running
        waiter = GrpcStream(server.grpc_url)
        waiter.send({**HI, "text_input": "I wait"}, request_id="waiter-1")
        wait_for_metric(server, WAITING, 1)  # the queue is full ...
        assert waiter.answers.empty(), waiter.get(0)  # ... with the waiter (not the long one) in it

        status, body, seconds = post(server.http_url, HI)
        assert status >= 400 and body["error"].startswith("overloaded: 1 requests already waiting") and seconds < 2, \
            (status, body, seconds)
        status, body = post_json(f"{server.http_url}/v2/models/prefillonly_sync/infer",
                                 {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
                                             {"name": "allowed_tokens", "shape": [1], "datatype": "BYTES", "data": [" Yes"]}]})
        assert status == 503 and body["error"].startswith("overloaded"), (status, body)
        error = unary_error("http", server.http_url)
        assert error.status() == "503" and error.message().startswith("overloaded"), error
        error = unary_error("grpc", server.grpc_url)
        assert error.status() == "StatusCode.UNAVAILABLE" and error.message().startswith("overloaded"), error
        error = stream_one(server.grpc_url)
        assert error is not None and error.message().startswith("overloaded"), error
        error = stream_one(server.grpc_url, headers={"triton_grpc_error": "true"})
        assert error is not None and error.status() == "StatusCode.UNAVAILABLE" and "overloaded" in error.message(), error

        before = scrape_metrics(server.metrics_url).get(CANCELLED, 0)
        waiter.client.stop_stream(cancel_requests=True)  # the client gives up on the waiting request
        waiter.client.close()
        wait_for_metric(server, CANCELLED, before + 1)
        wait_for_metric(server, WAITING, 0)
        assert busy.is_alive(), "the long request ended before the cancellation was checked: make LONG longer"
        result, error = waiter.get(timeout=5)  # tritonclient tells the canceller itself
        assert result is None and error.status() == "StatusCode.CANCELLED", (result, error)
        busy.join(120)
        assert busy_out["r"][0] == 200
        assert post(server.http_url, HI)[0] == 200
        log = server.log_tail(10**7)
    assert "request 'waiter-1' failed: cancelled" in log  # one line, with the request id


def test_sigterm_answers_every_request_in_flight(tmp_path, small_served_model):
    repo = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), model=small_served_model,
                                 dtype="float32", threads="1")
    with running_server(repo, ready_timeout=180) as server:
        clients = [in_background(post, server.http_url, {"input_ids": LONG[:-i - 1], "allowed_token_ids": [1]}, 180)
                   for i in range(3)]
        time.sleep(1.0)
        server.send_signal(signal.SIGTERM)
        for t, _ in clients:
            t.join(180)
        answers = [out.get("r") for _, out in clients]
        assert all(a is not None for a in answers), answers  # nobody left hanging
        for status, body, _ in answers:
            assert status == 200 or body.get("error"), (status, body)
        assert server.poll() is not None or server.stop(60) is not None
