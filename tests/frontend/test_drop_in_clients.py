"""The clients people already run, unchanged but for their base URL, against the real serve stack
(Envoy, the supervised tritonserver, the frontend; the small random-weight model in float32):
cohere.Client (v1), cohere.ClientV2 and langchain_cohere's CohereRerank, LiteLLM's hosted-vLLM
rerank, LlamaIndex's TEI and Jina rerankers, huggingface_hub's health check, the openai SDK with
logit_bias; and the fields such clients send
that this server does not implement (ignored and named in a header, as vLLM and TEI ignore them).
Each answer's order and scores equal the in-process engine's on the published template's ids."""

from __future__ import annotations

import math

import pytest

from ..serving.test_faults import REPO
from .test_frontend import DOCS, QUERY, TOL, TRUNCATED, post, post_with_headers, qwen3_relevance

IGNORED = "x-prefillonly-ignored-fields"


def _want(engine, tokenizer, docs=DOCS):
    return [qwen3_relevance(engine, tokenizer, QUERY, d) for d in docs]


def test_cohere_v1_client_rank_fields_and_documents_with_their_own_keys(stack, engine, tokenizer):
    import cohere

    client = cohere.Client(base_url=stack.http_url, api_key="unused")
    documents = [{"id": f"doc-{i}", "title": f"T{i}", "text": d} for i, d in enumerate(DOCS)]
    reply = client.rerank(model="qwen3-reranker", query=QUERY, documents=documents, top_n=3, return_documents=True,
                          max_chunks_per_doc=10)  # a Cohere v1 field this server ignores
    want = _want(engine, tokenizer)
    assert [r.index for r in reply.results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    for r in reply.results:
        assert r.relevance_score == pytest.approx(want[r.index], abs=TOL)
        assert r.document.text == DOCS[r.index]
    # the document comes back whole, its own keys included
    status, out = post(f"{stack.http_url}/v1/rerank", {"model": "qwen3-reranker", "query": QUERY, "documents": documents})
    assert status == 200 and all(r["document"] == documents[r["index"]] for r in out["results"]), out
    # rank_fields: the named keys are what is scored ("key: value" lines for several)
    joined = [f"title: T{i}\ntext: {d}" for i, d in enumerate(DOCS)]
    reply = client.rerank(model="qwen3-reranker", query=QUERY, documents=documents, rank_fields=["title", "text"])
    for r in reply.results:
        assert r.relevance_score == pytest.approx(qwen3_relevance(engine, tokenizer, QUERY, joined[r.index]), abs=TOL)


def test_cohere_v2_cuts_long_documents_at_4096_tokens_and_warns(stack):
    import cohere

    long_doc = "many words here " * 3000  # ~9K tokens: over the model's 8,192
    client = cohere.ClientV2(base_url=stack.http_url, api_key="unused")
    reply = client.rerank(model="plain", query="q", documents=["short", long_doc])
    assert sorted(r.index for r in reply.results) == [0, 1]
    assert reply.meta.warnings and "1" in reply.meta.warnings[0]
    # the default is 4,096 tokens a document: the same scores as asking for it
    asked = client.rerank(model="plain", query="q", documents=["short", long_doc], max_tokens_per_doc=4096)
    assert [(r.index, r.relevance_score) for r in asked.results] == [(r.index, r.relevance_score) for r in reply.results]


def test_langchain_cohere_rerank_compresses_documents(stack, engine, tokenizer):
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document as LangchainDocument

    reranker = CohereRerank(model="qwen3-reranker", base_url=stack.http_url, cohere_api_key="unused", top_n=3)
    documents = [LangchainDocument(page_content=d, metadata={"source": i}) for i, d in enumerate(DOCS)]
    kept = reranker.compress_documents(documents, QUERY)
    want = _want(engine, tokenizer)
    assert [d.metadata["source"] for d in kept] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    for d in kept:
        assert d.metadata["relevance_score"] == pytest.approx(want[d.metadata["source"]], abs=TOL)


def test_litellm_hosted_vllm_rerank(stack, engine, tokenizer, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price table from the package, not the network
    import litellm

    reply = litellm.rerank(model="hosted_vllm/qwen3-reranker", query=QUERY, documents=DOCS, top_n=2,
                           api_base=stack.http_url, api_key="unused", return_documents=True)
    want = _want(engine, tokenizer)
    assert [r["index"] for r in reply.results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    for r in reply.results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOL)
    # the fields LiteLLM forwards for vLLM when a caller sets them: ignored, named in the header
    status, out, headers = post_with_headers(f"{stack.http_url}/rerank", {
        "model": "qwen3-reranker", "query": QUERY, "documents": DOCS[:2], "truncate_prompt_tokens": 512,
        "max_tokens_per_query": 64, "rank_fields": ["text"]})
    assert status == 200 and headers[IGNORED] == "truncate_prompt_tokens,max_tokens_per_query", (out, headers)


def test_llama_index_tei_reranker_long_documents_included(stack, engine, tokenizer):
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    long_doc = "many words here " * 3000
    texts = DOCS[:3] + [long_doc]
    reranker = TextEmbeddingInference(base_url=stack.http_url, top_n=3, model_name="qwen3-reranker")
    nodes = [NodeWithScore(node=TextNode(text=t, id_=str(i)), score=0.0) for i, t in enumerate(texts)]
    ranked = reranker.postprocess_nodes(nodes, QueryBundle(QUERY))
    want = {str(i): w for i, w in enumerate(_want(engine, tokenizer, DOCS[:3]))}
    assert len(ranked) == 3
    for n in ranked:
        if n.node.node_id in want:
            assert n.score == pytest.approx(want[n.node.node_id], abs=TOL)
    assert [n.score for n in ranked] == sorted((n.score for n in ranked), reverse=True)


def test_llama_index_jina_reranker(stack, engine, tokenizer):
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.jinaai_rerank import JinaRerank

    reranker = JinaRerank(top_n=2, model="qwen3-reranker", base_url=f"{stack.http_url}/v1", api_key="unused")
    nodes = [NodeWithScore(node=TextNode(text=t, id_=str(i)), score=0.0) for i, t in enumerate(DOCS)]
    ranked = reranker.postprocess_nodes(nodes, QueryBundle(QUERY))
    want = _want(engine, tokenizer)
    assert [int(n.node.node_id) for n in ranked] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    for n in ranked:
        assert n.score == pytest.approx(want[int(n.node.node_id)], abs=TOL)


def test_health_info_and_version_for_hub_and_kubernetes_checks(stack):
    from huggingface_hub import InferenceClient

    assert InferenceClient(model=stack.http_url, provider="hf-inference").health_check() is True
    status, info = _get(f"{stack.http_url}/info")
    assert status == 200 and info["max_input_length"] == 8192 and info["model_id"] == "qwen3-reranker", info
    assert info["model_type"] == {"reranker": {}}, info  # a causal LM: what it is used for here
    status, version = _get(f"{stack.http_url}/version")
    assert status == 200 and version["version"], version


def test_openai_logit_bias_of_100_chooses_among_those_tokens(stack, engine):
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    yes_no = [9230, 2838]
    reply = client.completions.create(model="prefillonly", prompt="Is fire hot? Answer:", max_tokens=1, logprobs=2,
                                      logit_bias={str(t): 100 for t in yes_no})
    want = engine.score("Is fire hot? Answer:", yes_no)
    assert reply.choices[0].text == want.chosen.text
    assert reply.choices[0].logprobs.token_logprobs[0] == pytest.approx(want.chosen.logprob, abs=TOL)
    # an end-of-sequence choice: finish_reason "stop" and no text, as OpenAI and vLLM answer it
    eos = engine.encoder.tokenizer.eos_token_id
    reply = client.completions.create(model="prefillonly", prompt="Hello", max_tokens=1, logit_bias={str(eos): 100})
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == ""


def test_vllm_score_route_and_usage_counts_every_pair(stack, engine, tokenizer):
    status, out = post(f"{stack.http_url}/score", {"model": "qwen3-reranker", "text_1": QUERY, "text_2": DOCS[:3]})
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1, 2], out
    for d, w in zip(out["data"], _want(engine, tokenizer, DOCS[:3])):
        assert d["object"] == "score" and d["score"] == pytest.approx(w, abs=TOL)
    status, same = post(f"{stack.http_url}/v1/score", {"model": "qwen3-reranker", "text_1": [QUERY] * 3, "text_2": DOCS[:3]})
    assert status == 200 and [d["score"] for d in same["data"]] == pytest.approx([d["score"] for d in out["data"]], abs=TOL)
    # usage: every query + document pair's tokens, as vLLM and Jina count them
    from prefillonly.frontend.presets import PRESETS_FILE, TemplateTokenizer, load_presets

    tokens = TemplateTokenizer(tokenizer, 8192)
    preset = load_presets(REPO / "prefillonly" / PRESETS_FILE, tokens)["qwen3-reranker"]
    rendered = tokens.render(preset, QUERY, DOCS[:3])
    status, rr = post(f"{stack.http_url}/v1/rerank", {"model": "qwen3-reranker", "query": QUERY, "documents": DOCS[:3]})
    pairs = sum(len(rendered.shared) + len(item) for item in rendered.items)
    assert status == 200 and rr["usage"]["prompt_tokens"] == rr["usage"]["total_tokens"] == pairs, (rr["usage"], pairs)


def test_sglang_score_one_string_item_no_items_and_flat_errors(stack, engine, tokenizer):
    labels = [tokenizer.encode(" Yes")[0], tokenizer.encode(" No")[0]]
    status, out = post(f"{stack.http_url}/v1/score", {"query": "Is it warm?", "items": " Sun.", "label_token_ids": labels})
    assert status == 200 and len(out["scores"]) == 1, out
    want = engine.score(tokenizer.encode("Is it warm? Sun."), labels)
    assert out["scores"][0] == pytest.approx([math.exp(t.logprob) for t in want.tokens], abs=TOL)
    status, out = post(f"{stack.http_url}/v1/score", {"query": "Is it warm?", "items": [], "label_token_ids": labels})
    assert status == 200 and out["scores"] == [], out
    status, out = post(f"{stack.http_url}/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1, 1]})
    assert status == 400 and out["object"] == "error" and "duplicates" in out["message"], out


def test_tei_statuses(stack):
    status, out = post(f"{stack.http_url}/rerank", {"query": "q", "texts": []})
    assert status == 400 and out["error_type"] == "Empty", out
    status, out = post(f"{stack.http_url}/rerank", {"query": "q", "texts": ["a"], "truncate": None, "raw_scores": False})
    assert status == 200, out


def _get(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())
