"""The HTTP routes: each API's request shape in, its response shape out (scoring.py does the work).

    POST /v1/rerank, /rerank     Jina / vLLM rerank        {id, model, results[{index, relevance_score, document}], usage}
    POST /rerank (with `texts`)  Text Embeddings Inference [{index, score, text?}]
    POST /v2/rerank              Cohere v2 rerank          {id, results[{index, relevance_score}], meta}
    POST /v1/score               SGLang scoring            {scores[[p per label]], model, usage, object: "scoring"}
    POST /score (/v1/score with `text_1`)  vLLM score      {id, object: "list", model, data[{index, object, score}], usage}
    POST /generative_scoring     vLLM generative scoring   {id, object: "list", model, data[{index, object, score}], usage}
    POST /v1/decisions           OpenAI decisions          {id, object: "decision", model, answers[], usage}
    POST /v1/systemone           System One decisions      {id, object: "systemone", model, answers{id: ...}, usage}
                                 (both: frontend/decisions.py; one engine request per call)
    POST /v1/completions         OpenAI, one token         {id, object: "text_completion", choices[{text, logprobs}], usage}
                                 (echo + logprobs: the prompt's own tokens scored, frontend/echo.py)
    POST /v1/embeddings, /pooling, /classify, /embed, /predict, /v2/embed
                                 OpenAI, vLLM, TEI and Cohere embeddings and classification (frontend/pooling_routes.py)
    GET  /v1/models              the presets and the raw model
    GET  /health                 200 while the engine is ready, else 503
    GET  /info, /version         what is served (TEI's /info fields), the version

The user (body `user`, else the `x-prefillonly-user` header) is the cache namespace and the
stream's affinity header. build_app assembles one router per API family (health and models,
Jina / vLLM / TEI rerank, Cohere rerank, SGLang / vLLM scoring, OpenAI completions, decisions,
embeddings, classification) behind one set of error handlers, each refusal in the called API's shape.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import version as package_version
import math
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..contract.checkpoint import CLASSIFIER_HEAD
from ..contract.errors import PrefillOnlyError
from ..contract.wire import INTERNAL, ScoreResult
from .generate import generate_routes
from .tenancy import forward_identity
from .bodies import body_as as _model, new_id as _new_id, parse_body as _parse, prompts_of, read_json as _json, user_of as _user
from .decisions import OPENAI_FIELDS, SYSTEMONE_FIELDS, openai_answer, openai_call, systemone_answer, systemone_call, usage
from .documents import document_text, returned_document
from .echo import echo_choice
from .error_shapes import APIError, error_response, validation_message
from .lenient import IGNORED_HEADER
from .pooling import PooledModel
from .pooling_routes import classification_routes, embedding_routes
from .schemas import CompletionRequest, PairScoreRequest, RerankRequest, ScoreRequest, TeiRerankRequest
from .scoring import Scored, Scoring, log_odds, relevance

log = logging.getLogger("prefillonly.frontend")
COHERE_PATHS = ("/v2/rerank", "/v2/embed")
TEI_PATHS = ("/embed", "/predict")  # TEI's own paths (its rerank shares /rerank with Jina's and vLLM's)
TRUNCATED_HEADER = "x-prefillonly-truncated-documents"  # indices of the documents cut to fit, comma-separated
COHERE_DEFAULT_MAX_TOKENS_PER_DOC = 4096  # Cohere v2 cuts every document at 4,096 tokens by default
TEI_POOLING = {"last": "last_token", "mean": "mean", "cls": "cls"}  # contract.pooling_files' modes, as TEI names them


def build_app(scoring: Scoring, triton_http: str | None = None) -> FastAPI:
    """The scoring APIs over `scoring`; with `triton_http` (API keys on), also Triton's HTTP generate
    passed through with the caller's tenant (generate.py)."""
    app = FastAPI(title="prefillonly scoring APIs", docs_url=None, redoc_url=None)
    _handle_errors(app)
    _report_headers(app)
    forward_identity(app)
    for routes in (health_routes, rerank_routes, cohere_routes, score_routes, completion_routes, decision_routes,
                   embedding_routes, classification_routes):
        app.include_router(routes(scoring))
    if triton_http:
        app.include_router(generate_routes(triton_http))
    return app


def _report_headers(app: FastAPI) -> None:
    """What a call's answer reports beside its body: the fields it ignored, the documents it cut."""
    @app.middleware("http")
    async def _headers(request: Request, call_next):
        response = await call_next(request)
        ignored, truncated = getattr(request.state, "ignored", None), getattr(request.state, "truncated", None)
        if ignored:
            response.headers[IGNORED_HEADER] = ",".join(ignored)
        if truncated:
            response.headers[TRUNCATED_HEADER] = ",".join(map(str, truncated))
        return response


def _handle_errors(app: FastAPI) -> None:
    """Every refusal, and a bug too, answered in the error shape of the API called."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(_style(request), e)

    @app.exception_handler(PrefillOnlyError)
    async def _refused(request: Request, e: PrefillOnlyError):  # the rendering's refusals (a document too long)
        return error_response(_style(request), APIError(str(e), code=e.code, param=getattr(e, "param", None)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # a bug: still an answer in the API's shape
        log.exception("internal error on %s", request.url.path)
        return error_response(_style(request), APIError(f"{type(e).__name__}: {e}", status=500, code=INTERNAL))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return error_response(_style(request), APIError(message, param=param))

    @app.exception_handler(404)
    async def _not_found(request: Request, e):
        return error_response(_style(request), APIError(f"no route {request.method} {request.url.path}", status=404,
                                                        code="not_found"))


def _style(request: Request) -> str:
    """The error shape of the API called: the path, and for /rerank the body read so far."""
    if request.url.path in COHERE_PATHS:
        return "cohere"
    if request.url.path in TEI_PATHS:
        return "tei"
    body = getattr(request.state, "body", None)
    if request.url.path == "/rerank" and isinstance(body, dict) and "texts" in body:
        return "tei"
    if request.url.path == "/v1/score" and not (isinstance(body, dict) and "text_1" in body):
        return "sglang"
    return "openai"


# -- health and models ------------------------------------------------------------------------------
def health_routes(scoring: Scoring) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        ready = await scoring.upstream.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @router.get("/info")
    async def info():
        """TEI's /info fields that hold here (clients read max_input_length and model_id)."""
        default = next(iter(scoring.presets), scoring.base_model)
        return {"model_id": default, "model_sha": None, "model_dtype": "auto", "model_type": tei_model_type(scoring.pooler.model),
                "max_input_length": scoring.tokens.max_input_len, "max_client_batch_size": scoring.limits.max_documents,
                "max_concurrent_requests": scoring.limits.max_prompts, "auto_truncate": True,
                "version": package_version("prefillonly"), "router": "prefillonly", "models": scoring.model_names()}

    @router.get("/version")
    async def version():
        return {"version": package_version("prefillonly")}

    @router.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "prefillonly"}
                                           for name in scoring.model_names()]}

    return router


def tei_model_type(model: PooledModel) -> dict:
    """What TEI's /info says the served checkpoint is: a classifier (its labels), an embedding
    model (its pooling, in TEI's names), else a reranker (a causal LM: what it is used for here)."""
    if model.head == CLASSIFIER_HEAD:
        return {"classifier": {"id2label": {str(i): name for i, name in enumerate(model.labels)},
                               "label2id": {name: i for i, name in enumerate(model.labels)}}}
    if model.pooling is not None:
        return {"embedding": {"pooling": TEI_POOLING[model.pooling]}}
    return {"reranker": {}}


# -- rerank ---------------------------------------------------------------------------------------
def rerank_routes(scoring: Scoring) -> APIRouter:
    """Jina / vLLM rerank, and TEI's on /rerank (TEI clients call /rerank with `texts`)."""
    router = APIRouter()

    @router.post("/v1/rerank")
    async def rerank_v1(request: Request):
        return await _jina_rerank(scoring, request, await _parse(request, RerankRequest))

    @router.post("/rerank")
    async def rerank_plain(request: Request):
        raw = await _json(request)
        if isinstance(raw, dict) and "texts" in raw:
            return await _tei_rerank(scoring, request, _model(request, TeiRerankRequest, raw))
        return await _jina_rerank(scoring, request, _model(request, RerankRequest, raw))

    return router


def cohere_routes(scoring: Scoring) -> APIRouter:
    router = APIRouter()

    @router.post("/v2/rerank")
    async def rerank_v2(request: Request):
        body = await _parse(request, RerankRequest)
        if body.max_tokens_per_doc is None:
            body.max_tokens_per_doc = COHERE_DEFAULT_MAX_TOKENS_PER_DOC
        _, scored = await _rerank(scoring, request, body)
        ranked = _top(scored, body.top_n)
        meta = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                "tokens": {"input_tokens": scored.prompt_tokens, "output_tokens": 0}}
        if scored.truncated:
            meta["warnings"] = [f"documents {', '.join(map(str, scored.truncated))} were cut to fit"]
        return {"id": _new_id("rerank"), "results": _results(body.documents, ranked, bool(body.return_documents)),
                "meta": meta}

    return router


async def _rerank(scoring: Scoring, request: Request, body: RerankRequest) -> tuple[str, Scored]:
    """A rerank body's documents scored: their text (`rank_fields`' keys), cut to
    max_tokens_per_doc (0: no limit) and then, unless `truncate` is false, to fit the model."""
    if body.relevant_spans is not None:
        raise APIError("relevant_spans is not supported by this server", param="relevant_spans")
    preset = scoring.preset(body.model, for_rerank=True)
    documents = [document_text(d, body.rank_fields, i) for i, d in enumerate(body.documents)]
    truncate = None if body.truncate is False else (body.truncation_side or "right")
    # Cohere and vLLM: lower priority numbers run earlier; the engine runs higher ones first
    scored = await scoring.rerank(preset, body.query, documents, instruction=body.instruction,
                                  max_tokens_per_doc=body.max_tokens_per_doc or None, truncate=truncate,
                                  user=_user(request, body.user), priority=-(body.priority or 0))
    request.state.truncated = scored.truncated
    return preset.name, scored


async def _jina_rerank(scoring: Scoring, request: Request, body: RerankRequest) -> dict:
    model, scored = await _rerank(scoring, request, body)
    with_docs = True if body.return_documents is None else body.return_documents
    return {"id": _new_id("rerank"), "model": model, "results": _results(body.documents, _top(scored, body.top_n), with_docs),
            "usage": _usage(scored)}


async def _tei_rerank(scoring: Scoring, request: Request, body: TeiRerankRequest) -> list[dict]:
    preset = scoring.preset(body.model, for_rerank=True)
    if not body.texts:
        raise APIError("texts is empty; give at least one", code="empty", param="texts")
    truncate = None if body.truncate is False else body.truncation_direction.lower()
    scored = await scoring.rerank(preset, body.query, body.texts, instruction=None, max_tokens_per_doc=None,
                                  truncate=truncate, user=_user(request, body.user))
    request.state.truncated = scored.truncated
    out = []
    for s in _top(scored, None):
        entry = {"index": s.index, "score": log_odds(s) if body.raw_scores else relevance(s)}
        if body.return_text:
            entry["text"] = body.texts[s.index]
        out.append(entry)
    return out


def _results(documents: list, ranked: list, with_documents: bool) -> list[dict]:
    out = []
    for s in ranked:
        entry = {"index": s.index, "relevance_score": relevance(s)}
        if with_documents:
            entry["document"] = returned_document(documents[s.index])
        out.append(entry)
    return out


def _top(scored: Scored, top_n: int | None) -> list:
    """Scores highest first (ties in document order), cut to top_n (None or 0: all)."""
    if top_n is not None and top_n < 0:
        raise APIError(f"top_n must be >= 0 (0 or absent: every document), not {top_n}", param="top_n")
    ranked = sorted(scored.scores, key=lambda s: (-relevance(s), s.index))
    return ranked[:top_n] if top_n else ranked


# -- score ----------------------------------------------------------------------------------------
def score_routes(scoring: Scoring) -> APIRouter:
    """SGLang's /v1/score (apply_softmax defaults to False) and vLLM's /generative_scoring (True)."""
    router = APIRouter()

    @router.post("/v1/score")
    async def score_sglang(request: Request):
        raw = await _json(request)
        if isinstance(raw, dict) and "text_1" in raw:  # vLLM's score API on the same path
            return await _pair_score(scoring, request, _model(request, PairScoreRequest, raw))
        body, model, scored = await _score(scoring, request, _model(request, ScoreRequest, raw), apply_softmax=False,
                                           join_text=True)
        return {"scores": [_label_values(s, body.apply_softmax) for s in scored.scores], "model": model,
                "usage": _usage(scored), "object": "scoring"}

    @router.post("/score")
    async def score_pairs(request: Request):
        return await _pair_score(scoring, request, await _parse(request, PairScoreRequest))

    @router.post("/generative_scoring")
    async def score_vllm(request: Request):
        body, model, scored = await _score(scoring, request, await _parse(request, ScoreRequest), apply_softmax=True)
        data = [{"index": s.index, "object": "score", "score": _label_values(s, body.apply_softmax)[0]} for s in scored.scores]
        return {"id": _new_id("score"), "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": _usage(scored)}

    return router


async def _score(scoring: Scoring, request: Request, body: ScoreRequest, apply_softmax: bool,
                 join_text: bool = False) -> tuple[ScoreRequest, str, Scored]:
    """join_text: SGLang's tokenization (query + item as one string). SGLang takes one string as
    one item and no items as an empty answer."""
    if body.apply_softmax is None:
        body.apply_softmax = apply_softmax
    preset = scoring.preset(body.model, for_rerank=False)
    items = [body.items] if isinstance(body.items, str) else body.items
    if not items and join_text:
        return body, preset.name, Scored([], 0, 0)
    scored = await scoring.score(preset, body.query, items, body.label_token_ids, item_first=body.item_first,
                                 user=_user(request, body.user), join_text=join_text, priority=-(body.priority or 0))
    return body, preset.name, scored


async def _pair_score(scoring: Scoring, request: Request, body: PairScoreRequest) -> dict:
    """vLLM's score API: text_1 (one query, or one per text_2) against text_2, each pair's score
    the rerank preset's relevance; one multi-item request per distinct query."""
    preset = scoring.preset(body.model, for_rerank=True)
    firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not firsts or not seconds:
        raise APIError("text_1 and text_2 must not be empty", param="text_1" if not firsts else "text_2")
    if len(firsts) not in (1, len(seconds)):
        raise APIError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or one per text_2",
                       param="text_1")
    user, priority = _user(request, body.user), -(body.priority or 0)
    groups = [(firsts[0], seconds)] if len(firsts) == 1 else [(q, [d]) for q, d in zip(firsts, seconds)]
    parts = await asyncio.gather(*(scoring.rerank(preset, q, docs, instruction=None, max_tokens_per_doc=None, truncate=None,
                                                  user=user, priority=priority) for q, docs in groups))
    scores = [relevance(s) for part in parts for s in part.scores]
    total = Scored([], sum(p.prompt_tokens for p in parts), sum(p.cached_tokens for p in parts))
    return {"id": _new_id("score"), "object": "list", "created": int(time.time()), "model": preset.name,
            "data": [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)], "usage": _usage(total)}


def _label_values(s, apply_softmax: bool) -> list[float]:
    # apply_softmax: renormalised over the labels; else each label's full-vocabulary probability
    return [label.prob if apply_softmax else math.exp(label.logprob) for label in s.labels]


# -- completions ----------------------------------------------------------------------------------
def completion_routes(scoring: Scoring) -> APIRouter:
    """OpenAI's /v1/completions, for exactly one token."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        prompts = _completion_prompts(scoring, body)
        if body.echo:
            return await _echo_completion(scoring, body, prompts, _user(request, body.user))
        k, allowed = body.logprobs or 0, body.allowed_token_ids
        top_k = k if allowed is None else 0
        results = await scoring.complete(prompts, allowed, max(top_k, 1 if allowed is None else 0), _user(request, body.user))
        generate = body.max_tokens != 0
        choices = [_choice(i, r, allowed is not None, k if body.logprobs is not None else None, generate, scoring.eos_id)
                   for i, r in enumerate(results)]
        return _completion(body, choices, sum(r.prompt_tokens for r in results), len(results) if generate else 0,
                           sum(r.cached_tokens for r in results))

    return router


def _completion_prompts(scoring: Scoring, body: CompletionRequest) -> list:
    """The request's prompts, once it asks only what one greedy token can answer: a served model,
    at most one token, no sampling knobs."""
    scoring.preset(body.model, for_rerank=False)  # a served name, or 404 listing them
    if body.max_tokens is not None and not 0 <= body.max_tokens <= 1:
        raise APIError(f"max_tokens must be 0 or 1, not {body.max_tokens}: this engine scores the next token and "
                       "never decodes further", param="max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= scoring.limits.max_logprobs:
        raise APIError(f"logprobs must be between 0 and {scoring.limits.max_logprobs}, not {body.logprobs}", param="logprobs")
    for name, bad in (("stream", body.stream), ("n", body.n != 1), ("best_of", body.best_of not in (None, 1))):
        if bad:
            raise APIError(f"{name} is not supported: one prompt gives exactly one token here", param=name)
    body.allowed_token_ids = _allowed_ids(body)
    if body.echo and body.allowed_token_ids is not None:
        raise APIError("allowed_token_ids does not apply with echo: echo scores the prompt's own tokens", param="allowed_token_ids")
    prompts = prompts_of(body.prompt, "prompt")
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise APIError("allowed_token_ids is empty", param="allowed_token_ids")
    return prompts


def _allowed_ids(body: CompletionRequest) -> list[int] | None:
    """The allowed tokens: vLLM's allowed_token_ids, or OpenAI's logit_bias of +100 on each (which
    makes those tokens the only ones chosen); any other bias would reshape the distribution."""
    if not body.logit_bias:
        return body.allowed_token_ids
    if body.allowed_token_ids is not None:
        raise APIError("give allowed_token_ids or logit_bias, not both", param="logit_bias")
    ids = []
    for key, bias in body.logit_bias.items():
        if not key.strip().isdigit():
            raise APIError(f"logit_bias keys are token ids; {key!r} is not one", param="logit_bias")
        if bias < 100:
            raise APIError(f"logit_bias[{key}] is {bias:g}: only +100 (choose among these tokens) is supported here, "
                           "other biases would change the probabilities", param="logit_bias")
        ids.append(int(key))
    return ids


async def _echo_completion(scoring: Scoring, body: CompletionRequest, prompts: list, user: str | None) -> dict:
    """echo: every prompt token's logprob (and the `logprobs` most likely tokens at each), then the
    generated token when max_tokens is 1 (frontend/echo.py)."""
    k = body.logprobs or 0
    ids = await scoring.prompt_ids(prompts)
    answers = await scoring.echo(ids, k, user)
    generate = body.max_tokens != 0
    choices = [echo_choice(i, p, a, scoring.token_text, k, generate, prompt if isinstance(prompt, str) else None)
               for i, (p, a, prompt) in enumerate(zip(ids, answers, prompts))]
    return _completion(body, choices, sum(map(len, ids)), len(ids) if generate else 0, sum(a.cached_tokens for a in answers))


def _completion(body: CompletionRequest, choices: list[dict], prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": body.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}}


def _choice(index: int, result: ScoreResult, among_allowed: bool, logprobs: int | None, generate: bool,
            eos_id: int | None) -> dict:
    """One OpenAI choice: the chosen token (the allowed one with the highest probability, or the
    vocabulary's argmax), its full-vocabulary logprob, and the `logprobs` most likely candidates
    (among the allowed tokens when they were given, else over the vocabulary). An end-of-sequence
    token is finish_reason "stop" with empty text, as OpenAI and vLLM answer it."""
    if not generate:  # max_tokens 0: the prompt was run (and its prefix cached), nothing generated
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "length"}
    candidates = sorted(result.tokens, key=lambda t: -t.logprob) if among_allowed else result.top_k
    chosen = result.chosen if among_allowed else result.top_k[0]
    lp = None
    if logprobs is not None:
        top = {}
        for t in candidates[:logprobs]:
            top.setdefault(t.text, t.logprob)
        lp = {"tokens": [chosen.text], "token_logprobs": [chosen.logprob], "top_logprobs": [top], "text_offset": [0]}
    if chosen.id == eos_id:
        return {"index": index, "text": "", "logprobs": lp, "finish_reason": "stop"}
    return {"index": index, "text": chosen.text, "logprobs": lp, "finish_reason": "length"}


# -- decisions -------------------------------------------------------------------------------------
def decision_routes(scoring: Scoring) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/decisions")
    async def openai_decisions(request: Request):
        body = await _json(request)
        call = openai_call(body)
        model = _decision_model(scoring, request, body, OPENAI_FIELDS)
        result = await _decide(scoring, call, _user(request, body.get("prompt_cache_key") or body.get("user")))
        return {"id": _new_id("dec"), "object": "decision", "created_at": int(time.time()), "model": model,
                "answers": [openai_answer(q, a) for q, a in zip(call.questions, result.answers)], "usage": usage(result),
                "template": result.template}

    @router.post("/v1/systemone")
    async def systemone(request: Request):
        body = await _json(request)
        call, ids = systemone_call(body)
        model = _decision_model(scoring, request, body, SYSTEMONE_FIELDS)
        result = await _decide(scoring, call, _user(request, body.get("user")))
        return {"id": _new_id("s1"), "object": "systemone", "created": int(time.time()), "model": model,
                "answers": {i: systemone_answer(q, a) for i, q, a in zip(ids, call.questions, result.answers)},
                "usage": {"input_tokens": result.input_tokens, "output_tokens": 0, "cached_tokens": result.cached_tokens},
                "template": result.template}

    return router


def _decision_model(scoring: Scoring, request: Request, body: dict, fields: frozenset) -> str:
    """The served model the body names (404 listing them otherwise); the fields ignored go back
    in the answer's header."""
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("required: the served model's name", param="model")
    scoring.preset(model, for_rerank=False)
    request.state.ignored = sorted(set(body) - fields)
    return model


async def _decide(scoring: Scoring, call, user: str | None):
    try:
        return await scoring.decide(call, user)
    except APIError as e:
        if e.code == "prompt_too_long":
            e.param = "input"
        raise


# -- what every route shares -----------------------------------------------------------------------
def _usage(scored: Scored) -> dict:
    return {"prompt_tokens": scored.prompt_tokens, "total_tokens": scored.prompt_tokens, "cached_tokens": scored.cached_tokens}
