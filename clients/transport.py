"""How requests reach the prefillonly model: the one transport layer of the client, the
benchmarks and the tests (standard library, numpy and tritonclient only).

A request is a dict of fields named as the model's inputs (`request_fields` builds one); a value
is a str, bytes, int, float or bool, a list of one kind, or a numpy array. The same dict goes as
HTTP generate's JSON body (`http_generate`), or as tritonclient tensors (`infer_inputs`) on a gRPC
stream (`GrpcStream`) or in a plain infer through the prefillonly_sync forwarder (`unary_infer`).
A request that names its `user` (the prefix-cache namespace) also carries the affinity header, so
that behind the fleet's Envoy it lands on the replica holding that user's cached prefix.

What the model's side defines (the names, the request rule, the affinity header and its value,
result_json's form) is prefillonly.contract.wire, the one wire contract: imported from the installed
package, or, where only numpy and tritonclient are installed, loaded from this checkout's
src/contract/wire.py (a standard-library file), so that this folder runs from the repository on its own.

Those raise what tritonclient and urllib raise. `answer()` and its parts instead return an Answer
that says how the request ended (an answer, an error answer, none within the timeout, a failed
connection), in any of the four call styles: what a benchmark judges every request by.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import queue
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def _wire():
    try:
        from prefillonly.contract import wire
    except ImportError:  # prefillonly not installed (it needs torch): the checkout's copy of the same file
        path = Path(__file__).resolve().parents[1] / "src" / "contract" / "wire.py"
        if not path.is_file():
            raise ImportError(f"clients/ needs prefillonly.contract.wire: install prefillonly, or run it from the repository "
                              f"(where {path} is)") from None
        spec = importlib.util.spec_from_file_location("prefillonly_wire", path)
        wire = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(wire)
    return wire


wire = _wire()
MODEL, SYNC_MODEL, USER_HEADER, RESULT_JSON = wire.MODEL, wire.SYNC_MODEL, wire.USER_HEADER, wire.RESULT_JSON
EMBED, CLASSIFY = wire.EMBED, wire.CLASSIFY
as_array, infer_inputs, request_fields, result_documents = (wire.as_array, wire.infer_inputs, wire.request_fields,
                                                            wire.result_documents)
decode_answers = wire.decode_answers  # result_json -> the result types (EmbeddingResult, ClassificationResult, ...)
STYLES = ("http_generate", "grpc_stream", "http_infer", "grpc_unary")  # the ways a request reaches the model


def routing_headers(fields: dict) -> dict:
    """The affinity header of a request that names its user (nothing otherwise), by wire's rule:
    a user id that is not printable ASCII (not a valid header value) goes as a stable digest."""
    return wire.routing_headers(fields.get("user"))


def json_body(fields: dict) -> bytes:
    """The fields as a JSON body: arrays as lists; bytes go in raw (input that is not UTF-8 cannot
    be JSON, and the server must be shown what it does with it)."""
    raw: dict[str, bytes] = {}

    def encode(value):
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, bytes):
            key = f"@@raw{len(raw)}@@"
            raw[key] = value
            return key
        return [encode(v) for v in value] if isinstance(value, list) else value

    body = json.dumps({k: encode(v) for k, v in fields.items()}).encode()
    for key, value in raw.items():
        body = body.replace(key.encode(), value)
    return body


def post(url: str, data: bytes, headers: dict | None = None, timeout: float = 120.0):
    """POST `data` as JSON: (HTTP status, the reply's bytes, its headers), error statuses included;
    a connection that fails raises urllib's error."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def post_json(url: str, body: dict, timeout: float = 120.0, headers: dict | None = None) -> tuple[int, dict]:
    """POST a JSON body (Triton's /generate or /infer): (HTTP status, decoded JSON reply), errors
    included; a reply that is not a JSON object comes back as {"error": its text}."""
    status, raw, _ = post(url, json_body(body), headers, timeout)
    try:
        reply = json.loads(raw or b"{}")
    except ValueError:
        reply = {"error": raw[:300].decode(errors="replace")}
    return status, reply if isinstance(reply, dict) else {"error": str(reply)[:300]}


def http_generate(url: str, fields: dict, timeout: float = 120.0, model: str = MODEL,
                  headers: dict | None = None) -> tuple[int, dict]:
    """Triton's HTTP generate endpoint of `model` (url: http://host:port), with the affinity header
    (and `headers`: an API key's)."""
    return post_json(f"{url}/v2/models/{model}/generate", fields, timeout, {**routing_headers(fields), **(headers or {})})


def unary_infer(url: str, fields: dict, timeout: float, protocol: str = "http", model: str = SYNC_MODEL,
                headers: dict | None = None):
    """One plain infer (HTTP /infer or gRPC ModelInfer; the non-decoupled forwarder unless `model`
    says otherwise) on a client of its own: tritonclient's InferResult. An error answer raises
    tritonclient's InferenceServerException with the server's message."""
    if protocol == "http":
        import tritonclient.http as module

        client = module.InferenceServerClient(url.split("://", 1)[-1], network_timeout=timeout, connection_timeout=timeout)
        options = {}
    else:
        import tritonclient.grpc as module

        client = module.InferenceServerClient(url)
        options = {"client_timeout": timeout}
    try:
        return client.infer(model, infer_inputs(module, fields), headers={**routing_headers(fields), **(headers or {})} or None,
                            **options)
    finally:
        client.close()


class GrpcStream:
    """One gRPC bidirectional stream to the decoupled model, opened with `headers` (Envoy routes a
    whole stream by its opening headers). call() sends one request and waits for its final
    response: one request in flight at a time, as a stream's error responses carry no request id
    and answers can only be matched by order; send() and get() put several in flight.

    `target`: the server's gRPC address, or a tritonclient.grpc client to reuse (close() leaves it open)."""

    def __init__(self, target, headers: dict | None = None, model: str = MODEL):
        import tritonclient.grpc as grpcclient

        self.module, self.model, self.broken = grpcclient, model, False
        self._own_client = isinstance(target, str)
        self.client = grpcclient.InferenceServerClient(target) if self._own_client else target
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)), headers=headers)

    def send(self, fields: dict, request_id: str = "") -> None:
        self.client.async_stream_infer(self.model, infer_inputs(self.module, fields), request_id=request_id)

    def get(self, timeout: float = 120.0):
        """(result, error) of the next final response; queue.Empty after `timeout` seconds."""
        return self.answers.get(timeout=timeout)

    def call(self, fields: dict, timeout: float):
        """send, then get: (result, error). After a timeout or a failed send the stream is `broken`
        (a late answer must not be taken for the next request's), and after an error with a status
        too (the stream itself ended with it)."""
        try:
            self.send(fields)
        except Exception as e:
            self.broken = True
            refusal = self._refusal()  # the stream ended before the request went out: why, if it said
            if refusal is None:
                raise
            return refusal
        try:
            result, error = self.get(timeout)
        except Exception:
            self.broken = True
            raise
        if error is not None and error.status():
            self.broken = True
        return result, error

    def _refusal(self, wait_s: float = 5.0):
        """(None, error) of a stream that ended at its start (the front door refusing it, e.g. a
        missing API key: UNAUTHENTICATED): tritonclient then refuses every send, and the reason
        comes only through the callback. None when no such error arrives."""
        try:
            result, error = self.get(wait_s)
        except queue.Empty:
            return None
        return (None, error) if error is not None else None

    def close(self) -> None:
        """End the stream, cancelling what is in flight if it is broken."""
        with contextlib.suppress(Exception):  # the stream or the channel may be gone already
            self.client.stop_stream(cancel_requests=self.broken)
            if self._own_client:
                self.client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- requests that say how they ended --------------------------------------------------------------
@dataclass
class Answer:
    kind: str  # ok | error (a final error answer) | lost (none within the timeout) | transport (the connection failed)
    status: str  # HTTP code, gRPC status name, "ok"/"error" on a stream (its errors carry no status), LOST, EXC
    message: str = ""  # the error's; for an answer, how many results and the first chosen token
    results: list = field(default_factory=list)  # the ScoreResult dicts of an ok answer
    seconds: float = 0.0


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


def _failed(e: BaseException, t0: float, lost: bool) -> Answer:
    return Answer("lost" if lost else "transport", "LOST" if lost else "EXC", f"{type(e).__name__}: {e}", seconds=_since(t0))


def _answered(values, status: str, t0: float) -> Answer:
    """The answer that brought `values` as its result_json."""
    try:
        results = result_documents(values)
    except (ValueError, TypeError) as e:
        return Answer("error", status, f"unparsable result_json: {e}", seconds=_since(t0))
    chosen = results[0].get("chosen", {}).get("text") if results else None
    message = f"{len(results)} result(s), first chose {chosen!r}" if results else "answered, no result_json"
    return Answer("ok", status, message, results, _since(t0))


def grpc_status(e) -> str:
    """The status name of a tritonclient error ("" for an error answer on a stream)."""
    return str(e.status() or "").replace("StatusCode.", "")


def generate_answer(url: str, fields: dict, timeout: float, model: str = MODEL) -> Answer:
    t0 = time.perf_counter()
    try:
        status, reply = http_generate(url, fields, timeout, model)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        return _failed(e, t0, _is_timeout(e))
    if status != 200:
        return Answer("error", str(status), str(reply.get("error", reply)), seconds=_since(t0))
    return _answered(reply.get(RESULT_JSON), str(status), t0)


def stream_answer(stream: GrpcStream, fields: dict, timeout: float) -> Answer:
    """One request on an open stream; afterwards stream.broken says whether it must be opened again."""
    t0 = time.perf_counter()
    try:
        result, error = stream.call(fields, timeout)
    except queue.Empty:
        return Answer("lost", "LOST", f"no final response within {timeout:.0f} s", seconds=_since(t0))
    except Exception as e:  # the stream is gone (e.g. the server closed it)
        return _failed(e, t0, lost=False)
    if error is not None:
        return Answer("error", grpc_status(error) or "error", error.message() or str(error), seconds=_since(t0))
    return _answered(result.as_numpy(RESULT_JSON), "ok", t0)


def unary_answer(protocol: str, url: str, fields: dict, timeout: float, model: str = SYNC_MODEL) -> Answer:
    from tritonclient.utils import InferenceServerException

    t0 = time.perf_counter()
    try:
        result = unary_infer(url, fields, timeout, protocol, model)
    except InferenceServerException as e:
        status = grpc_status(e) or "error"
        lost = status == "DEADLINE_EXCEEDED" and _since(t0) >= timeout * 0.99
        return Answer("lost" if lost else "error", status, e.message() or str(e), seconds=_since(t0))
    except Exception as e:  # gevent's timeout, a reset connection
        return _failed(e, t0, "timeout" in type(e).__name__.lower() or _is_timeout(e))
    return _answered(result.as_numpy(RESULT_JSON), "200" if protocol == "http" else "OK", t0)


def answer(style: str, http_url: str, grpc_url: str, fields: dict, timeout: float) -> Answer:
    """One request in `style` (one of STYLES), on a connection of its own."""
    if style == "http_generate":
        return generate_answer(http_url, fields, timeout)
    if style == "grpc_stream":
        with GrpcStream(grpc_url) as stream:
            return stream_answer(stream, fields, timeout)
    if style == "http_infer":
        return unary_answer("http", http_url, fields, timeout)
    return unary_answer("grpc", grpc_url, fields, timeout)
