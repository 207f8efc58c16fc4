"""The embedding and classification routes: each API's request shape in, its response shape out
(pooling.py does the work; the served checkpoint says which it can answer).

    POST /v1/embeddings   OpenAI (and vLLM's)   {object: "list", data[{object: "embedding", index, embedding}], model, usage}
    POST /pooling         vLLM                  {id, object: "list", created, model, data[{index, object: "pooling", data}], usage}
    POST /classify        vLLM                  {id, object: "list", created, model, data[{index, label, probs, num_classes}], usage}
                          (with `prompt` and `responses` instead of `input`: one entry per response, the prompt computed once)
    POST /embed           TEI                   [[float] per input]
    POST /predict         TEI                   [{score, label}] highest first, per input (one input: that list alone)
    POST /v2/embed        Cohere v2             {id, embeddings: {float: [[float]]}, texts, meta, response_type}

base64 (OpenAI's and vLLM's encoding_format) is each vector's little-endian float32 bytes, what the
openai SDK decodes (numpy.frombuffer, float32).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time

from fastapi import APIRouter, Request

from ..contract.wire import CLASSIFY, EMBED, ClassificationResult
from .bodies import new_id, parse_body, prompts_of, user_of
from .error_shapes import APIError
from .pooling import Fields, Pooler, in_input_order
from .scoring import Scoring
from .schemas import ClassifyRequest, CohereEmbedRequest, EmbeddingRequest, PoolingRequest, TeiEmbedRequest, TeiPredictRequest

TEI_FIELDS = Fields("inputs", empty_code="empty")
COHERE_FIELDS = Fields("texts", dimensions="output_dimension", prompt_name="input_type")
# Cohere's truncate -> the side cut (its default END: the end of a text too long is dropped)
COHERE_TRUNCATE = {"NONE": None, "START": "left", "END": "right"}
# Cohere's input_type -> the checkpoint's named prompts that serve it, the first it has
COHERE_PROMPTS = {"search_query": ("search_query", "query"), "search_document": ("search_document", "document", "passage"),
                  "classification": ("classification",), "clustering": ("clustering",)}


def embedding_routes(scoring: Scoring) -> APIRouter:
    router = APIRouter()
    pooler: Pooler = scoring.pooler

    @router.post("/v1/embeddings")
    async def openai_embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        model = pooler.model_name(body.model)
        results = await _vllm_embed(pooler, request, body)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(r.embedding, body.encoding_format)}
                for i, r in enumerate(results)]
        return {"object": "list", "data": data, "model": model, "usage": _usage(results)}

    @router.post("/pooling")
    async def vllm_pooling(request: Request):
        body = await parse_body(request, PoolingRequest)
        model = pooler.model_name(body.model)
        results, values = await _pooled(pooler, request, body)
        data = [{"index": i, "object": "pooling", "data": _encoded(v, body.encoding_format)} for i, v in enumerate(values)]
        return {"id": new_id("pool"), "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": _usage(results)}

    @router.post("/embed")
    async def tei_embed(request: Request):
        body = await parse_body(request, TeiEmbedRequest)
        _float_only(body.encoding_format)
        pooler.model_name(body.model)
        results = await pooler.embed(prompts_of(body.inputs, "inputs", TEI_FIELDS.empty_code), TEI_FIELDS,
                                     dimensions=body.dimensions, normalize=body.normalize, prompt_name=body.prompt_name,
                                     truncate=_tei_truncate(body), user=user_of(request, body.user))
        return [r.embedding for r in results]

    @router.post("/v2/embed")
    async def cohere_embed(request: Request):
        body = await parse_body(request, CohereEmbedRequest)
        texts = _cohere_texts(body)
        pooler.model_name(body.model)
        results = await pooler.embed(texts, COHERE_FIELDS, dimensions=body.output_dimension,
                                     prompt_name=_cohere_prompt(pooler, body.input_type),
                                     truncate=COHERE_TRUNCATE[body.truncate or "END"], user=user_of(request, None))
        tokens = sum(r.prompt_tokens for r in results)
        return {"id": new_id("embed"), "embeddings": {"float": [r.embedding for r in results]}, "texts": texts,
                "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens},
                         "tokens": {"input_tokens": tokens}},
                "response_type": "embeddings_by_type"}

    return router


def classification_routes(scoring: Scoring) -> APIRouter:
    router = APIRouter()
    pooler: Pooler = scoring.pooler

    @router.post("/classify")
    async def vllm_classify(request: Request):
        body = await parse_body(request, ClassifyRequest)
        _float_only(body.encoding_format)
        model = pooler.model_name(body.model)
        results, shared = await _classify(pooler, request, body)
        data = []
        for i, r in enumerate(results):
            values = _class_values(r, body.use_activation)
            data.append({"index": i, "label": r.label, "probs": values, "num_classes": len(values)})
        return {"id": new_id("classify"), "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": _usage(results, shared)}

    @router.post("/predict")
    async def tei_predict(request: Request):
        body = await parse_body(request, TeiPredictRequest)
        _float_only(body.encoding_format)
        pooler.model_name(body.model)
        single, inputs = _predict_inputs(body.inputs)
        results = await _predict(pooler, inputs, _tei_truncate(body), user_of(request, body.user))
        scores, top_k = _predict_options(body)
        answers = [sorted(({"score": s, "label": label} for s, label in zip(scores(r), r.labels)),
                          key=lambda x: -x["score"])[:top_k] for r in results]
        return answers[0] if single else answers

    return router


# -- embeddings -------------------------------------------------------------------------------------
async def _vllm_embed(pooler: Pooler, request: Request, body: EmbeddingRequest) -> list:
    # vLLM's use_activation on an embedding is its normalisation (it replaced `normalize`)
    return await pooler.embed(prompts_of(body.input, "input"), dimensions=body.dimensions, normalize=body.use_activation,
                              truncate=_vllm_truncate(body, pooler), user=user_of(request, body.user),
                              priority=-(body.priority or 0))  # vLLM: lower runs earlier; the engine: higher


async def _pooled(pooler: Pooler, request: Request, body: PoolingRequest) -> tuple[list, list[list[float]]]:
    """(results, each one's values) of vLLM's /pooling: the task asked, else the checkpoint's own."""
    task = body.task or pooler.model.task
    if task == EMBED:
        results = await _vllm_embed(pooler, request, body)
        return results, [r.embedding for r in results]
    if task != CLASSIFY:
        raise APIError(f"task {task!r} is not served here: embed or classify (absent: {pooler.model.task!r}, what this "
                       "model answers)", param="task")
    if body.dimensions is not None:
        raise APIError("dimensions applies to task embed, not classify", param="dimensions")
    results = await pooler.classify(prompts_of(body.input, "input"), truncate=_vllm_truncate(body, pooler),
                                    user=user_of(request, body.user), priority=-(body.priority or 0))
    return results, [_class_values(r, body.use_activation) for r in results]


def _encoded(values: list[float], encoding_format: str):
    """A vector as the API sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def _cohere_texts(body: CohereEmbedRequest) -> list[str]:
    """Cohere's texts, once the call asks nothing this server does not serve (images, mixed
    inputs, other embedding types, a token cap of its own)."""
    for name in ("images", "inputs"):
        if getattr(body, name) is not None:
            raise APIError(f"{name} is not supported: this server embeds texts (give texts)", param=name)
    if body.max_tokens is not None:
        raise APIError("max_tokens is not supported: a text over the model's input length is cut by truncate (START, "
                       "END) or refused (NONE)", param="max_tokens")
    other = [t for t in body.embedding_types or ["float"] if t != "float"]
    if other:
        raise APIError(f"embedding_types {other} are not served here: only 'float'", param="embedding_types")
    if body.texts is None:
        raise APIError("texts is required (this server embeds texts)", param="texts")
    return body.texts


def _cohere_prompt(pooler: Pooler, input_type: str | None) -> str | None:
    """The checkpoint's named prompt for Cohere's input_type, where it has one; else none (the
    engine then applies the checkpoint's default prompt, if it names one)."""
    if input_type is None:
        return None
    if input_type not in COHERE_PROMPTS:
        raise APIError(f"input_type {input_type!r} is not served here: one of {', '.join(COHERE_PROMPTS)} (texts only)",
                       param="input_type")
    return next((name for name in COHERE_PROMPTS[input_type] if name in pooler.model.prompts), None)


# -- classification ---------------------------------------------------------------------------------
async def _classify(pooler: Pooler, request: Request, body: ClassifyRequest) -> tuple[list[ClassificationResult], int]:
    """(results, the tokens of the prompt they share, 0 for none): vLLM's `input` (each prompt on
    its own), or `prompt` with `responses` (best-of-N: one multi-item request, the prompt computed
    once)."""
    user, priority = user_of(request, body.user), -(body.priority or 0)
    if body.prompt is None and body.responses is None:
        if body.input is None:
            raise APIError("input is required (or prompt with responses: each response scored after the prompt)",
                           param="input")
        return await pooler.classify(prompts_of(body.input, "input"), truncate=_vllm_truncate(body, pooler), user=user,
                                     priority=priority), 0
    if body.input is not None:
        raise APIError("give input, or prompt with responses, not both", param="input")
    if body.prompt is None or body.responses is None:
        missing = "prompt" if body.prompt is None else "responses"
        raise APIError(f"{missing} is required: prompt and responses go together", param=missing)
    if body.truncate_prompt_tokens is not None:
        raise APIError("truncate_prompt_tokens applies to input, not to a prompt with responses", param="truncate_prompt_tokens")
    results = await pooler.classify_responses(body.prompt, body.responses, user=user, priority=priority)
    return results, await asyncio.to_thread(pooler.prompt_length, body.prompt)


def _predict_inputs(inputs) -> tuple[bool, list]:
    """(one input?, each input: a text or a pair (a, b)). TEI's reading: a list of exactly two
    texts is one pair; otherwise a list is a batch of texts and pairs."""
    if isinstance(inputs, str):
        return True, [inputs]
    if len(inputs) == 2 and all(isinstance(x, str) for x in inputs):
        return True, [tuple(inputs)]
    if not inputs:
        raise APIError("inputs is empty; give at least one input", code=TEI_FIELDS.empty_code, param="inputs")
    out = []
    for i, x in enumerate(inputs):
        if not isinstance(x, str) and len(x) != 2:
            raise APIError(f"inputs[{i}] has {len(x)} texts: give a text or a pair [a, b]", param="inputs")
        out.append(x if isinstance(x, str) else tuple(x))
    return False, out


async def _predict(pooler: Pooler, inputs: list, truncate: str | None, user: str | None) -> list[ClassificationResult]:
    """Texts each on their own (cut to fit as asked); pairs as multi-item requests (not cut: a pair
    too long is refused); results in input order."""
    singles = [i for i, x in enumerate(inputs) if isinstance(x, str)]
    pairs = [i for i, x in enumerate(inputs) if not isinstance(x, str)]
    parts = await asyncio.gather(
        pooler.classify([inputs[i] for i in singles], TEI_FIELDS, truncate=truncate, user=user) if singles else _none(),
        pooler.classify_pairs([inputs[i] for i in pairs], TEI_FIELDS, user=user) if pairs else _none())
    return in_input_order([singles, pairs], parts, len(inputs))


async def _none() -> list:
    return []


def _predict_options(body: TeiPredictRequest):
    """(the scores of a result, how many labels to return): TEI's raw_scores (the logits), or
    huggingface_hub's parameters (function_to_apply none / softmax / sigmoid, top_k)."""
    parameters = body.parameters or {}
    function = parameters.get("function_to_apply")
    top_k = parameters.get("top_k")
    if function not in (None, "none", "softmax", "sigmoid"):
        raise APIError(f"parameters.function_to_apply {function!r}: one of none, softmax, sigmoid", param="parameters")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise APIError(f"parameters.top_k must be a positive integer, not {top_k!r}", param="parameters")
    if function is None:
        return (lambda r: r.logits) if body.raw_scores else (lambda r: r.probs), top_k
    return lambda r: _activated(r.logits, function), top_k


def _activated(logits: list[float], function: str) -> list[float]:
    if function == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        return [e / sum(exps) for e in exps]
    if function == "sigmoid":
        return [1 / (1 + math.exp(-x)) for x in logits]
    return list(logits)


def _class_values(r: ClassificationResult, use_activation: bool | None) -> list[float]:
    """vLLM's probs: the checkpoint's activation of the logits, or (use_activation false) the logits."""
    return r.logits if use_activation is False else r.probs


# -- what the routes share -------------------------------------------------------------------------
def _vllm_truncate(body, pooler: Pooler) -> str | None:
    """vLLM's truncate_prompt_tokens as the engine's truncate: -1 (or the input length or more) cuts
    a prompt to fit from truncation_side (vLLM's pooling default: right, the start kept)."""
    n = body.truncate_prompt_tokens
    if n is None:
        return None
    if n == -1 or n >= pooler.max_input_len:
        return body.truncation_side or "right"
    raise APIError(f"truncate_prompt_tokens {n} is below the model's input length of {pooler.max_input_len}: this server "
                   "cuts a prompt only to fit the model (-1)", param="truncate_prompt_tokens")


def _tei_truncate(body) -> str | None:
    """TEI's truncate (absent: cut, as --auto-truncate, which /info reports) as the side cut."""
    return None if body.truncate is False else body.truncation_direction.lower()


def _float_only(encoding_format: str | None) -> None:
    if encoding_format not in (None, "float"):
        raise APIError(f"encoding_format {encoding_format!r} is not served on this route: it answers floats (base64: "
                       "POST /v1/embeddings or /pooling)", param="encoding_format")


def _usage(results: list, shared: int = 0) -> dict:
    """The tokens the call consists of: every result's prompt tokens, as vLLM counts them; with a
    `shared` prompt (best-of-N: each response's result counts it and its cached tokens, the call
    holds it once) the prompt once and every response. The tokens read from the prefix cache beside."""
    n = sum(r.prompt_tokens for r in results) - shared * (len(results) - 1)
    cached = results[0].cached_tokens if shared and results else sum(r.cached_tokens for r in results)
    return {"prompt_tokens": n, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}
