"""Faults a hostile or unlucky client can cause, against the real serve stack (Envoy in front of a
real tritonserver, supervised: prefillonly.serving.host.supervisor) on the small random-weight model.

Each test reproduces one defect the server had and asserts the fixed behaviour: bodies over
~4 MiB crashed Triton; the `triton_grpc_error` header crashed it; a killed engine was never
restarted and its requests were never answered; SIGTERM with a long backlog lost requests; one
request could fill the queue; a huge prompt or a format-spec template stalled every client; the
admin APIs were open. Then a bounded property-based fuzz of the request schema over HTTP
generate and gRPC streaming: one final response each, and a live server after.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from clients.transport import GrpcStream, http_generate, post
from prefillonly.serving.host.addresses import free_ports
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.probe import ready_status
from prefillonly.serving.host.supervisor import ServeOptions, Supervisor
from prefillonly.serving.host.triton_server import ADMIN_KEY_HEADER

from .test_triton_lifecycle import in_background
from ..conftest import SAME_KERNELS

REPO = Path(__file__).resolve().parents[2] / "model_repository"
ADMIN_KEY = "test-admin-key"
LONG = [5] * 6000  # token ids: a second or more on one thread on the small model


def generate(url, body, timeout=120):
    """HTTP generate: (status, reply, seconds)."""
    t0 = time.perf_counter()
    status, reply = http_generate(url, body, timeout)
    return status, reply, time.perf_counter() - t0


def serve_options(repo, **kw) -> ServeOptions:
    http, grpc, metrics = free_ports(3)
    return ServeOptions(model_repository=str(repo), http_port=http, grpc_port=grpc, metrics_port=metrics,
                        admin_key=ADMIN_KEY, ready_timeout_s=180, **kw)


@contextlib.contextmanager
def supervised(folder, model, probe_interval_s: float = 1.0, models=("prefillonly",), **serve_kw):
    """The serve stack as `scripts/serve.sh` runs it (Envoy + supervised Triton and the scoring
    frontend, its watchdog running), on the small model; `serve_kw`: more ServeOptions."""
    # the kernels fixed, so the numbers equal an in-process engine's (conftest.SAME_KERNELS)
    repo = copy_model_repository(REPO, folder / "repo", models=models, model=model, dtype="float32", threads="1",
                                 **SAME_KERNELS)
    sup = Supervisor(serve_options(repo, probe_interval_s=probe_interval_s, probe_timeout_s=60, **serve_kw), say=lambda m: None)
    stop = threading.Event()
    try:
        assert sup.start(stop)
        threading.Thread(target=sup.watch, args=(stop,), daemon=True).start()
        yield sup
    finally:
        stop.set()
        sup.stop(timeout=30)


@pytest.fixture(scope="module")
def front(tmp_path_factory, small_served_model):
    with supervised(tmp_path_factory.mktemp("faults"), small_served_model) as sup:
        yield sup


def assert_still_serving(sup):
    status, reply, _ = generate(sup.http_url, {"text_input": "Hi", "allowed_tokens": [" Yes"]})
    assert status == 200 and "chosen_token" in reply, (status, reply)
    assert sup.server.poll() is None and sup.restarts == 0, (sup.server.poll(), sup.restarts, sup.server.log_tail())


def test_json_body_over_4_mib_is_refused_by_the_front_door(front):
    """Item 1: 4,194,353 bytes crashed Triton 2.51 (SIGSEGV). Envoy refuses it with 413."""
    body = json.dumps({"text_input": "hello world " * 349525, "allowed_tokens": [" Yes"]}).encode()
    assert len(body) > 4 * 2**20
    for path in ("/v2/models/prefillonly/generate", "/v2/models/prefillonly/infer"):
        status, reply, _ = post(front.http_url + path, body)
        error = json.loads(reply)["error"]
        assert status == 413 and error.startswith("invalid_request") and "max_request_bytes" in error, (status, reply[:300])
    assert_still_serving(front)


def test_grpc_error_header_no_longer_crashes_the_server(front):
    """Item 2: with `triton_grpc_error: true`, an error on a stream while another request on it
    was in flight crashed Triton. The front door strips the header: the error comes back as a
    message and the stream stays open."""
    stream = GrpcStream(front.grpc_url, headers={"triton_grpc_error": "true"})
    try:
        stream.send({"input_ids": [5] * 4000, "allowed_token_ids": [1]}, "long")
        time.sleep(0.3)
        stream.send({"text_input": "no allowed tokens"}, "bad")
        answers = [stream.get() for _ in range(2)]
        errors = [e.message() for _, e in answers if e is not None]
        results = [r for r, e in answers if e is None]
        assert len(results) == 1 and len(errors) == 1 and errors[0].startswith("invalid_request"), (errors, results)
        stream.send({"text_input": "Hi", "allowed_tokens": " Yes"}, "after")
        result, error = stream.get()
        assert error is None and result.as_numpy("chosen_token") is not None
    finally:
        stream.close()
    assert_still_serving(front)


def test_one_request_cannot_fill_the_queue_or_the_tokenizer(front):
    """Item 6: 1,100 prompts in one request was answered `overloaded` on an idle server (a
    retry-later code for a request that can never succeed). Every per-request count has a limit,
    refused as invalid_request naming it."""
    cases = [
        ({"text_input": ["Is it? Answer:"] * 1100, "allowed_tokens": [" Yes"]}, "max_prompts_per_request"),
        ({"text_input": "Profile.", "items": ["x"] * 1000, "allowed_tokens": [" Yes"]}, "max_items"),
        ({"text_input": "Hi", "allowed_token_ids": list(range(300))}, "max_allowed_tokens"),
    ]
    # a field that is not an input (HTTP generate makes it a request parameter) is refused, not ignored
    status, reply, _ = generate(front.http_url, {"text_input": "Hi", "allowed_tokens": [" Yes"], "temperature": 0.5})
    assert status == 400 and reply["error"].startswith("invalid_request: unknown field(s) temperature"), reply
    for body, limit in cases:
        status, reply, seconds = generate(front.http_url, body)
        assert status == 400 and reply["error"].startswith("invalid_request") and limit in reply["error"], (limit, reply)
        assert seconds < 5, seconds
    assert_still_serving(front)


def test_a_huge_prompt_is_refused_before_tokenizing_and_stalls_nobody(front):
    """Item 7: a 20 MB prompt was tokenized inside execute() (11-13 s) while every other client
    waited. Over gRPC (no body limit there) it is refused by its byte length at once; a prompt
    under the byte bound but over the token limit is tokenized off the thread that takes
    Triton's requests. A short request sent meanwhile is answered in well under the old stall."""
    stream = GrpcStream(front.grpc_url)
    try:
        stream.send({"text_input": "hello world " * 1_700_000, "allowed_tokens": " Yes"}, "huge")
        stream.send({"text_input": "hello world " * 100_000, "allowed_tokens": " Yes"}, "long-text")
        time.sleep(0.05)
        status, reply, seconds = generate(front.http_url, {"text_input": "Hi", "allowed_tokens": [" Yes"]})
        assert status == 200 and seconds < 2.0, (status, reply, seconds)
        errors = sorted(stream.get()[1].message() for _ in range(2))
    finally:
        stream.close()
    assert errors[0].startswith("invalid_request: text_input is 20,400,000 bytes") and "max_prompt_bytes" in errors[0], errors
    assert errors[1].startswith("prompt_too_long"), errors
    assert_still_serving(front)


def test_item_template_replaces_only_the_literal_item(front, small_served_model):
    """Item 7: item_template was a full str.format (`{item:>4000000}` took 7.5 s, attribute
    access was expanded). Now only `{item}` is replaced; everything else is text."""
    from transformers import AutoTokenizer

    status, reply, seconds = generate(front.http_url, {"text_input": "P", "items": ["x"], "item_template": "{item:>4000000}",
                                                       "allowed_tokens": [" Yes"]})
    assert status == 400 and "has no {item}" in reply["error"] and seconds < 2, (reply, seconds)
    template = " {item.__class__.__mro__} {0} {{item}} :{item}"
    status, reply, _ = generate(front.http_url, {"text_input": "P", "items": ["x"], "item_template": template,
                                                 "allowed_tokens": [" Yes"]})
    assert status == 200, reply
    tok = AutoTokenizer.from_pretrained(small_served_model)
    literal = template.replace("{item}", "x")
    assert literal == " {item.__class__.__mro__} {0} {x} :x"
    expected = len(tok.encode("P")) + len(tok.encode(literal, add_special_tokens=False))
    assert json.loads(reply["result_json"])["prompt_tokens"] == expected


def test_admin_apis_need_the_admin_key(front):
    """Item 8: logging and shared-memory registration were open to anyone reaching the port."""
    import tritonclient.grpc as grpcclient

    url = front.http_url
    status, reply, _ = post(f"{url}/v2/logging", b'{"log_verbose_level": 1}')
    assert status == 403 and ADMIN_KEY_HEADER in reply.decode(), (status, reply)
    status, _, _ = post(f"{url}/v2/systemsharedmemory/region/r/register", b'{"key": "/k", "offset": 0, "byte_size": 8}')
    assert status == 403
    status, _, _ = post(f"{url}/v2/repository/models/prefillonly/unload", b"{}")
    assert status == 403
    status, reply, _ = post(f"{url}/v2/logging", b'{"log_verbose_level": 0}', headers={ADMIN_KEY_HEADER: ADMIN_KEY})
    assert status == 200, reply
    with grpcclient.InferenceServerClient(front.grpc_url) as client:
        with pytest.raises(Exception, match="restricted"):
            client.update_log_settings({"log_verbose_level": 1})
        with pytest.raises(Exception, match="restricted"):
            client.register_system_shared_memory("r", "/k", 8)
        assert client.is_model_ready("prefillonly")  # the rest stays open
    assert_still_serving(front)


def test_fuzzed_requests_each_get_one_final_response(front):
    """Property-based fuzz of the request schema (HTTP generate and gRPC streaming), bounded:
    every request gets exactly one final answer (a result, or an error whose message starts with
    a code), and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from prefillonly.serving.model.protocol import INPUTS

    names = st.sampled_from(list(INPUTS) + ["bogus", "text_input"])
    scalars = st.one_of(st.text(max_size=40), st.integers(-2**63, 2**63 - 1), st.booleans(), st.none(),
                        st.floats(allow_nan=False, width=32))
    values = st.one_of(scalars, st.lists(scalars, max_size=5), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
    bodies = st.dictionaries(names, values, max_size=6)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies)
    def http_case(body):
        status, reply, _ = post(f"{front.http_url}/v2/models/prefillonly/generate", json.dumps(body).encode())
        parsed = json.loads(reply)  # always JSON, never a dropped connection
        assert (status == 200 and "chosen_token" in parsed) or (status >= 400 and parsed.get("error")), (body, status, reply)

    arrays = st.one_of(
        st.lists(st.text(max_size=20), max_size=4).map(lambda v: np.array([s.encode("utf-8", "surrogatepass") for s in v], dtype=np.object_)),
        st.lists(st.integers(-10, 60000), max_size=6).map(lambda v: np.array(v, dtype=np.int64)),
        st.lists(st.booleans(), min_size=1, max_size=2).map(lambda v: np.array(v, dtype=bool)),
        st.lists(st.floats(-1, 1, width=32), max_size=3).map(lambda v: np.array(v, dtype=np.float32)),
    )
    stream = GrpcStream(front.grpc_url)
    sent = [0]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(tensors=st.dictionaries(names, arrays, max_size=5))
    def grpc_case(tensors):
        stream.send(tensors, request_id=f"fuzz-{sent[0]}")
        sent[0] += 1
        result, error = stream.get(timeout=60)
        assert (error is None and result.as_numpy("chosen_token") is not None) or \
            (error is not None and error.message()), (tensors, error)

    try:
        http_case()
        grpc_case()
        with pytest.raises(queue.Empty):  # nothing answered twice
            stream.get(timeout=0.5)
    finally:
        stream.close()
    assert_still_serving(front)


def test_a_dead_front_door_is_restarted(front):
    """Envoy is a process too: if it dies, the supervisor starts it again on the same ports."""
    old = front.proxy.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while ready_status(front.http_url) != 200 or front.proxy.pid == old:
        assert time.monotonic() < deadline, "the front door did not come back"
        time.sleep(0.2)
    assert_still_serving(front)


def test_killed_engine_is_detected_answered_and_restarted(tmp_path, small_served_model):
    """Item 3: after kill -9 of the engine's process its requests were never answered, later ones
    hung, and readiness stayed 200. Now: not ready within seconds, every in-flight request gets an
    error, and the server serves again after the restart."""
    with supervised(tmp_path, small_served_model) as sup:
        http = [in_background(generate, sup.http_url, {"input_ids": LONG[:-i - 1], "allowed_token_ids": [1]}, 120)
                for i in range(3)]
        stream = GrpcStream(sup.grpc_url)
        stream.send({"input_ids": LONG, "allowed_token_ids": [1]})
        time.sleep(1.0)
        (stub,) = sup.server.stub_pids()
        os.kill(stub, signal.SIGKILL)
        t0 = time.monotonic()
        while ready_status(sup.http_url) == 200:
            assert time.monotonic() - t0 < 10, "still ready 10 s after the engine died"
            time.sleep(0.1)
        for t, _ in http:
            t.join(60)
        answers = [out.get("r") for _, out in http]
        assert all(a is not None and a[0] == 503 and a[1]["error"].startswith("unavailable") for a in answers), answers
        result, error = stream.get(timeout=60)
        assert result is None and "UNAVAILABLE" in error.status(), (result, error)
        stream.close()
        deadline = time.monotonic() + 120
        while ready_status(sup.http_url) != 200:
            assert time.monotonic() < deadline, sup.server.log_tail()
            time.sleep(0.5)
        assert sup.restarts == 1
        status, reply, _ = generate(sup.http_url, {"text_input": "Hi", "allowed_tokens": [" Yes"]})
        assert status == 200, reply


def test_sigterm_with_a_backlog_longer_than_the_exit_timeout_answers_every_request(tmp_path, small_served_model):
    """Item 4: with 16 stream requests and Triton's exit timeout shorter than the backlog, some
    were never answered. The serve command drains first: every waiting request is answered
    engine_closed, the running one finishes, and it exits 0 (promptly: no stream left open)."""
    repo = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), model=small_served_model,
                                 dtype="float32", threads="1")
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "prefillonly.serving", "serve", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--exit-timeout-secs", "15", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while ready_status(f"http://127.0.0.1:{http}") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "not ready"
            time.sleep(0.3)
        stream = GrpcStream(f"127.0.0.1:{grpc}")
        for i in range(16):  # ~16 x 2-3 s of work: far longer than the exit timeout
            stream.send({"input_ids": [5] * 8000, "allowed_token_ids": [1]}, f"r{i}")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        answers = [stream.get(timeout=60) for _ in range(16)]
        t0 = time.monotonic()
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 30
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = [e.message() for _, e in answers if e is not None]
    assert all(m.startswith("engine_closed") for m in errors), errors
    assert 16 - len(errors) >= 1  # the running one finished
