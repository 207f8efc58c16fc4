"""API keys, tenants and quotas on the real serve stack: Envoy checking keys in front of a real
tritonserver (the prefillonly model and its prefillonly_sync forwarder) and the scoring frontend, on
the small random-weight model, called with the real clients (tritonclient HTTP and gRPC, openai,
cohere) and raw HTTP.

- every route answers 401 to no key and to a wrong key, in its API's shape (gRPC UNAUTHENTICATED),
  and serves a right key; the health checks stay open;
- tenant A cannot hit, time or evict tenant B's cached prefix by sending B's user or B's tenant;
- over a tenant's quota (in flight, per second): 429 with Retry-After (gRPC: a rate_limited error),
  and the tenant's metrics count it;
- the key file rewritten under load: every request answered, new keys in, removed keys out.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from clients.transport import GrpcStream, post
from prefillonly.contract.tenants import TENANT_HEADER
from prefillonly.contract.wire import infer_inputs

from .test_faults import supervised

KEYS = {"alpha": "alpha-key-0123456789", "beta": "beta-key-0123456789a", "capped": "capped-key-0123456789",
        "metered": "metered-key-012345678"}
QUOTAS = {"capped": "in_flight=1", "metered": "rps=1"}
WRONG = "wrong-key-0123456789"
LONG = [5] * 6000  # token ids: a second or more on one thread on the small model
GENERATE = "/v2/models/prefillonly/generate"


def write_keys(path, keys: dict) -> None:
    path.write_text("".join(f"{key} {tenant} {QUOTAS.get(tenant, '')}\n" for tenant, key in keys.items()))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, small_served_model):
    folder = tmp_path_factory.mktemp("tenants")
    key_file = folder / "keys.txt"
    write_keys(key_file, KEYS)
    with supervised(folder, small_served_model, probe_interval_s=3600, models=("prefillonly", "prefillonly_sync"),
                    api_key_file=str(key_file)) as sup:
        sup.key_file = key_file
        yield sup


def bearer(tenant_or_key: str | None) -> dict:
    if tenant_or_key is None:
        return {}
    return {"Authorization": f"Bearer {KEYS.get(tenant_or_key, tenant_or_key)}"}


def call(sup, path: str, body=None, tenant: str | None = None, method: str = "POST"):
    """(status, decoded reply, headers) of one HTTP call through the front door."""
    if method == "GET":
        req = urllib.request.Request(sup.http_url + path, headers=bearer(tenant))
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read() or b"null"), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), e.headers
    status, reply, headers = post(sup.http_url + path, json.dumps(body).encode(), headers=bearer(tenant))
    return status, json.loads(reply or b"null"), headers


SCORE = {"text_input": "Is the sky blue? Answer:", "allowed_tokens": [" Yes", " No"]}
INFER = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Is it? Answer:"]},
                    {"name": "allowed_tokens", "shape": [1], "datatype": "BYTES", "data": [" Yes"]}]}
# (method, path, body, the 401 body's shape)
ROUTES = [
    ("POST", GENERATE, SCORE, "triton"),
    ("POST", "/v2/models/prefillonly_sync/infer", INFER, "triton"),
    ("GET", "/v2/models/prefillonly", None, "triton"),
    ("POST", "/v1/completions", {"model": "prefillonly", "prompt": "Is it? Answer:", "max_tokens": 1}, "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v2/rerank", {"model": "qwen3-reranker", "query": "q", "documents": ["a", "b"]}, "cohere"),
    ("POST", "/rerank", {"query": "q", "texts": ["a", "b"]}, "tei"),
]


def unauthenticated(shape: str, reply) -> str:
    """The message of a 401 reply in `shape`, checking the shape on the way."""
    if shape == "openai":
        assert reply["error"]["type"] == "AuthenticationError" and reply["error"]["code"] == 401, reply
        return reply["error"]["message"]
    if shape == "cohere":
        return reply["message"]
    if shape == "tei":
        assert reply["error_type"] == "Unauthorized", reply
    return reply["error"]


@pytest.mark.parametrize("method, path, body, shape", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_needs_a_right_key(keyed, method, path, body, shape):
    for key in (None, WRONG, "Bearer"):
        status, reply, headers = call(keyed, path, body, key, method)
        assert status == 401 and headers["www-authenticate"] == "Bearer", (key, status, reply)
        assert unauthenticated(shape, reply).startswith("unauthenticated: a missing or wrong API key"), reply
    status, reply, _ = call(keyed, path, body, "alpha", method)
    assert status == 200, (status, reply)


def test_health_checks_need_no_key(keyed):
    import tritonclient.grpc as grpcclient

    for path in ("/v2/health/ready", "/v2/health/live", "/health"):
        assert call(keyed, path, method="GET")[0] == 200, path
    client = grpcclient.InferenceServerClient(keyed.grpc_url)
    assert client.is_server_ready() and client.is_server_live()
    with pytest.raises(Exception, match="UNAUTHENTICATED|unauthenticated"):
        client.get_model_metadata("prefillonly")  # anything else needs the key


def test_grpc_stream_needs_a_key(keyed):
    for key, ok in ((None, False), (WRONG, False), ("beta", True)):
        stream = GrpcStream(keyed.grpc_url, headers={k.lower(): v for k, v in bearer(key).items()})
        if key is None:
            time.sleep(0.5)  # the refusal ends the stream before the request goes out (the other order: WRONG)
        try:
            result, error = stream.call(SCORE, 120)
        finally:
            stream.close()
        if ok:
            assert error is None and result.as_numpy("chosen_token") is not None
        else:
            assert error is not None and "UNAUTHENTICATED" in str(error.status()), error
            assert error.message().startswith("unauthenticated:"), error.message()


def test_the_real_clients_send_their_key(keyed):
    import cohere
    import openai

    base = keyed.http_url
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key=WRONG, max_retries=0).completions.create(
            model="prefillonly", prompt="Is it? Answer:", max_tokens=1)
    answer = openai.OpenAI(base_url=base + "/v1", api_key=KEYS["alpha"], max_retries=0).completions.create(
        model="prefillonly", prompt="Is it? Answer:", max_tokens=1)
    assert answer.choices and answer.choices[0].text is not None
    with pytest.raises(cohere.UnauthorizedError):
        cohere.ClientV2(api_key=WRONG, base_url=base).rerank(model="qwen3-reranker", query="q", documents=["a", "b"])
    ranked = cohere.ClientV2(api_key=KEYS["beta"], base_url=base).rerank(model="qwen3-reranker", query="q", documents=["a", "b"])
    assert sorted(r.index for r in ranked.results) == [0, 1]


# -- the cache is the tenant's ------------------------------------------------------------------------
def _cached(keyed, tenant: str, user: str, prompt_ids: list[int], **extra) -> int:
    status, reply, _ = call(keyed, GENERATE, {"input_ids": prompt_ids, "allowed_token_ids": [1], "user": user, **extra}, tenant)
    assert status == 200, reply
    return reply["cached_tokens"]


def test_a_tenant_cannot_hit_or_evict_anothers_cached_prefix(keyed):
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(10, 250, size=301)]  # fresh, odd length: nobody has it cached
    assert _cached(keyed, "alpha", "u1", prompt) == 0
    assert _cached(keyed, "alpha", "u1", prompt) > 0  # alpha's own cache
    # beta sending alpha's user, then alpha's tenant in the body (generate makes it a parameter): cold
    assert _cached(keyed, "beta", "u1", prompt) == 0
    assert _cached(keyed, "beta", "u1", prompt[:1] + prompt[1:], parameters={TENANT_HEADER: "alpha"}) > 0  # beta's now
    probe = [int(t) for t in rng.integers(10, 250, size=301)]
    _cached(keyed, "alpha", "u2", probe)
    assert _cached(keyed, "beta", "u2", probe, **{TENANT_HEADER: "alpha"}) == 0  # served as beta, not alpha
    # over gRPC a client's own tenant parameter comes beside the front door's: refused
    with GrpcStream(keyed.grpc_url, headers={"authorization": f"Bearer {KEYS['beta']}"}) as stream:
        fields = {"input_ids": probe, "allowed_token_ids": [1], "user": "u2"}
        stream.client.async_stream_infer(stream.model, infer_inputs(stream.module, fields), parameters={TENANT_HEADER: "alpha"})
        _, error = stream.get()
    assert error is not None and error.message().startswith("invalid_request") and "front door" in error.message(), error
    # nothing beta did touched alpha's entries
    assert _cached(keyed, "alpha", "u1", prompt) > 0 and _cached(keyed, "alpha", "u2", probe) > 0


# -- quotas ----------------------------------------------------------------------------------------------
def test_over_its_quota_a_tenant_gets_429_with_retry_after(keyed):
    import openai

    running = threading.Thread(target=lambda: call(keyed, GENERATE, {"input_ids": LONG, "allowed_token_ids": [1]}, "capped"))
    running.start()
    try:
        time.sleep(0.3)  # the long request holds capped's one slot
        status, reply, headers = call(keyed, GENERATE, SCORE, "capped")
        assert status == 429 and reply["error"].startswith("rate_limited: tenant 'capped'"), (status, reply)
        assert int(headers["retry-after"]) >= 1
        status, reply, headers = call(keyed, "/v1/completions", {"model": "prefillonly", "prompt": "Hi", "max_tokens": 1}, "capped")
        assert status == 429 and reply["error"]["type"] == "RateLimitError" and int(headers["retry-after"]) >= 1, reply
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=keyed.http_url + "/v1", api_key=KEYS["capped"], max_retries=0).completions.create(
                model="prefillonly", prompt="Hi", max_tokens=1)
        assert call(keyed, GENERATE, SCORE, "alpha")[0] == 200  # other tenants are served meanwhile
    finally:
        running.join()
    assert call(keyed, GENERATE, SCORE, "capped")[0] == 200  # the slot came back with the answer


def test_requests_per_second_quota_over_grpc_and_http(keyed):
    time.sleep(1.1)  # a full bucket: one request
    stream = GrpcStream(keyed.grpc_url, headers={"authorization": f"Bearer {KEYS['metered']}"})
    try:
        first = stream.call(SCORE, 120)
        second = stream.call(SCORE, 120)
    finally:
        stream.close()
    assert first[1] is None
    assert second[1] is not None and second[1].message().startswith("rate_limited: tenant 'metered'"), second
    assert "retry after" in second[1].message()


def _tenant_samples(keyed) -> dict:
    from prefillonly.serving.host import prometheus

    with urllib.request.urlopen(keyed.metrics_url, timeout=10) as r:
        samples = prometheus.parse(r.read().decode())
    return {(s.name, s.labels.get("tenant"), s.labels.get("outcome") or s.labels.get("source")): s.value for s in samples
            if s.name.startswith("prefillonly_tenant_")}


def test_metrics_count_by_tenant_also_through_the_scoring_apis(keyed):
    call(keyed, GENERATE, SCORE, "beta")
    before = _tenant_samples(keyed)
    assert before[("prefillonly_tenant_requests_total", "beta", "completed")] >= 1
    assert before[("prefillonly_tenant_prompt_tokens_total", "beta", "computed")] > 0
    assert ("prefillonly_tenant_in_flight", "beta", None) in before
    assert not any(t in (None, "") for _, t, _ in before)
    # the frontend's own engine calls carry the caller's tenant (one rerank: one engine request)
    assert call(keyed, "/v1/rerank", {"model": "qwen3-reranker", "query": "q", "documents": ["a", "b"]}, "beta")[0] == 200
    after = _tenant_samples(keyed)
    assert after[("prefillonly_tenant_started_total", "beta", None)] == before[("prefillonly_tenant_started_total", "beta", None)] + 1
    assert after[("prefillonly_tenant_queue_seconds_total", "beta", None)] >= before[("prefillonly_tenant_queue_seconds_total", "beta", None)]
    # a multi-item request's tokens count once: its shared prompt and each item, not the prompt per item
    tokens = lambda samples: sum(samples[("prefillonly_tenant_prompt_tokens_total", "beta", s)] for s in ("computed", "cache"))  # noqa: E731
    before = _tenant_samples(keyed)
    body = {"input_ids": list(range(10, 111)), "item_ids": list(range(20, 35)), "item_lengths": [5, 4, 6], "allowed_token_ids": [1]}
    assert call(keyed, GENERATE, body, "beta")[0] == 200
    assert tokens(_tenant_samples(keyed)) - tokens(before) == 101 + 15


# -- keys change under load ------------------------------------------------------------------------------
def test_the_key_file_rewritten_under_load_loses_nothing(keyed):
    answers, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            answers.append(call(keyed, GENERATE, SCORE, "beta")[0])

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        gamma = "gamma-key-0123456789"
        for round_ in range(4):
            keys = dict(KEYS, gamma=gamma) if round_ % 2 == 0 else KEYS
            write_keys(keyed.key_file, keys)
            keyed.reload_keys()  # what SIGHUP does (the watchdog would also see the file change)
            deadline = time.monotonic() + 10
            want = 200 if "gamma" in keys else 401
            while call(keyed, GENERATE, SCORE, gamma)[0] != want:
                assert time.monotonic() < deadline, f"round {round_}: gamma's key not {want}"
                time.sleep(0.1)
    finally:
        stop.set()
        for w in workers:
            w.join()
        write_keys(keyed.key_file, KEYS)
        keyed.reload_keys()
    assert answers and set(answers) == {200}, {s: answers.count(s) for s in set(answers)}



def test_refusals_are_counted_by_the_front_door(keyed):
    def unauthorized() -> int:
        with urllib.request.urlopen(keyed.proxy.admin_url + "/stats?filter=api_key_auth.unauthorized", timeout=10) as r:
            return sum(int(line.rsplit(":", 1)[1]) for line in r.read().decode().splitlines() if line.strip())

    before = unauthorized()
    call(keyed, GENERATE, SCORE, WRONG)
    call(keyed, "/v1/models", None, None, "GET")
    assert unauthorized() == before + 2


@pytest.mark.parametrize("protocol", ["http", "grpc", "infer"])
def test_the_python_client_sends_its_key(keyed, protocol):
    from clients.prefillonly_client import PrefillOnlyClient, PrefillOnlyClientError

    url = keyed.grpc_url if protocol == "grpc" else keyed.http_url
    with PrefillOnlyClient(url, protocol, api_key=KEYS["alpha"]) as client:
        assert client.score("Is it? Answer:", [" Yes", " No"])["chosen"]["text"] in (" Yes", " No")
    with PrefillOnlyClient(url, protocol, api_key=WRONG) as client:
        with pytest.raises(PrefillOnlyClientError, match="unauthenticated"):
            client.score("Is it? Answer:", [" Yes"])


def test_the_forwarder_keeps_the_tenant(keyed):
    """HTTP /infer on prefillonly_sync: Triton passes the tenant header to the forwarder, which passes
    it on to the engine's model with the request."""
    from clients.prefillonly_client import PrefillOnlyClient

    prompt = [int(t) for t in np.random.default_rng().integers(10, 250, size=257)]
    assert _cached(keyed, "alpha", "u3", prompt) == 0
    with PrefillOnlyClient(keyed.http_url, "infer", api_key=KEYS["beta"]) as beta:
        assert beta.score(prompt, [1], user="u3")["cached_tokens"] == 0
    with PrefillOnlyClient(keyed.http_url, "infer", api_key=KEYS["alpha"]) as alpha:
        assert alpha.score(prompt, [1], user="u3")["cached_tokens"] > 0


def test_the_serve_command_takes_keys_and_rereads_them_on_sighup(tmp_path, small_served_model):
    import signal
    import subprocess
    import sys

    from prefillonly.serving.host.addresses import free_ports
    from prefillonly.serving.host.model_settings import copy_model_repository
    from prefillonly.serving.host.probe import ready_status

    from .test_faults import REPO

    repo = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), model=small_served_model,
                                 dtype="float32", threads="1")
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEYS['alpha']} alpha\n")
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "prefillonly.serving", "serve", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--api-key-file", str(keys), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 180
        while ready_status(url) != 200:  # the readiness path needs no key
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.3)
        assert any("1 API key(s) of 1 tenant(s): alpha" in line for line in lines), lines
        assert post(url + GENERATE, json.dumps(SCORE).encode())[0] == 401
        assert post(url + GENERATE, json.dumps(SCORE).encode(), headers=bearer("alpha"))[0] == 200
        proc.send_signal(signal.SIGHUP)  # the file unchanged: only the signal makes it re-read
        deadline = time.monotonic() + 10
        while not any("API keys reloaded" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines[-20:])
            time.sleep(0.1)
        assert post(url + GENERATE, json.dumps(SCORE).encode(), headers=bearer("alpha"))[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_behind_the_front_door_a_request_without_its_tenant_is_refused(keyed):
    """Triton's own port (127.0.0.1) is reached only by the serve command's parts; a request there
    without the tenant Envoy sets is refused, but for the supervisor's liveness probe."""
    from prefillonly.serving.host.probe import probe

    status, reply, _ = post(keyed.server.http_url + GENERATE, json.dumps(SCORE).encode())
    assert status == 400 and b"came without its tenant" in reply, reply
    alive, what = probe(keyed.server.http_url, timeout=60)
    assert alive, what


def test_a_rewritten_key_file_is_picked_up_without_a_signal(keyed):
    """The supervisor's watchdog sees the key file change (a Kubernetes Secret updated in place) and
    reloads it: no SIGHUP, no reload call."""
    delta = "delta-key-0123456789"

    def until(want: int) -> None:
        deadline = time.monotonic() + 15
        while call(keyed, GENERATE, SCORE, delta)[0] != want:
            assert time.monotonic() < deadline, f"delta's key not {want}"
            time.sleep(0.2)

    try:
        write_keys(keyed.key_file, dict(KEYS, delta=delta))
        until(200)
    finally:
        write_keys(keyed.key_file, KEYS)
    until(401)
