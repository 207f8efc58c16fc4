"""The frontend's one way to the engine: the prefillonly Triton model over gRPC streaming.

Each HTTP call opens one bidirectional stream (tritonclient.grpc.aio) carrying its Triton
requests, with the `x-prefillonly-user` header when the call names a user: in a fleet, Envoy
routes the stream by it to the replica holding that user's prefix cache. A stream stays open
until every answer is in (Triton's decoupled model answers each request once).

    upstream = TritonUpstream("127.0.0.1:8001")
    results = await upstream.score_items(shared_ids, item_ids, label_ids, user="u1")   # list[ScoreResult]

Each result is a ScoreResult (prefillonly.contract.wire, decoded from its `result_json` output): tokens
[TokenScore(id, text, logprob, prob)], chosen, top_k, prompt_tokens, cached_tokens; the
prompt_logprobs task's is a PromptLogprobs, the embed task's an EmbeddingResult, the classify
task's a ClassificationResult (one per prompt, or per item). Requests are
built by the clients' rule (wire.request_fields, wire.infer_inputs), the affinity header by its
rule for a user id (wire.routing_headers). Engine errors come back as UpstreamError with the
engine's code ("invalid_request", "overloaded", ...) and message.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from .tenancy import forwarded_headers

from ..contract.decisions import DecisionResult
from ..contract.wire import (CLASSIFY, DECIDE, EMBED, INTERNAL, MODEL, PROMPT_LOGPROBS, RESULT_JSON, UNAVAILABLE,
                             ClassificationResult, EmbeddingResult, PromptLogprobs, ScoreResult, code_of, decode_answers,
                             infer_inputs, request_fields, result_documents, routing_headers)


class UpstreamError(Exception):
    """The engine refused or failed a request: `code` is its machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _error_of(e: Exception) -> UpstreamError:
    """An engine error message ("<code>: ...") keeps its code; anything else (a connection that
    failed, Triton restarting, Envoy's local reply) is "unavailable" or "internal"."""
    if isinstance(e, grpc.aio.AioRpcError):
        text, unavailable = e.details() or "", e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    elif isinstance(e, InferenceServerException):
        text, unavailable = e.message() or str(e), "UNAVAILABLE" in str(e.status() or "")
    else:
        text, unavailable = str(e), False
    code = code_of(text)
    if code is None:
        code = UNAVAILABLE if unavailable else INTERNAL
        text = f"{code}: the engine could not be reached or failed ({type(e).__name__}: {text or e})"
    return UpstreamError(code, text)


class TritonUpstream:
    def __init__(self, url: str, model: str = MODEL):
        self.url = url
        self.model = model
        self._client: grpcclient.InferenceServerClient | None = None
        self._ids = itertools.count()

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:  # created on the running event loop (grpc.aio binds to it)
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except InferenceServerException:
            return False

    # -- the request shapes ----------------------------------------------------------------
    async def score_items(self, shared: list[int], items: list[list[int]], allowed_ids: list[int], *,
                          user: str | None = None, top_k: int = 0, priority: int = 0) -> list[ScoreResult]:
        """One multi-item request: `shared` computed once, each item scored over it."""
        fields = request_fields(shared, allowed_ids, items=items, top_k=top_k or None, priority=priority or None,
                                user=user or None)
        return (await self._stream([self._request(fields)], user))[0]

    async def score_prompts(self, prompts: list[list[int]], allowed_ids: list[int], *, user: str | None = None,
                            top_k: int = 0, priority: int = 0) -> list[ScoreResult]:
        """Independent prompts (token ids), one Triton request each on one stream, so the engine's
        scheduler sees them all at once; results in order."""
        return await self._each(prompts, allowed_ids, user=user, top_k=top_k or None, priority=priority or None)

    async def prompt_logprobs(self, prompts: list[list[int]], *, top_k: int = 0, user: str | None = None) -> list[PromptLogprobs]:
        """Each prompt's own tokens' logprobs from its second token on (the prompt_logprobs task),
        one Triton request each on one stream; results in order."""
        return await self._each(prompts, [], user=user, task=PROMPT_LOGPROBS, top_k=top_k or None)

    async def embed(self, prompts: list, *, dimensions: int | None = None, normalize: bool | None = None,
                    prompt_name: str | None = None, truncate: str | None = None, user: str | None = None,
                    priority: int = 0) -> list[EmbeddingResult]:
        """Each prompt's embedding (texts, which the engine tokenizes after the named prompt, or
        token-id lists), one Triton request each on one stream; an option left None is the
        checkpoint's (its normalisation, its default prompt) or none (no truncation: a prompt too
        long is refused)."""
        return await self._each(prompts, [], user=user, task=EMBED, dimensions=dimensions, normalize=normalize,
                                prompt_name=prompt_name, truncate=truncate, priority=priority or None)

    async def classify(self, prompts: list, *, truncate: str | None = None, user: str | None = None,
                       priority: int = 0) -> list[ClassificationResult]:
        """A sequence classifier's label scores after each prompt, one Triton request each."""
        return await self._each(prompts, [], user=user, task=CLASSIFY, truncate=truncate, priority=priority or None)

    async def classify_items(self, prompt, items: list, *, user: str | None = None,
                             priority: int = 0) -> list[ClassificationResult]:
        """One request: `prompt` computed once, the label scores after prompt + each item (texts,
        appended without special tokens, or token-id lists): best-of-N responses to one prompt."""
        fields = request_fields(prompt, [], items=items, task=CLASSIFY, priority=priority or None, user=user or None)
        return (await self._stream([self._request(fields)], user))[0]

    async def decide(self, call_json: str, *, user: str | None = None, priority: int = 0) -> DecisionResult:
        """One decision call (the decide task: its questions over one shared prefill of its input)."""
        fields = request_fields(call_json, [], task=DECIDE, priority=priority or None, user=user or None)
        return (await self._stream([self._request(fields)], user, decode=_decisions))[0][0]

    # -- plumbing ------------------------------------------------------------------------------
    async def _each(self, prompts: list, allowed: list, *, user: str | None, **options) -> list:
        """One Triton request per prompt (request_fields' options; None: not sent) on one stream,
        so the engine's scheduler sees them all at once; each one's single result, in order."""
        requests = [self._request(request_fields(p, allowed, user=user or None, **options)) for p in prompts]
        return [r[0] for r in await self._stream(requests, user)]

    def _request(self, fields: dict) -> dict:
        return {"model_name": self.model, "inputs": infer_inputs(grpcclient, fields), "request_id": str(next(self._ids)),
                "outputs": [grpcclient.InferRequestedOutput(RESULT_JSON)]}

    async def _stream(self, requests: list[dict], user: str | None, decode=decode_answers) -> list[list[ScoreResult]]:
        """Send `requests` on one stream; each one's results, in order. The first error fails the
        call (UpstreamError); the stream is cancelled, which takes the rest out of the engine's
        queue."""
        done = asyncio.Event()

        async def feed():
            for r in requests:
                yield r
            await done.wait()  # keep our side open until every answer is in

        answers: dict[str, list[ScoreResult]] = {}
        # the affinity header, and the tenant and key of the call (tenancy.py) when keys are on
        stream = self.client.stream_infer(feed(), headers={**routing_headers(user), **forwarded_headers()} or None)
        try:
            async for result, error in stream:
                if error is not None:
                    raise _error_of(error)
                rid = result.get_response().id
                answers[rid] = decode(result.as_numpy(RESULT_JSON).reshape(-1))
                if len(answers) == len(requests):
                    break
        except UpstreamError:
            raise
        except Exception as e:  # the stream itself failed: Triton down, restarting, unreachable
            raise _error_of(e) from e
        finally:
            done.set()
            if len(answers) < len(requests):
                stream.cancel()
        if len(answers) < len(requests):
            raise UpstreamError(UNAVAILABLE, f"{UNAVAILABLE}: the engine's stream ended before every answer came back")
        return [answers[r["request_id"]] for r in requests]


def _decisions(values) -> list[DecisionResult]:
    return [DecisionResult.from_dict(d) for d in result_documents(values)]
