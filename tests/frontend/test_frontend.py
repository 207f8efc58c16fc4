"""The scoring APIs (prefillonly.frontend) through the real serve stack: Envoy in front, the
supervised tritonserver and the frontend process behind it, on the small random-weight model
in float32 with one thread, so that every route's numbers equal an in-process Engine's on the
same token ids. Clients are the official `cohere` and `openai` SDKs and plain HTTP."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest

from prefillonly.frontend.presets import PRESETS_FILE
from prefillonly.serving.host.prometheus import scrape_metrics
from prefillonly.contract.wire import USER_HEADER

from ..serving.test_faults import REPO, assert_still_serving
from .test_frontend_presets import published_qwen3_ids

QUERY = "What is the capital of France? The user wants a short factual answer about European geography."
DOCS = ["Paris is the capital and largest city of France.", "Berlin is the capital of Germany.",
        "The Eiffel Tower is in Paris.", "Bananas are yellow.", "  France's capital: Paris!  ", "été à Paris"]
TOL = 1e-5
TRUNCATED = "x-prefillonly-truncated-documents"



def post(url: str, body, headers=None) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_with_headers(url: str, body) -> tuple[int, object, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), {k.lower(): v for k, v in e.headers.items()}


def qwen3_relevance(engine, tokenizer, query, doc, instruction=None) -> float:
    """P("yes") renormalised over {yes, no} on the published Qwen3-Reranker token ids, in-process."""
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    return engine.score(published_qwen3_ids(tokenizer, query, doc, instruction), [yes, no]).tokens[0].prob


# -- rerank ------------------------------------------------------------------------------------


def test_cohere_sdk_rerank_equals_engine_on_the_published_template(stack, engine, tokenizer):
    import cohere

    client = cohere.ClientV2(base_url=stack.http_url, api_key="unused")
    reply = client.rerank(model="qwen3-reranker", query=QUERY, documents=DOCS, top_n=4)
    want = [qwen3_relevance(engine, tokenizer, QUERY, d) for d in DOCS]
    assert len(reply.results) == 4
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r.index for r in reply.results] == order[:4]
    for r in reply.results:
        assert r.relevance_score == pytest.approx(want[r.index], abs=TOL)
    assert reply.meta.tokens.input_tokens > 0


def test_jina_rerank_shape_documents_usage_and_instruction(stack, engine, tokenizer):
    instruction = "Find passages naming a capital city"
    status, out = post(f"{stack.http_url}/v1/rerank", {
        "model": "qwen3-reranker", "query": QUERY, "documents": [{"text": d} for d in DOCS], "instruction": instruction,
        "return_documents": True})
    assert status == 200, out
    assert set(out) == {"id", "model", "results", "usage"} and out["model"] == "qwen3-reranker"
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == len(DOCS)
    for r in out["results"]:
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(qwen3_relevance(engine, tokenizer, QUERY, DOCS[r["index"]], instruction), abs=TOL)
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0 and 0 <= usage["cached_tokens"] < usage["prompt_tokens"]


def test_vllm_rerank_path_and_tei_shape(stack, engine, tokenizer):
    status, vllm = post(f"{stack.http_url}/rerank", {"model": "qwen3-reranker", "query": QUERY, "documents": DOCS[:3], "top_n": 2})
    assert status == 200 and len(vllm["results"]) == 2, vllm
    # TEI: same path, a body with `texts`; the default preset (the first in the file) scores it
    status, tei = post(f"{stack.http_url}/rerank", {"query": QUERY, "texts": DOCS[:3], "return_text": True})
    assert status == 200 and isinstance(tei, list) and len(tei) == 3, tei
    want = {i: qwen3_relevance(engine, tokenizer, QUERY, d) for i, d in enumerate(DOCS[:3])}
    for r in tei:
        assert r["score"] == pytest.approx(want[r["index"]], abs=TOL) and r["text"] == DOCS[r["index"]]
    status, raw = post(f"{stack.http_url}/rerank", {"query": QUERY, "texts": DOCS[:3], "raw_scores": True})
    assert status == 200, raw
    for r in raw:  # the raw score is the log-odds of the relevance
        assert 1 / (1 + math.exp(-r["score"])) == pytest.approx(want[r["index"]], abs=TOL)


def test_rerank_of_100_documents_is_one_multi_item_request(stack):
    docs = [f"Document number {i}: " + "words about cities and rivers " * (i % 7 + 1) for i in range(100)]
    before = scrape_metrics(stack.metrics_url)
    status, out = post(f"{stack.http_url}/v1/rerank", {"model": "yes-no-judge", "query": QUERY, "documents": docs, "top_n": 10})
    after = scrape_metrics(stack.metrics_url)
    assert status == 200 and len(out["results"]) == 10, out
    key = next(k for k in after if k.startswith("nv_inference_request_success") and 'model="prefillonly"' in k)
    assert after[key] - before.get(key, 0) == 1
    ok = 'prefillonly_requests_total{outcome="completed"}'
    assert after[ok] - before.get(ok, 0) == 1


def test_user_is_the_cache_namespace(stack):
    body = {"model": "qwen3-reranker", "query": QUERY + " (namespace test)", "documents": DOCS[:2]}
    first = post(f"{stack.http_url}/v1/rerank", dict(body, user="alice"))[1]
    again = post(f"{stack.http_url}/v1/rerank", dict(body, user="alice"))[1]
    other = post(f"{stack.http_url}/v1/rerank", body, headers={USER_HEADER: "bob"})[1]
    assert first["usage"]["cached_tokens"] == 0
    assert again["usage"]["cached_tokens"] > 0  # alice's query prompt came from the prefix cache
    assert other["usage"]["cached_tokens"] == 0  # never across users
    # a user id that is not a valid header value goes upstream as its digest (wire.user_header_value)
    accented = [post(f"{stack.http_url}/v1/rerank", dict(body, user="élodie")) for _ in range(2)]
    assert [status for status, _ in accented] == [200, 200], accented
    assert accented[0][1]["usage"]["cached_tokens"] == 0 and accented[1][1]["usage"]["cached_tokens"] > 0


def test_long_document_cut_to_fit_by_default_refused_when_asked(stack):
    """As TEI (auto-truncate) and Cohere (never a length error): a document too long for the model
    is cut to fit and named in a header; `truncate: false` refuses it by index instead."""
    long_doc = "many words here " * 3000  # ~9K tokens: over the model's 8,192
    docs = ["short", long_doc]
    status, out = post(f"{stack.http_url}/v1/rerank", {"model": "plain", "query": "q", "documents": docs, "truncate": False})
    assert status == 400 and "documents[1]" in out["error"]["message"], out
    for body in ({}, {"max_tokens_per_doc": 50}, {"max_tokens_per_doc": 0}, {"truncation_side": "left"}):
        status, out, headers = post_with_headers(f"{stack.http_url}/v1/rerank",
                                                 {"model": "plain", "query": "q", "documents": docs, **body})
        assert status == 200 and len(out["results"]) == 2 and headers[TRUNCATED] == "1", (body, out)
    status, out = post(f"{stack.http_url}/rerank", {"query": "q", "texts": docs, "truncate": False})
    assert status == 422 and out["error_type"] == "Validation" and "documents[1]" in out["error"], out
    for body in ({}, {"truncate": None}, {"truncate": True, "truncation_direction": "Left"}):
        status, out = post(f"{stack.http_url}/rerank", {"query": "q", "texts": docs, **body})
        assert status == 200 and len(out) == 2, (body, out)


# -- score ---------------------------------------------------------------------------------------


def test_sglang_score_text_and_ids_equal_engine(stack, engine, tokenizer):
    labels = [tokenizer.encode(" Yes")[0], tokenizer.encode(" No")[0], 13]
    query, items = "Is this post about travel?", [" Hiking in the Alps.", " Quarterly earnings rose.", " A flight to Rome."]
    for apply_softmax in (False, True):
        status, out = post(f"{stack.http_url}/v1/score", {"model": "plain", "query": query, "items": items,
                                                          "label_token_ids": labels, "apply_softmax": apply_softmax})
        assert status == 200 and out["object"] == "scoring" and out["model"] == "plain", out
        for got, item in zip(out["scores"], items):
            # text inputs: SGLang tokenizes query + item as one string (the multi-item request splits it)
            want = engine.score(tokenizer.encode(query + item), labels)
            exp = [t.prob if apply_softmax else math.exp(t.logprob) for t in want.tokens]
            assert got == pytest.approx(exp, abs=TOL)
    q_ids, item_ids = tokenizer.encode(query), [tokenizer.encode(x) for x in items]
    status, out = post(f"{stack.http_url}/v1/score", {"model": "prefillonly", "query": q_ids, "items": item_ids,
                                                      "label_token_ids": labels, "item_first": True, "apply_softmax": True})
    assert status == 200, out
    for got, ids in zip(out["scores"], item_ids):
        assert got == pytest.approx([t.prob for t in engine.score(ids + q_ids, labels).tokens], abs=TOL)


def test_vllm_generative_scoring_shape(stack, engine, tokenizer):
    labels = [tokenizer.encode(" Yes")[0], tokenizer.encode(" No")[0]]
    # vLLM's default is apply_softmax=True (SGLang's False)
    status, out = post(f"{stack.http_url}/generative_scoring", {"query": "Is it warm?", "items": [" Sun.", " Snow."],
                                                                "label_token_ids": labels})
    assert status == 200 and out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1], out
    for d, item in zip(out["data"], [" Sun.", " Snow."]):
        want = engine.score(tokenizer.encode("Is it warm?") + tokenizer.encode(item), labels).tokens[0].prob
        assert d["object"] == "score" and d["score"] == pytest.approx(want, abs=TOL)


# -- completions ---------------------------------------------------------------------------------


def alone_and_batched(engine, prompts: list[str], **kwargs) -> list[tuple]:
    """Per prompt, (its result scored alone, its result scored in one batched step with the others).
    The server batches the prompts of one call or not, as its timing goes, and a batched float32
    step may differ from separate ones by rounding (MKL picks its GEMM kernel by the row count:
    2e-5 in a logprob seen on an Intel AMX host), so the server's answer must equal one of the two.
    The prompts are queued while this thread holds the engine's scheduler lock, so its worker
    plans them together, into one step."""
    alone = [engine.score(p, **kwargs) for p in prompts]
    with engine._cv:  # reentrant: submit takes it too
        futures = [engine.submit(p, **kwargs) for p in prompts]
    return list(zip(alone, [f.result() for f in futures]))


def test_openai_sdk_one_token_completion_equals_engine(stack, engine):
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    prompts = ["Is the sky blue? Answer:", "Name a colour:"]
    reply = client.completions.create(model="prefillonly", prompt=prompts, max_tokens=1, logprobs=5)
    assert [m.id for m in client.models.list().data][:1] == ["prefillonly"]
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 2
    for choice, candidates in zip(reply.choices, alone_and_batched(engine, prompts, allowed_tokens=[0], top_k=5)):
        got = [choice.logprobs.token_logprobs[0], *choice.logprobs.top_logprobs[0].values()]
        wants = [[want.top_k[0].logprob, *(t.logprob for t in want.top_k)] for want in candidates]
        matches = [got == pytest.approx(want, abs=TOL) for want in wants]
        assert any(matches), (got, wants)
        assert choice.text == candidates[matches.index(True)].top_k[0].text
    yes_no = [9230, 2838]
    reply = client.completions.create(model="prefillonly", prompt="Is fire hot? Answer:", max_tokens=1, logprobs=2,
                                      extra_body={"allowed_token_ids": yes_no})
    want = engine.score("Is fire hot? Answer:", yes_no)
    assert reply.choices[0].text == want.chosen.text
    assert set(reply.choices[0].logprobs.top_logprobs[0]) == {" Yes", " No"}
    with pytest.raises(openai.BadRequestError, match="max_tokens must be 0 or 1"):
        client.completions.create(model="prefillonly", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs must be between 0 and 20"):
        client.completions.create(model="prefillonly", prompt="x", max_tokens=1, logprobs=21)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_echo_logprobs_in_the_legacy_shape_equal_the_engine(stack, engine):
    """What lm-evaluation-harness's local-completions sends for a log-likelihood: token-id prompts,
    echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1] and checks greedy-ness
    against top_logprobs. Also a text prompt with logprobs 3, max_tokens 0 and a one-token prompt."""
    ctx = engine.encoder.encode_prompt("Question: is the sky blue?\nAnswer:")
    conts = [engine.encoder.encode_prompt(c, add_special_tokens=False) for c in (" yes", " no it is green")]
    status, out = post(f"{stack.http_url}/v1/completions", {"model": "prefillonly", "prompt": [ctx + c for c in conts],
                                                             "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert status == 200, out
    want = engine.loglikelihood(ctx, conts)
    for choice, cont, w in zip(out["choices"], conts, want):
        lp = choice["logprobs"]
        n = len(ctx) + len(cont)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        span = lp["token_logprobs"][len(ctx):-1]
        assert sum(span) == pytest.approx(w.logprob, abs=1e-4)
        greedy = all(t == max(top.values()) for t, top in zip(span, lp["top_logprobs"][len(ctx):-1]))
        assert greedy == w.is_greedy
    assert out["usage"]["prompt_tokens"] == sum(len(ctx) + len(c) for c in conts) and out["usage"]["completion_tokens"] == 2
    prompt = "Is fire hot? Answer:"
    status, out = post(f"{stack.http_url}/v1/completions", {"model": "prefillonly", "prompt": prompt, "echo": True,
                                                             "logprobs": 3, "max_tokens": 0})
    assert status == 200, out
    (first,) = out["choices"]
    span = engine.prompt_logprobs(prompt, top_k=3)
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"][1:] == pytest.approx(span.token_logprobs, abs=1e-4)
    assert [list(t) for t in first["logprobs"]["top_logprobs"][1:]] == [list(dict.fromkeys(x.text for x in row)) for row in span.top_k]
    assert out["usage"]["completion_tokens"] == 0
    status, out = post(f"{stack.http_url}/v1/completions", {"model": "prefillonly", "prompt": [[42], [42, 7]], "echo": True,
                                                             "logprobs": 2, "max_tokens": 1})
    assert status == 200 and len(out["choices"][0]["logprobs"]["tokens"]) == 2 and len(out["choices"][1]["logprobs"]["tokens"]) == 3, out
    assert out["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert out["choices"][0]["logprobs"]["token_logprobs"][1] == pytest.approx(engine.score([42], [0], top_k=1).top_k[0].logprob, abs=1e-4)


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    ("/v1/rerank", {"model": "qwen3-reranker", "query": "q", "documents": []}, 400, "documents is empty"),
    ("/v1/rerank", {"model": "qwen3-reranker", "query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n must be >= 0"),
    ("/v1/rerank", {"model": "no-such-model", "query": "q", "documents": ["a"]}, 404, "no-such-model"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"], "top_m": 3}, 400, "did you mean 'top_n'"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": [{"title": "a"}]}, 400, "documents[0] has no text field"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"], "max_tokens_per_doc": -1}, 400, "max_tokens_per_doc"),
    ("/v1/completions", {"model": "prefillonly", "prompt": "x", "logit_bias": {"5": -100}}, 400, "only +100"),
    ("/v1/completions", {"model": "prefillonly", "prompt": "x", "logit_bias": {"5": 100}, "allowed_token_ids": [5]}, 400,
     "not both"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "one per text_2"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"], "instruction": "x"}, 400, "takes no instruction"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"], "top_k": 3}, 400, "top_k"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": [5]}, 400, "documents[0]"),
    ("/v1/rerank", {"model": "plain", "documents": ["a"]}, 400, "query"),
    ("/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"] * 257}, 400, "max_items"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}, 400, "label_token_ids"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1, 1]}, 400, "duplicates"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10 ** 9]}, 400, "invalid_request"),
    ("/v1/score", {"model": "qwen3-reranker", "query": [1, 2], "items": [[3]], "label_token_ids": [1]}, 400, "raw model"),
    ("/v1/completions", {"model": "prefillonly", "prompt": "x", "stream": True}, 400, "stream"),
    ("/v1/completions", {"model": "prefillonly", "prompt": [1] * 9000}, 400, "prompt_too_long"),
    ("/v1/completions", {"model": "prefillonly", "prompt": ""}, 400, "prompt[0] is empty"),
    ("/v1/completions", {"model": "prefillonly", "prompt": "x", "echo": True, "max_tokens": 2}, 400, "max_tokens must be 0 or 1"),
    ("/v1/completions", {"model": "prefillonly", "prompt": [[1, 2], [10 ** 9, 3]], "echo": True, "logprobs": 1}, 400,
     "outside the vocabulary"),
    ("/v1/completions", {"model": "prefillonly", "prompt": "x", "echo": True, "allowed_token_ids": [1]}, 400,
     "allowed_token_ids does not apply with echo"),
    ("/v1/completions", {"model": "prefillonly", "prompt": [[1, 2]] * 257, "echo": True}, 400, "too many prompts: 257"),
    ("/v1/completions", {"model": "prefillonly", "prompt": [[1] * 800] * 64, "echo": True, "logprobs": 20}, 400,
     "echo would return 1,075,200 logprob entries"),
]


@pytest.mark.parametrize("path,body,status,match", BAD, ids=[m for *_, m in BAD])
def test_bad_input_is_refused_in_the_api_shape(stack, path, body, status, match):
    got, out = post(f"{stack.http_url}{path}", body)
    assert got == status, out
    # SGLang's /v1/score answers its errors flat, every other route here OpenAI's nested way
    error = out if path == "/v1/score" else out["error"]
    assert match in error["message"] and error["message"].split(":")[0].isidentifier(), out
    assert error["code"] == status and (path != "/v1/score" or out["object"] == "error"), out


def test_cohere_error_shape_and_bad_json(stack):
    status, out = post(f"{stack.http_url}/v2/rerank", {"model": "qwen3-reranker", "query": "q", "documents": []})
    assert status == 400 and out == {"message": "invalid_request: documents is empty; give at least one"}, out
    status, out = post(f"{stack.http_url}/v1/rerank", b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]["message"], out
    status, out = post(f"{stack.http_url}/v1/nothing", {})
    assert status == 404 and "no route" in out["error"]["message"], out
    # the server keeps serving
    status, out = post(f"{stack.http_url}/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"]})
    assert status == 200, out


def test_a_preset_with_a_multi_token_label_stops_the_start(tmp_path, small_served_model):
    from prefillonly.frontend.app import main

    repo = tmp_path / "repo" / "prefillonly"
    repo.mkdir(parents=True)
    (repo / "config.pbtxt").write_text((REPO / "prefillonly" / "config.pbtxt").read_text().replace(
        'key: "model" value: { string_value: "" }', f'key: "model" value: {{ string_value: "{small_served_model}" }}'))
    (repo / PRESETS_FILE).write_text(json.dumps({"bad": {"template": "{query}{document}", "labels": [" xqzvbl", " No"]}}))
    assert main(["--model-repository", str(repo.parent), "--triton-grpc", "127.0.0.1:1", "--check"]) == 2


def test_a_killed_frontend_is_restarted_by_the_supervisor(stack):
    """Last in the module: the supervisor's watchdog brings a dead frontend back on the same port,
    so Envoy's route to it holds; meanwhile Envoy answers 503 unavailable."""
    import os
    import signal
    import time

    old = stack.frontend
    os.killpg(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    status, out = 0, None
    while time.monotonic() < deadline:
        time.sleep(1)
        if stack.frontend is not old and stack.frontend.poll() is None:
            status, out = post(f"{stack.http_url}/v1/rerank", {"model": "plain", "query": "q", "documents": ["a"]})
            if status == 200:
                break
    assert status == 200 and stack.frontend is not old, (status, out)


# -- decisions -------------------------------------------------------------------------------------
DECISION_INPUT = "Order 1182: the parcel came two days late, the box was torn, but the blender inside works well."
OPENAI_QUESTIONS = [
    {"type": "predicate", "name": "late", "instructions": "Was the delivery late?"},
    {"type": "choice", "name": "dept", "instructions": [{"type": "input_text", "text": "Who should handle this?"}],
     "choices": [{"value": "customer support", "description": "complaints"}, {"value": "logistics and shipping"},
                 {"value": True}, {"value": "true"}]},
    {"type": "score", "instructions": "How satisfied is the customer?",
     "levels": [{"label": "unhappy"}, {"label": "neutral", "description": "neither"}, {"label": "happy"}]},
]


def _canonical(questions):
    from prefillonly.frontend.decisions import openai_call

    return openai_call({"input": DECISION_INPUT, "questions": questions}).questions


def test_openai_sdk_decisions_equal_the_engine_and_system_one(stack, engine):
    """The SDK's strict parse of our answer; every probability equal to the engine's decide() on the
    same questions (and with them to transformers': tests/engine/test_decisions.py); System One's
    shape of the same questions gives the same numbers."""
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    reply = client.decisions.create(model="prefillonly", input=DECISION_INPUT, questions=OPENAI_QUESTIONS,
                                    prompt_cache_key="decisions-test", extra_body={"return_token_ids": True})
    want = engine.decide(DECISION_INPUT, _canonical(OPENAI_QUESTIONS), return_token_ids=True)
    assert [a.type for a in reply.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in reply.answers] == ["late", "dept", None]
    assert reply.answers[0].probability == pytest.approx(want.answers[0].probabilities[0], abs=TOL)
    choice = reply.answers[1]
    assert [p.value for p in choice.probabilities] == ["customer support", "logistics and shipping", True, "true"]
    assert [p.probability for p in choice.probabilities] == pytest.approx(want.answers[1].probabilities, abs=TOL)
    assert choice.choice == choice.probabilities[max(range(4), key=lambda i: choice.probabilities[i].probability)].value
    score = reply.answers[2]
    assert [(p.value, p.label) for p in score.probabilities] == [(0, "unhappy"), (1, "neutral"), (2, "happy")]
    assert score.score == pytest.approx(sum(p.value * p.probability for p in score.probabilities), abs=1e-9)
    assert 0 <= choice.confidence <= 1 and 0 <= score.confidence <= 1
    raw = reply.model_extra or {}
    assert reply.usage.input_tokens == want.input_tokens and reply.usage.output_tokens == 0
    assert reply.usage.total_tokens == reply.usage.input_tokens and raw.get("template") == "decisions-v1"
    assert reply.answers[1].model_extra["prompt_token_ids"] == list(want.answers[1].prompt_token_ids)
    again = client.decisions.create(model="prefillonly", input=DECISION_INPUT, questions=OPENAI_QUESTIONS,
                                    prompt_cache_key="decisions-test")
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    status, s1 = post(f"{stack.http_url}/v1/systemone", {
        "model": "prefillonly", "state": DECISION_INPUT, "questions": {
            "late": {"type": "noul", "instructions": "Was the delivery late?"},
            "sat": {"type": "score", "instructions": "How satisfied is the customer?", "criteria": ["unhappy", "neutral", "happy"]}}})
    assert status == 200, s1
    alone = engine.decide(DECISION_INPUT, [_canonical(OPENAI_QUESTIONS)[0], _canonical([
        {"type": "score", "instructions": "How satisfied is the customer?",
         "levels": [{"label": "unhappy"}, {"label": "neutral"}, {"label": "happy"}]}])[0]])
    assert s1["answers"]["late"]["noul"] == pytest.approx(alone.answers[0].probabilities[0], abs=TOL)
    assert s1["answers"]["sat"]["legend"] == {"0": "unhappy", "1": "neutral", "2": "happy"}
    assert [s1["answers"]["sat"]["probabilities"][k] for k in "012"] == pytest.approx(alone.answers[1].probabilities, abs=TOL)


def test_langchain_openai_decisions_invoke(stack):
    from langchain_openai import OpenAIDecisions
    from langchain_openai.decisions.types import Choice, Predicate, Score

    decide = OpenAIDecisions(model="prefillonly", base_url=f"{stack.http_url}/v1", api_key="unused")
    out = decide.invoke({"input": DECISION_INPUT, "questions": {
        "late": Predicate(instructions="Was the delivery late?"),
        "dept": Choice(instructions="Who should handle this?", choices={"billing": "payments", "shipping": None}),
        "sat": Score(instructions="How satisfied is the customer?", levels=["unhappy", "neutral", "happy"])}})
    assert set(out.answers) == {"late", "dept", "sat"}
    assert sum(out.answers["dept"].probabilities.values()) == pytest.approx(1)
    assert out.answers["sat"].legend == {0: "unhappy", 1: "neutral", 2: "happy"} and out.usage.input_tokens > 0


_Q = {"type": "predicate", "instructions": "Late?"}


@pytest.mark.parametrize("body,param,match", [
    ({"input": "x", "questions": []}, "questions", "at least one"),
    ({"input": "x", "questions": [_Q] * 401}, "questions", "401 questions"),
    ({"input": "x", "questions": [_Q, {"type": "choice", "instructions": "q", "choices": [{"value": "a"}]}]},
     "questions[1].choices", "2 to 255"),
    ({"input": "x", "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": str(i)} for i in range(256)]}]},
     "questions[0].choices", "2 to 255"),
    ({"input": "x", "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions[0].choices[1]", "twice"),
    ({"input": "x", "questions": [{"type": "score", "instructions": "q", "levels": [{"label": "low"}]}]},
     "questions[0].levels", "2 to 10"),
    ({"input": "x", "questions": [{"type": "score", "instructions": "q", "levels": [{"label": str(i)} for i in range(11)]}]},
     "questions[0].levels", "2 to 10"),
    ({"input": "x", "questions": [{"type": "ranking", "instructions": "q"}]}, "questions[0].type", "unknown question type"),
    ({"input": "x", "questions": [{"type": "predicate"}]}, "questions[0].instructions", "instructions"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}], "questions": [_Q]},
     "input[0].content[0]", "text only"),
    ({"input": "word " * 9000, "questions": [_Q]}, "input", "over this model's limit"),
])
def test_bad_decision_calls_are_refused_naming_the_field(stack, body, param, match):
    status, reply = post(f"{stack.http_url}/v1/decisions", {"model": "prefillonly", **body})
    assert status == 400 and reply["error"]["param"] == param and match in reply["error"]["message"], reply
    assert_still_serving(stack)
