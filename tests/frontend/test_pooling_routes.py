"""The embedding and classification routes (prefillonly.frontend.pooling_routes) through the real
serve stack (Envoy, the supervised tritonserver and the frontend), each on its own small
random-weight checkpoint in float32 with one thread: an embedding model (the small served Llama
with sentence-transformers files: last-token pooling, Normalize, a "query" prompt) and a
three-label LlamaForSequenceClassification on the same tokenizer. Clients are the official SDKs
(openai, langchain-openai, huggingface_hub, cohere) and plain HTTP; every number equals an
in-process Engine's on the same folder and kernels. A route the checkpoint cannot answer, and bad
input, are 400s in the API's error shape that name the field, and the server goes on serving. TEI's
/info says which checkpoint it is; the Python client's embed and classify (clients/prefillonly_client.py,
HTTP generate and gRPC streaming) run on the same two stacks."""

from __future__ import annotations

import base64
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from prefillonly.serving.host.probe import probe
from prefillonly.serving.host.prometheus import scrape_metrics

from ..conftest import SAME_KERNELS, SERVING_CONFIG, make_random_model
from ..engine.test_pooling import write_st_pooling
from ..serving.test_faults import supervised
from .test_envoy_frontend_routes import get
from .test_frontend import post

MAX_LEN = 512  # the checkpoints' context length: a prompt over it is cheap to send
QUERY_PROMPT = "Instruct: find the passage that answers it\nQuery: "
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "été à Paris", "A short one"]
LONG = "many words about rivers and cities " * 120  # ~800 tokens: over MAX_LEN
TOL = 2e-5


def _engine(folder: str):
    from prefillonly import Engine, EngineConfig

    return Engine(EngineConfig(model=folder, dtype="float32", threads=1, cache_budget_bytes=0, **SAME_KERNELS))


@pytest.fixture(scope="module")
def embedding_folder(tmp_path_factory, small_served_model) -> str:
    """The small served Llama as an embedding model: its last token's final hidden state,
    normalised, with a named "query" prompt; MAX_LEN tokens at most."""
    folder = tmp_path_factory.mktemp("embedding_model") / "checkpoint"
    shutil.copytree(small_served_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=MAX_LEN)))
    write_st_pooling(folder, "lasttoken", True, prompts={"query": QUERY_PROMPT})
    return str(folder)


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory, small_served_model) -> str:
    """A random three-label LlamaForSequenceClassification of the served model's shape and tokenizer."""
    cls_name, kwargs = SERVING_CONFIG
    kwargs = dict(kwargs, max_position_embeddings=MAX_LEN, num_labels=3, id2label=LABELS,
                  label2id={v: k for k, v in LABELS.items()})
    folder = tmp_path_factory.mktemp("classifier_model")
    make_random_model(cls_name, kwargs, auto="AutoModelForSequenceClassification").save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source := Path(small_served_model) / name).exists():
            shutil.copy(source, folder)
    return str(folder)


@pytest.fixture(scope="module")
def embed_stack(tmp_path_factory, embedding_folder):
    with supervised(tmp_path_factory.mktemp("embed_stack"), embedding_folder, probe_interval_s=3600) as sup:
        yield sup


@pytest.fixture(scope="module")
def embedder(embedding_folder):
    with _engine(embedding_folder) as engine:
        yield engine


@pytest.fixture(scope="module")
def classify_stack(tmp_path_factory, classifier_folder):
    with supervised(tmp_path_factory.mktemp("classify_stack"), classifier_folder, probe_interval_s=3600) as sup:
        yield sup


@pytest.fixture(scope="module")
def classifier(classifier_folder):
    with _engine(classifier_folder) as engine:
        yield engine


def close(got, want, tol=TOL) -> bool:
    return len(got) == len(want) and float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want)))) <= tol


# -- embeddings ---------------------------------------------------------------------------------------
def test_openai_sdk_embeddings_base64_and_float_equal_the_engine(embed_stack, embedder):
    import openai

    client = openai.OpenAI(base_url=f"{embed_stack.http_url}/v1", api_key="unused")
    want = embedder.embed(TEXTS)
    reply = client.embeddings.create(model="prefillonly", input=TEXTS)  # the SDK asks base64 and decodes float32
    assert [d.index for d in reply.data] == list(range(len(TEXTS))) and reply.model == "prefillonly"
    for d, w in zip(reply.data, want):
        assert close(d.embedding, w.embedding) and math.isclose(np.linalg.norm(d.embedding), 1, abs_tol=1e-5)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(w.prompt_tokens for w in want)
    floats = client.embeddings.create(model="prefillonly", input=TEXTS[0], encoding_format="float", dimensions=16)
    cut = embedder.embed(TEXTS[0], dimensions=16)  # Matryoshka: the first 16, then normalised
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 16 and close(floats.data[0].embedding, cut.embedding)
    assert not close(cut.embedding, want[0].embedding[:16])  # renormalised, not merely cut


def test_openai_embeddings_base64_is_little_endian_float32_and_token_ids_are_prompts(embed_stack, embedder, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[1:3]]
    status, out = post(f"{embed_stack.http_url}/v1/embeddings", {"model": "prefillonly", "input": ids,
                                                                 "encoding_format": "base64"})
    assert status == 200, out
    assert set(out) == {"object", "data", "model", "usage"} and out["object"] == "list"
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in out["data"]]
    assert all(close(v, w.embedding) for v, w in zip(vectors, embedder.embed(TEXTS[1:3])))  # the texts' own ids
    status, one = post(f"{embed_stack.http_url}/v1/embeddings", {"model": "prefillonly", "input": ids[0]})
    assert status == 200 and len(one["data"]) == 1 and close(one["data"][0]["embedding"], vectors[0]), one


def test_langchain_openai_embeddings(embed_stack, embedder):
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model="prefillonly", base_url=f"{embed_stack.http_url}/v1", api_key="unused",
                          check_embedding_ctx_length=False)
    documents, query = lc.embed_documents(TEXTS[:2]), lc.embed_query(TEXTS[2])
    assert all(close(d, w.embedding) for d, w in zip(documents, embedder.embed(TEXTS[:2])))
    assert close(query, embedder.embed(TEXTS[2]).embedding)


def test_huggingface_hub_feature_extraction_on_tei_embed(embed_stack, embedder):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=f"{embed_stack.http_url}/embed")  # it posts to the base URL itself
    got = client.feature_extraction(TEXTS[0], prompt_name="query")
    assert got.shape == (1, 256) and close(got[0], embedder.embed(TEXTS[0], prompt_name="query").embedding)
    assert not close(got[0], embedder.embed(TEXTS[0]).embedding)  # the named prompt was put before the text
    raw = client.feature_extraction(TEXTS[0], normalize=False)  # TEI normalises unless told not to
    assert close(raw[0], embedder.embed(TEXTS[0], normalize=False).embedding, 1e-4)
    assert not math.isclose(float(np.linalg.norm(raw[0])), 1, abs_tol=1e-3)


def test_tei_embed_truncates_as_asked_and_refuses_as_asked(embed_stack, embedder):
    status, out = post(f"{embed_stack.http_url}/embed", {"inputs": [LONG], "truncation_direction": "Left"})
    assert status == 200 and close(out[0], embedder.embed(LONG, truncate="left", normalize=True).embedding, 1e-4), out
    status, out = post(f"{embed_stack.http_url}/embed", {"inputs": LONG, "truncate": False})
    assert status == 422 and out["error_type"] == "Validation" and out["error"].startswith("prompt_too_long"), out
    status, out = post(f"{embed_stack.http_url}/embed", {"inputs": []})
    assert status == 400 and out == {"error": "empty: inputs is empty; give at least one input", "error_type": "Empty"}, out
    status, out = post(f"{embed_stack.http_url}/embed", {"inputs": "x", "encoding_format": "base64"})
    assert status == 422 and "encoding_format" in out["error"], out


def test_cohere_v2_embed_maps_input_type_to_the_named_prompt(embed_stack, embedder):
    import cohere

    client = cohere.ClientV2(base_url=embed_stack.http_url, api_key="unused")
    query = client.embed(texts=TEXTS[:2], model="prefillonly", input_type="search_query", embedding_types=["float"])
    want = embedder.embed(TEXTS[:2], prompt_name="query")
    assert all(close(g, w.embedding) for g, w in zip(query.embeddings.float_, want))
    assert query.texts == TEXTS[:2] and query.meta.billed_units.input_tokens == sum(w.prompt_tokens for w in want)
    # no "document" prompt in this checkpoint: the texts as they are; output_dimension is Matryoshka
    docs = client.embed(texts=TEXTS[:1], model="prefillonly", input_type="search_document", embedding_types=["float"],
                        output_dimension=32)
    assert close(docs.embeddings.float_[0], embedder.embed(TEXTS[0], dimensions=32).embedding)
    long = client.embed(texts=[LONG], model="prefillonly", input_type="clustering", embedding_types=["float"])  # END: cut the end
    assert close(long.embeddings.float_[0], embedder.embed(LONG, truncate="right").embedding, 1e-4)


def test_vllm_pooling_answers_the_checkpoints_own_task(embed_stack, embedder):
    status, out = post(f"{embed_stack.http_url}/pooling", {"model": "prefillonly", "input": TEXTS[:2]})
    assert status == 200 and [d["object"] for d in out["data"]] == ["pooling", "pooling"], out
    assert all(close(d["data"], w.embedding) for d, w in zip(out["data"], embedder.embed(TEXTS[:2])))
    assert out["usage"]["prompt_tokens"] > 0 and out["id"].startswith("pool-")


@pytest.mark.parametrize("path,body,status,param,words", [
    ("/v1/embeddings", {"model": "prefillonly", "input": []}, 400, "input", "input is empty"),
    ("/v1/embeddings", {"model": "prefillonly", "input": ["ok", ""]}, 400, "input", "input[1] is empty"),
    ("/v1/embeddings", {"model": "prefillonly", "input": ["x"] * 257}, 400, "input", "too many inputs"),
    ("/v1/embeddings", {"model": "prefillonly", "input": LONG}, 400, "input", "prompt_too_long"),
    ("/v1/embeddings", {"model": "prefillonly", "input": "x", "dimensions": 0}, 400, "dimensions", "between 1 and"),
    ("/v1/embeddings", {"model": "prefillonly", "input": "x", "dimensions": 257}, 400, "dimensions", "hidden size 256"),
    ("/v1/embeddings", {"model": "prefillonly", "input": "x", "encoding_format": "base85"}, 400, "encoding_format", "base64"),
    ("/v1/embeddings", {"model": "other", "input": "x"}, 404, "model", "not served here"),
    ("/v1/embeddings", {"model": "prefillonly", "input": "x", "dimension": 8}, 400, "dimension", "did you mean 'dimensions'"),
    ("/pooling", {"input": "x", "task": "token_embed"}, 400, "task", "embed or classify"),
    ("/pooling", {"input": "x", "task": "classify", "dimensions": 8}, 400, "dimensions", "applies to task embed"),
    ("/pooling", {"input": LONG, "truncate_prompt_tokens": 100}, 400, "truncate_prompt_tokens", "below the model's input"),
    ("/classify", {"input": "x", "encoding_format": "base64"}, 400, "encoding_format", "answers floats"),
])
def test_bad_embedding_calls_name_the_field(embed_stack, path, body, status, param, words):
    got, out = post(embed_stack.http_url + path, body)
    assert got == status and out["error"]["param"] == param and words in out["error"]["message"], out


def test_cohere_refusals_and_a_route_the_checkpoint_cannot_answer(embed_stack):
    url = f"{embed_stack.http_url}/v2/embed"
    for body, words in [({"texts": ["x"], "embedding_types": ["int8"]}, "embedding_types"),
                        ({"texts": ["x"], "input_type": "image"}, "input_type"),
                        ({"texts": ["x"], "output_dimension": 999}, "output_dimension must be between 1 and"),
                        ({"texts": [LONG], "truncate": "NONE"}, "prompt_too_long")]:
        status, out = post(url, dict(body, model="prefillonly"))
        assert status == 400 and set(out) == {"message"} and words in out["message"], (body, out)
    # an embedding model has no classifier head: the engine's refusal, in vLLM's (OpenAI's) shape
    status, out = post(f"{embed_stack.http_url}/classify", {"model": "prefillonly", "input": "x"})
    assert status == 400 and out["error"]["message"].startswith("invalid_request:"), out
    assert "classif" in out["error"]["message"], out
    status, out = post(f"{embed_stack.http_url}/v1/embeddings", {"model": "prefillonly", "input": TEXTS[3]})
    assert status == 200 and embed_stack.server.poll() is None and embed_stack.restarts == 0, out


# -- classification -----------------------------------------------------------------------------------
def test_vllm_classify_equals_the_engine(classify_stack, classifier):
    status, out = post(f"{classify_stack.http_url}/classify", {"model": "prefillonly", "input": TEXTS[:3]})
    assert status == 200 and out["object"] == "list" and out["id"].startswith("classify-"), out
    want = classifier.classify(TEXTS[:3])
    for d, w in zip(out["data"], want):
        assert close(d["probs"], w.probs) and d["label"] == w.label and d["num_classes"] == 3
        assert math.isclose(sum(d["probs"]), 1, abs_tol=1e-5)
    assert out["usage"]["prompt_tokens"] == sum(w.prompt_tokens for w in want)
    status, raw = post(f"{classify_stack.http_url}/classify", {"input": TEXTS[0], "use_activation": False})
    assert status == 200 and close(raw["data"][0]["probs"], want[0].logits), raw


def test_classify_best_of_n_is_one_request_with_the_prompt_computed_once(classify_stack, classifier, tokenizer):
    prompt, responses = "Question: which answer is kind?\nAnswer:", [" Thank you so much!", " Go away.", " Maybe later."]
    before = scrape_metrics(classify_stack.metrics_url)
    status, out = post(f"{classify_stack.http_url}/classify", {"prompt": prompt, "responses": responses})
    after = scrape_metrics(classify_stack.metrics_url)
    assert status == 200 and len(out["data"]) == 3, out
    want = classifier.classify(prompt, responses)
    for d, w in zip(out["data"], want):
        assert close(d["probs"], w.probs) and d["label"] == w.label
    key = next(k for k in after if k.startswith("nv_inference_request_success") and 'model="prefillonly"' in k)
    assert after[key] - before.get(key, 0) == 1
    # usage: the tokens the call holds, the shared prompt once and every response (each result's
    # prompt_tokens counts prompt + response)
    shared, own = tokenizer(prompt)["input_ids"], [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == len(shared) + sum(map(len, own)), usage
    assert usage["prompt_tokens"] == sum(w.prompt_tokens for w in want) - 2 * len(shared)
    assert usage["prompt_tokens_details"]["cached_tokens"] <= len(shared), usage
    status, out = post(f"{classify_stack.http_url}/classify", {"prompt": shared, "responses": own})  # token ids
    assert status == 200 and out["usage"]["prompt_tokens"] == len(shared) + sum(map(len, own)), out
    status, out = post(f"{classify_stack.http_url}/classify", {"prompt": prompt})
    assert status == 400 and out["error"]["param"] == "responses", out


def test_tei_predict_texts_and_pairs(classify_stack, classifier):
    url = f"{classify_stack.http_url}/predict"
    status, one = post(url, {"inputs": TEXTS[0]})
    want = classifier.classify(TEXTS[0])
    assert status == 200 and [x["label"] for x in one] == sorted(want.labels, key=lambda n: -want.probs[want.labels.index(n)])
    assert all(math.isclose(x["score"], want.probs[want.labels.index(x["label"])], abs_tol=TOL) for x in one)
    # a list of exactly two texts is one pair (TEI's reading): a followed by b
    status, pair = post(url, {"inputs": [TEXTS[1], " Is it?"], "raw_scores": True})
    (want_pair,) = classifier.classify(TEXTS[1], [" Is it?"])
    assert status == 200 and {x["label"]: x["score"] for x in pair} == pytest.approx(
        dict(zip(want_pair.labels, want_pair.logits)), abs=TOL)
    status, batch = post(url, {"inputs": [TEXTS[2], [TEXTS[1], " Is it?"], [TEXTS[1], " Really?"]]})
    assert status == 200 and len(batch) == 3 and all(len(x) == 3 for x in batch), batch
    assert {x["label"]: x["score"] for x in batch[1]} == pytest.approx(dict(zip(want_pair.labels, want_pair.probs)), abs=TOL)
    status, out = post(url, {"inputs": LONG, "truncate": False})
    assert status == 422 and out["error"].startswith("prompt_too_long"), out


def test_huggingface_hub_text_classification(classify_stack, classifier):
    from huggingface_hub import InferenceClient

    # it reads the answer as a list per input and takes the first: TEI's flat list for one text
    # gives it the top label (as against TEI itself)
    client = InferenceClient(base_url=f"{classify_stack.http_url}/predict")
    want = classifier.classify(TEXTS[3])
    got = client.text_classification(TEXTS[3])
    assert got.label == want.label and got.score == pytest.approx(max(want.probs), abs=TOL)
    raw = client.text_classification(TEXTS[3], top_k=2, function_to_apply="none")  # parameters: honoured
    assert raw.label == want.label and raw.score == pytest.approx(max(want.logits), abs=TOL)


def test_a_classifier_refuses_what_needs_another_head(classify_stack, classifier):
    status, out = post(f"{classify_stack.http_url}/pooling", {"input": TEXTS[0]})  # its own task: classify
    assert status == 200 and close(out["data"][0]["data"], classifier.classify(TEXTS[0]).probs), out
    for path, body in [("/v1/embeddings", {"model": "prefillonly", "input": "x"}),
                       ("/v1/completions", {"model": "prefillonly", "prompt": "x", "max_tokens": 1})]:
        status, out = post(classify_stack.http_url + path, body)
        assert status == 400 and out["error"]["message"].startswith("invalid_request:"), (path, out)
        assert "LlamaForSequenceClassification" in out["error"]["message"], (path, out)
    status, out = post(f"{classify_stack.http_url}/embed", {"inputs": "x"})
    assert status == 422 and out["error_type"] == "Validation" and "classif" in out["error"], out
    assert classify_stack.server.poll() is None and classify_stack.restarts == 0


def test_the_liveness_probe_and_triton_generate_reach_a_classifiers_worker(classify_stack, classifier):
    """The supervisor's probe (a 1-token score) runs as the task the checkpoint answers, so a
    classifier's engine is proved alive by a real forward (the model warmed up the same way)."""
    alive, what = probe(classify_stack.server.http_url, timeout=60)
    assert alive and "answered" in what, what
    status, out = post(f"{classify_stack.server.http_url}/v2/models/prefillonly/generate",
                       {"text_input": TEXTS[0], "task": "classify"})
    assert status == 200, out
    assert close(np.asarray(out["class_probs"]).reshape(-1), classifier.classify(TEXTS[0]).probs), out


# -- TEI's /info and the Python client on both checkpoints --------------------------------------------
def test_tei_info_says_which_checkpoint_is_served(embed_stack, classify_stack):
    """TEI's model_type: an embedding model's pooling (in TEI's names), a classifier's labels (a
    causal LM is a reranker here: tests/frontend/test_drop_in_clients.py)."""
    status, raw, _ = get(f"{embed_stack.http_url}/info")
    assert status == 200 and json.loads(raw)["model_type"] == {"embedding": {"pooling": "last_token"}}, raw
    status, raw, _ = get(f"{classify_stack.http_url}/info")
    assert status == 200 and json.loads(raw)["model_type"] == {"classifier": {
        "id2label": {str(i): name for i, name in LABELS.items()}, "label2id": {name: i for i, name in LABELS.items()}}}, raw


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_library_embeds(embed_stack, embedder, tokenizer, protocol):
    from clients.prefillonly_client import PrefillOnlyClient, PrefillOnlyClientError
    from prefillonly.contract.wire import EmbeddingResult

    with PrefillOnlyClient(embed_stack.http_url if protocol == "http" else embed_stack.grpc_url, protocol) as c:
        got, want = c.embed(TEXTS, prompt_name="query", user="u1"), embedder.embed(TEXTS, prompt_name="query")
        assert all(isinstance(g, EmbeddingResult) and close(g.embedding, w.embedding) for g, w in zip(got, want))
        assert [g.prompt_tokens for g in got] == [w.prompt_tokens for w in want] and len(got) == len(TEXTS)
        ids = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
        one = c.embed(ids[0], dimensions=16, normalize=False)  # one prompt: one result
        assert close(one.embedding, embedder.embed(TEXTS[0], dimensions=16, normalize=False).embedding, 1e-4)
        by_ids = c.embed(ids)  # id lists: one request each
        assert len(by_ids) == 2 and all(close(g.embedding, w.embedding) for g, w in zip(by_ids, embedder.embed(TEXTS[:2])))
        cut = c.embed(LONG, truncate="left")
        assert cut.truncated_tokens > 0 and close(cut.embedding, embedder.embed(LONG, truncate="left").embedding, 1e-4)
        with pytest.raises(PrefillOnlyClientError, match="prompt_too_long"):
            c.embed(LONG)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_library_classifies(classify_stack, classifier, protocol):
    from clients.prefillonly_client import PrefillOnlyClient, PrefillOnlyClientError
    from prefillonly.contract.wire import ClassificationResult

    prompt, responses = "Question: which answer is kind?\nAnswer:", [" Thank you so much!", " Go away."]
    with PrefillOnlyClient(classify_stack.http_url if protocol == "http" else classify_stack.grpc_url, protocol) as c:
        one, want = c.classify(TEXTS[0]), classifier.classify(TEXTS[0])
        assert isinstance(one, ClassificationResult) and one.label == want.label and one.labels == list(LABELS.values())
        assert close(one.probs, want.probs) and close(one.logits, want.logits, 1e-4)
        assert all(close(g.probs, w.probs) for g, w in zip(c.classify(TEXTS[:3], user="u1"), classifier.classify(TEXTS[:3])))
        best = c.classify(prompt, responses)  # one multi-item request: one result per response
        assert len(best) == 2 and all(close(g.probs, w.probs) and g.prompt_tokens == w.prompt_tokens
                                      for g, w in zip(best, classifier.classify(prompt, responses)))
        with pytest.raises(PrefillOnlyClientError, match="LlamaForSequenceClassification"):
            c.embed(TEXTS[0])  # the engine's refusal: a classifier does not embed
