"""The frontend's one way to the engine: the prefillonly Triton model over gRPC streaming.

Each HTTP call opens one bidirectional stream (tritonclient.grpc.aio) carrying its Triton
requests, with the `x-prefillonly-user` header when the call names a user: in a fleet, Envoy
routes the stream by it to the replica holding that user's prefix cache. A stream stays open
until every answer is in (Triton's decoupled model answers each request once).

    upstream = TritonUpstream("127.0.0.1:8001")
    results = await upstream.score_items(shared_ids, item_ids, label_ids, user="u1")   # list[dict]

Each result is a ScoreResult as a dict (its `result_json` output): tokens [{id, text, logprob,
prob}], chosen, top_k, prompt_tokens, cached_tokens. Engine errors come back as UpstreamError
with the engine's code ("invalid_request", "overloaded", ...) and message.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from ..serving.host.envoy_config import USER_HEADER  # the front door's affinity key
from ..serving.model.protocol import RETRY_LATER_CODES as ENGINE_RETRY_LATER_CODES

# codes whose requests may succeed later or elsewhere (the engine's, and a Triton or connection
# that is not there right now): the HTTP answer is 503
RETRY_LATER_CODES = (*ENGINE_RETRY_LATER_CODES, "unavailable")


class UpstreamError(Exception):
    """The engine refused or failed a request: `code` is its machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def retry_later(self) -> bool:
        return self.code in RETRY_LATER_CODES


def _error_of(e: Exception) -> UpstreamError:
    """An engine error message ("<code>: ...") keeps its code; anything else (a connection that
    failed, Triton restarting, Envoy's local reply) is "unavailable" or "internal"."""
    if isinstance(e, grpc.aio.AioRpcError):
        text, unavailable = e.details() or "", e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    elif isinstance(e, InferenceServerException):
        text, unavailable = e.message() or str(e), "UNAVAILABLE" in str(e.status() or "")
    else:
        text, unavailable = str(e), False
    code = text.split(":", 1)[0].strip() if ":" in text else ""
    if not (code.isidentifier() and code.islower()):
        code = "unavailable" if unavailable else "internal"
        text = f"{code}: the engine could not be reached or failed ({type(e).__name__}: {text or e})"
    return UpstreamError(code, text)


def _bytes(values) -> np.ndarray:
    return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


class TritonUpstream:
    def __init__(self, url: str, model: str = "prefillonly"):
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

    # -- the two request shapes ------------------------------------------------------------
    async def score_items(self, shared: list[int], items: list[list[int]], allowed_ids: list[int], *,
                          user: str | None = None, top_k: int = 0, priority: int = 0) -> list[dict]:
        """One multi-item request: `shared` computed once, each item scored over it."""
        inputs = [_input("input_ids", np.asarray(shared, np.int64), "INT64"),
                  _input("item_ids", np.asarray([t for item in items for t in item], np.int64), "INT64"),
                  _input("item_lengths", np.asarray([len(item) for item in items], np.int64), "INT64")]
        if priority:
            inputs.append(_input("priority", np.asarray([priority], np.int64), "INT64"))
        return (await self._stream([self._request(inputs, allowed_ids, user, top_k)], user))[0]

    async def score_prompts(self, prompts: list[list[int]], allowed_ids: list[int], *, user: str | None = None,
                            top_k: int = 0) -> list[dict]:
        """Independent prompts (token ids), one Triton request each on one stream, so the engine's
        scheduler sees them all at once; results in order."""
        requests = [self._request([_input("input_ids", np.asarray(p, np.int64), "INT64")], allowed_ids, user, top_k)
                    for p in prompts]
        return [r[0] for r in await self._stream(requests, user)]

    # -- plumbing ------------------------------------------------------------------------------
    def _request(self, inputs: list, allowed_ids: list[int], user: str | None, top_k: int) -> dict:
        inputs = inputs + [_input("allowed_token_ids", np.asarray(allowed_ids, np.int64), "INT64")]
        if top_k:
            inputs.append(_input("top_k", np.asarray([top_k], np.int64), "INT64"))
        if user:
            inputs.append(_input("user", _bytes([user]), "BYTES"))
        return {"model_name": self.model, "inputs": inputs, "request_id": str(next(self._ids)),
                "outputs": [grpcclient.InferRequestedOutput("result_json")]}

    async def _stream(self, requests: list[dict], user: str | None) -> list[list[dict]]:
        """Send `requests` on one stream; each one's results, in order. The first error fails the
        call (UpstreamError); the stream is cancelled, which takes the rest out of the engine's
        queue."""
        done = asyncio.Event()

        async def feed():
            for r in requests:
                yield r
            await done.wait()  # keep our side open until every answer is in

        answers: dict[str, list[dict]] = {}
        headers = {USER_HEADER: user} if user else None
        stream = self.client.stream_infer(feed(), headers=headers)
        try:
            async for result, error in stream:
                if error is not None:
                    raise _error_of(error)
                rid = result.get_response().id
                answers[rid] = [json.loads(x) for x in result.as_numpy("result_json").reshape(-1)]
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
            raise UpstreamError("unavailable", "unavailable: the engine's stream ended before every answer came back")
        return [answers[r["request_id"]] for r in requests]
