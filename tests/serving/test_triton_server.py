"""The prefillonly Triton model on a real tritonserver, through real tritonclient HTTP and gRPC
clients: results equal Engine.score on the same input, bad input gets an error naming the
problem while the server keeps serving, multi-item, concurrent gRPC streams, metrics, warm-up.
Most tests run on a small random-weight model (tests/conftest.py SERVING_CONFIG, with the default
model's tokenizer); one runs on the default model."""

from __future__ import annotations

import ast
import json
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from clients.transport import GrpcStream, post_json, unary_infer
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.prometheus import scrape_metrics
from prefillonly.serving.host.triton_server import running_server

from ..conftest import SAME_KERNELS

REPO = Path(__file__).resolve().parents[2] / "model_repository"
PROMPT = "Is the sky blue on a clear day? Answer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_served_model):
    # fp32, one thread and the same kernels on both sides, so that the server's numbers equal an in-process
    # Engine's (conftest.SAME_KERNELS: "auto" picks by timing, and two processes may pick differently)
    repo = copy_model_repository(REPO, tmp_path_factory.mktemp("server") / "repo", model=small_served_model,
                                 dtype="float32", threads="1", **SAME_KERNELS)
    with running_server(repo, ready_timeout=180) as s:
        yield s


@pytest.fixture(scope="module")
def engine(small_served_model):
    from prefillonly import Engine, EngineConfig

    with Engine(EngineConfig(model=small_served_model, dtype="float32", threads=1, **SAME_KERNELS)) as e:
        yield e


def generate(server, body: dict) -> tuple[int, dict]:
    return post_json(f"{server.http_url}/v2/models/prefillonly/generate", body)


def test_http_generate_equals_engine_score(server, engine):
    status, out = generate(server, {"text_input": PROMPT, "allowed_tokens": [" Yes", " No"], "top_k": 2})
    assert status == 200, out
    want = engine.score(PROMPT, [" Yes", " No"], top_k=2)
    result = json.loads(out["result_json"])
    assert [t["text"] for t in result["tokens"]] == [" Yes", " No"]
    for got, exp in zip(result["tokens"], want.tokens):
        assert got["logprob"] == pytest.approx(exp.logprob, abs=1e-4)
    assert out["chosen_token"] == want.chosen.text and len(result["top_k"]) == 2


def test_http_generate_multi_item_and_several_prompts(server, engine):
    status, out = generate(server, {"text_input": "User likes hiking.", "items": ["Alpine trails", "Stock news"],
                                    "item_template": "\nPost: {item}\nClick? Answer:", "allowed_tokens": [" Yes", " No"]})
    assert status == 200, out
    assert len(out["result_json"]) == 2 and len(out["allowed_probs"]) == 4
    want = engine.score_items("User likes hiking.", ["Alpine trails", "Stock news"], [" Yes", " No"],
                              item_template="\nPost: {item}\nClick? Answer:")
    for got, exp in zip(out["result_json"], want):
        assert json.loads(got)["tokens"][0]["logprob"] == pytest.approx(exp.tokens[0].logprob, abs=1e-4)
    status, out = generate(server, {"text_input": [PROMPT, "Is fire cold? Answer:"], "allowed_token_ids": [9230, 2838]})
    assert status == 200 and len(out["chosen_token_id"]) == 2


def test_loglikelihood_and_prompt_logprobs_tasks_equal_the_engine(server, engine):
    """The two logprob tasks through HTTP generate and, for the forwarder, plain gRPC infer."""
    context, choices = "Question: is the sky blue?\nAnswer:", [" yes", " no", " it is green"]
    status, out = generate(server, {"text_input": context, "items": choices, "task": "loglikelihood"})
    assert status == 200, out
    want = engine.loglikelihood(context, choices)
    got = [json.loads(x) for x in out["result_json"]]
    assert [g["tokens"] for g in got] == [w.tokens for w in want] and [g["is_greedy"] for g in got] == [w.is_greedy for w in want]
    assert [g["logprob"] for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert out["prompt_tokens"] == [w.context_tokens + w.tokens for w in want] and "chosen_token" not in out
    status, out = generate(server, {"text_input": PROMPT, "task": "prompt_logprobs", "logprobs_start": 3, "top_k": 2})
    assert status == 200, out
    span = engine.prompt_logprobs(PROMPT, start=3, top_k=2)
    got = json.loads(out["result_json"])
    assert got["start"] == 3 and got["token_logprobs"] == pytest.approx(span.token_logprobs, abs=1e-4)
    assert [[t["id"] for t in row] for row in got["top_k"]] == [[t.id for t in row] for row in span.top_k]
    result = unary_infer(server.grpc_url, {"input_ids": [1, 2, 3, 4], "item_ids": [5, 6, 7], "item_lengths": [1, 2],
                                           "task": "loglikelihood"}, 120, "grpc")
    assert [json.loads(x)["tokens"] for x in result.as_numpy("result_json")] == [1, 2]


def test_the_embed_task_through_generate_and_the_forwarder(server, engine):
    """A causal LM embeds (its last token, normalised): HTTP generate's JSON, and the forwarder's
    [results, dimensions] tensor over plain gRPC infer; classify is refused naming the checkpoint."""
    texts = [PROMPT, "Is fire cold? Answer:"]
    status, out = generate(server, {"text_input": texts[0], "task": "embed", "dimensions": 32, "normalize": False})
    assert status == 200 and "chosen_token" not in out, out
    want = engine.embed(texts[0], dimensions=32, normalize=False)
    assert json.loads(out["result_json"])["embedding"] == pytest.approx(want.embedding, abs=1e-4)
    assert out["embedding"] == pytest.approx(want.embedding, abs=1e-4)
    result = unary_infer(server.grpc_url, {"text_input": texts, "task": "embed", "dimensions": 16}, 120, "grpc")
    vectors = result.as_numpy("embedding")
    assert vectors.shape == (2, 16) and str(vectors.dtype) == "float32"
    for got, exp in zip(vectors, engine.embed(texts, dimensions=16)):
        assert got.tolist() == pytest.approx(exp.embedding, abs=1e-4)
    status, out = generate(server, {"text_input": PROMPT, "task": "classify"})
    assert status == 400 and "needs a sequence classifier" in out["error"] and "LlamaForCausalLM" in out["error"], out


@pytest.mark.parametrize("body,needle", [
    ({"text_input": PROMPT, "task": "generate"}, "unknown task 'generate'"),
    ({"text_input": PROMPT, "task": "loglikelihood"}, "needs the continuations as items"),
    ({"text_input": PROMPT, "task": "prompt_logprobs", "top_k": 50}, "top_k 50 must be between 0 and 20"),
    ({"text_input": PROMPT, "task": "prompt_logprobs", "logprobs_start": 500}, "start must be an integer in"),
    ({"input_ids": [1, 2], "item_ids": [999999], "item_lengths": [1], "task": "loglikelihood"}, "outside the vocabulary"),
])
def test_bad_task_input_is_an_error_and_the_server_keeps_serving(server, body, needle):
    status, out = generate(server, body)
    assert status == 400 and needle in out.get("error", ""), (status, out)
    status, out = generate(server, {"text_input": PROMPT, "allowed_tokens": [" Yes", " No"]})
    assert status == 200


@pytest.mark.parametrize("body,needle", [
    ({"allowed_tokens": [" Yes"]}, "missing prompt"),
    ({"text_input": PROMPT}, "missing allowed tokens"),
    ({"text_input": PROMPT, "allowed_tokens": ["Yes please"]}, "encodes to 2 tokens"),
    ({"text_input": PROMPT, "allowed_token_ids": [999999]}, "outside the vocabulary"),
    ({"text_input": "x " * 9000, "allowed_tokens": [" Yes"]}, "over the max input length"),
])
def test_bad_input_is_an_error_naming_the_problem_and_the_server_keeps_serving(server, body, needle):
    status, out = generate(server, body)
    assert status == 400 and needle in out.get("error", ""), (status, out)
    status, out = generate(server, {"text_input": PROMPT, "allowed_tokens": [" Yes", " No"]})
    assert status == 200


def test_grpc_streaming_concurrent_requests_each_answered_once(server, engine):
    prompts = [f"Question {i}: is {i} even? Answer:" for i in range(16)]
    with GrpcStream(server.grpc_url) as stream:
        for i, p in enumerate(prompts):
            stream.send({"text_input": p, "allowed_tokens": [" Yes", " No"]}, request_id=str(i))
        got = {}
        for _ in prompts:
            result, error = stream.get(timeout=120)
            assert error is None, error
            rid = result.get_response().id
            assert rid not in got
            got[rid] = result.as_numpy("allowed_logprobs")
    assert sorted(got, key=int) == [str(i) for i in range(16)]
    for i, p in enumerate(prompts):
        want = engine.score(p, [" Yes", " No"])
        assert got[str(i)].tolist() == pytest.approx([t.logprob for t in want.tokens], abs=1e-4)


def test_perf_analyzer_streaming_load_has_no_errors(server, tmp_path):
    """A short bounded perf_analyzer run (gRPC streaming, concurrency 2) on real prompts."""
    import subprocess

    from perf.perf_analyzer import perf_analyzer_env, perf_analyzer_path

    data = {"data": [{"text_input": {"content": [p], "shape": [1]}, "allowed_tokens": {"content": [" Yes", " No"], "shape": [2]}}
                     for p in ("Is the sky blue? Answer:", "Is water dry? Answer:", "Do fish swim? Answer:")]}
    (tmp_path / "inputs.json").write_text(json.dumps(data))
    pa = subprocess.run([str(perf_analyzer_path()), "-m", "prefillonly", "-u", server.grpc_url, "-i", "grpc", "--streaming",
                         "--input-data", str(tmp_path / "inputs.json"), "--concurrency-range", "2",
                         "--measurement-mode", "count_windows", "--measurement-request-count", "20", "-s", "999",
                         "--max-trials", "3"], env=perf_analyzer_env(), capture_output=True, text=True, timeout=300)
    assert pa.returncode == 0, pa.stdout[-3000:] + pa.stderr[-3000:]
    assert pa.returncode == 0 and "throughput:" in pa.stdout, pa.stdout[-3000:]  # perf_analyzer exits non-zero on any failed request


def test_plain_http_infer_and_grpc_unary_through_the_forwarder(server, engine):
    want = engine.score(PROMPT, [" Yes", " No"])
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        result = unary_infer(url, {"text_input": PROMPT, "allowed_tokens": [" Yes", " No"]}, 120, protocol)
        assert result.as_numpy("allowed_logprobs").tolist() == pytest.approx([t.logprob for t in want.tokens], abs=1e-4)
        with pytest.raises(Exception, match="missing allowed tokens") as info:
            unary_infer(url, {"text_input": PROMPT}, 120, protocol)
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")  # the caller's fault, not the server's


def test_metrics_endpoint_exports_engine_metrics_that_move(server):
    before = scrape_metrics(server.metrics_url)
    for _ in range(3):
        assert generate(server, {"text_input": PROMPT + " Really?", "allowed_tokens": [" Yes", " No"]})[0] == 200
    generate(server, {"text_input": PROMPT})  # a rejected request
    after = scrape_metrics(server.metrics_url)
    moved = lambda key, by: after[key] >= before.get(key, 0) + by  # noqa: E731
    assert moved('prefillonly_requests_total{outcome="completed"}', 3)
    tokens = [k for k in after if k.startswith("prefillonly_prompt_tokens_total")]
    assert tokens and sum(after[k] for k in tokens) > sum(before.get(k, 0) for k in tokens)
    for name in ("prefillonly_waiting_requests", "prefillonly_cache_bytes", "prefillonly_jct_estimate_error"):
        assert any(k.startswith(name) for k in after), name
    # what the fleet picker reads: the backlog (nothing waits on an idle server) and the JCT fit
    assert after["prefillonly_queued_work_seconds"] == 0
    terms = {t: after[f'prefillonly_jct_coefficient{{term="{t}"}}'] for t in ("fixed_s", "per_token_s", "attention_s")}
    assert all(v >= 0 for v in terms.values()), terms
    # request latency: a histogram per phase (queue wait, total)
    for phase in ("queue", "total"):
        assert moved(f'prefillonly_request_latency_seconds_count{{phase="{phase}"}}', 3), phase
        assert after[f'prefillonly_request_latency_seconds_sum{{phase="{phase}"}}'] > 0, phase
    assert any(k.startswith("prefillonly_request_latency_seconds_bucket") for k in after)
    # forward steps: tokens and requests per step, one observation per step run
    assert moved("prefillonly_step_requests_count", 3) and moved("prefillonly_step_tokens_count", 3)
    assert after["prefillonly_step_requests_sum"] >= before.get("prefillonly_step_requests_sum", 0) + 3
    assert after["prefillonly_step_tokens_sum"] > before.get("prefillonly_step_tokens_sum", 0)
    # and the worker's idle gap before each step (answers go out on another thread: small)
    assert moved("prefillonly_step_idle_gap_seconds_count", 3)
    gap_sum = after["prefillonly_step_idle_gap_seconds_sum"] - before.get("prefillonly_step_idle_gap_seconds_sum", 0)
    gaps = after["prefillonly_step_idle_gap_seconds_count"] - before.get("prefillonly_step_idle_gap_seconds_count", 0)
    assert 0 <= gap_sum / gaps < 0.5, (gap_sum, gaps)
    success = [k for k in after if k.startswith("nv_inference_request_success") and 'model="prefillonly"' in k]
    assert success and after[success[0]] >= 3  # Triton's own metrics stay right


def test_ready_only_after_a_warm_up_request(server):
    """initialize() runs one request through the engine before Triton reports ready; it is not
    counted as a served request."""
    values = scrape_metrics(server.metrics_url)
    assert values["prefillonly_warmup_seconds"] > 0
    assert "prefillonly: engine ready and warm" in server.log_tail(10**7)
    # the compute dtype and why: the ready log line and the info gauge (an explicit float32 here)
    assert "dtype float32: explicit" in server.log_tail(10**7)
    info = [k for k in values if k.startswith("prefillonly_engine_info")]
    assert len(info) == 1 and values[info[0]] == 1
    assert 'dtype="float32"' in info[0] and 'dtype_reason="explicit"' in info[0]


def test_default_model_over_http_generate(tmp_path):
    """The one server test on the embedded default model: real tokens, real probabilities, with
    the shipped config's dtype ("auto": what this host resolves it to), reported by the model."""
    from prefillonly import Engine, EngineConfig
    from prefillonly.hardware import cpu_flags, resolve_dtype
    from prefillonly.kernels import score_head
    from prefillonly.serving.host import prometheus

    assert 'key: "dtype" value: { string_value: "auto" }' in (REPO / "prefillonly" / "config.pbtxt").read_text()
    dtype, reason = resolve_dtype("auto", "cpu", cpu_flags())
    repo = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), threads="1")
    with running_server(repo, ready_timeout=180) as s:
        status, out = generate(s, {"text_input": PROMPT, "allowed_tokens": [" Yes", " No"]})
        info = [x for x in prometheus.scrape(s.metrics_url, timeout_s=30, attempts=50) if x.name == "prefillonly_engine_info"]
        log = s.log_tail(10**7)
    assert status == 200, out
    assert len(info) == 1 and info[0].value == 1.0
    labels = info[0].labels
    assert {k: labels[k] for k in ("dtype", "dtype_reason")} == {"dtype": dtype, "dtype_reason": reason}
    assert labels["attention_backend"] in ("cpu_flash", "sdpa") and labels["linear_backend"] in ("aten", "onednn"), labels
    assert labels["score_head"] in score_head.HEADS, labels
    assert labels["kernel_check"] == "none run", labels  # the Triton kernels' start-up check runs on CUDA only
    assert f"dtype {dtype}: {reason}" in log
    # the same settings in process, dtype auto too, on the backends the server timed for itself (two
    # processes may time a near tie differently, and the backends round bf16 differently)
    with Engine(EngineConfig(threads=1, attention_backend=labels["attention_backend"],
                             linear_backend=labels["linear_backend"])) as engine:
        want = engine.score(PROMPT, [" Yes", " No"])
    assert out["allowed_logprobs"] == pytest.approx([t.logprob for t in want.tokens], abs=1e-4)
    assert out["chosen_token"] == want.chosen.text == " Yes"


def test_error_status_by_code():
    from prefillonly.contract.errors import InvalidRequestError, OverloadedError
    from prefillonly.serving.model.protocol import error_reply

    assert error_reply(OverloadedError("1 requests already waiting")) == ("UNAVAILABLE", "overloaded: 1 requests already waiting")
    assert error_reply(InvalidRequestError("missing prompt")) == ("INVALID_ARG", "invalid_request: missing prompt")
    assert error_reply(CancelledError())[0] == "CANCELLED"
    assert error_reply(RuntimeError("boom\nline 2")) == ("INTERNAL", "internal: RuntimeError: boom line 2")


def test_forwarder_answers_each_code_with_the_engine_models_status(monkeypatch):
    """The forwarder imports only prefillonly.contract's wire and tenants (standard library: no engine, no
    torch in its 8 stubs), no copy of the codes, and recovers from a target's message the status the
    target chose."""
    import importlib.util
    import sys
    import types

    from prefillonly.contract.errors import EngineClosedError, InvalidRequestError, OverloadedError
    from prefillonly.serving.model.protocol import error_reply

    source = (REPO / "prefillonly_sync" / "1" / "model.py").read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert imported == {"prefillonly.contract.wire", "prefillonly.contract.tenants"} and "RETRY_LATER_CODES" not in source
    statuses = types.SimpleNamespace(UNAVAILABLE="UNAVAILABLE", INVALID_ARG="INVALID_ARG", INTERNAL="INTERNAL",
                                     CANCELLED="CANCELLED")  # pb_utils.TritonError's, by name
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(TritonError=statuses))
    spec = importlib.util.spec_from_file_location("prefillonly_sync_model", REPO / "prefillonly_sync" / "1" / "model.py")
    forwarder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forwarder)
    for error in (OverloadedError("1 waiting"), EngineClosedError("closed"), InvalidRequestError("bad"), CancelledError(),
                  RuntimeError("boom")):
        status, message = error_reply(error)
        assert forwarder.status_of(message) == status, message


# the client's embed and classify: tests/frontend/test_pooling_routes.py, on its embedding and classifier stacks
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_library(server, engine, protocol):
    from clients.prefillonly_client import PrefillOnlyClient, PrefillOnlyClientError

    url = server.http_url if protocol == "http" else server.grpc_url
    with PrefillOnlyClient(url, protocol) as c:
        r = c.score(PROMPT, [" Yes", 2838])
        want = engine.score(PROMPT, [" Yes", 2838])
        assert [t["logprob"] for t in r["tokens"]] == pytest.approx([t.logprob for t in want.tokens], abs=1e-4)
        ids = engine.encoder.tokenizer.encode(PROMPT)
        assert c.score(ids, [9230])["prompt_tokens"] == len(ids)
        assert len(c.score_many([PROMPT, "Is ice hot? Answer:"], [" Yes", " No"])) == 2
        items = c.score_items("User likes hiking.", ["Alpine trails", "Stock news"], [" Yes", " No"],
                              item_template="\nPost: {item}\nClick? Answer:")
        assert len(items) == 2 and all(abs(sum(t["prob"] for t in i["tokens"]) - 1) < 1e-5 for i in items)
        with pytest.raises(PrefillOnlyClientError, match="encodes to 2 tokens"):
            c.score(PROMPT, ["Yes please"])


def test_a_liveness_probe_during_a_long_step_is_answered_at_once(server):
    """A multi-item request is one step (a decision call of hundreds of questions too): the probe,
    which would wait for that step's end (and, past --probe-timeout, get the server restarted), is
    answered engine_busy at once while the step's forwards keep finishing."""
    import threading
    import time

    from prefillonly.serving.host.probe import probe

    words = " ".join(f"w{i}" for i in range(600))
    body = {"text_input": words, "items": [f"item {i}: {words[: 900]}" for i in range(32)], "allowed_tokens": [" Yes"]}
    done = {}
    long_request = threading.Thread(target=lambda: done.setdefault("r", generate(server, body)))
    long_request.start()
    answers = []
    time.sleep(0.5)
    while long_request.is_alive():
        t0 = time.monotonic()
        alive, what = probe(server.http_url, timeout=60)
        answers.append((alive, what, time.monotonic() - t0))
        time.sleep(0.2)
    long_request.join()
    assert done["r"][0] == 200, done["r"]
    busy = [a for a in answers if "engine_busy" in a[1]]
    assert busy and all(alive for alive, *_ in answers), answers
    assert all(seconds < 5.0 for _, _, seconds in busy), busy  # not queued behind the step: answered from its progress
