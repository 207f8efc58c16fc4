"""Reliability benchmark: the serve stack as `scripts/serve.sh` runs it (Envoy in front of a
supervised tritonserver, default model) under bad input and under a long mixed soak.

    .venv/bin/python -m perf.reliability all              # matrix + soak (3,000 requests, 400 users), ~1-1.5 h on 2 cores
    .venv/bin/python -m perf.reliability matrix           # the bad-input matrix only (~1 min)
    .venv/bin/python -m perf.reliability soak --requests 5000 --users 600 --concurrency 8
    .venv/bin/python -m perf.reliability all --quick --out /tmp/rel-quick   # smoke run (200 requests, 20 users), ~4 min

1. matrix: ~25 request cases (bad inputs, limits, a 2 MB prompt, a body over Envoy's ~4 MB limit,
   the `triton_grpc_error` header, a few good requests), each sent in every call style: HTTP
   generate and gRPC streaming on the decoupled `prefillonly`, HTTP /infer and gRPC unary through
   the `prefillonly_sync` forwarder. Each cell records the status and the start of the message;
   a cell that differs from what the case expects (an answer for bad input, an error for good
   input, a 5xx/INTERNAL status for bad input, no answer at all) is flagged. Afterwards: the
   server must be alive with `restarts == 0`.
2. soak: a fresh stack with the engine's DEFAULT cache budget, `--requests` mixed requests
   (70% single prompt = user profile + post, 10% multi-item, 10% three prompts, 10% bad input)
   from `--users` cache namespaces, split between HTTP generate and gRPC streaming over
   `--concurrency` client threads, one request in flight per thread. Every request must get a
   final response (lost = none within `--timeout`). Every second: VmRSS of tritonserver, of each
   Python backend stub and of Envoy, plus the engine's metrics (cache bytes, budgets). The
   engine stub's RSS is compared with baseline (RSS after ready) + cache budget + the largest
   measured activation peak (ScoreResult.peak_bytes).

Writes <out>/matrix.json, soak.json, soak_samples.csv, soak_requests.csv, soak_rss.png and the
"## Reliability" section of perf/RESULTS.md (with --quick: <out>/RESULTS.md, so a smoke run never
overwrites the real results). Default out: perf/results/reliability (quick: perf/out/reliability_quick).
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import queue
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from perf import benchutil as bu
from prefillonly.serving.host.server_tree import TRITON_SERVER_VERSION

SECTION = "## Reliability"
MODEL, SYNC_MODEL = "prefillonly", "prefillonly_sync"
REPO = bu.REPO_ROOT / "model_repository"
STYLES = ("http_generate", "grpc_stream", "http_infer", "grpc_unary")
STYLE_TITLES = {"http_generate": "HTTP generate", "grpc_stream": "gRPC streaming",
                "http_infer": "HTTP /infer (sync)", "grpc_unary": "gRPC unary (sync)"}
YES_NO = [" Yes", " No"]
YES_ID, NO_ID = 9230, 2838  # " Yes", " No" in SmolLM2's vocabulary (49,152 tokens)
MESSAGE_CHARS = 90
MATRIX_TIMEOUT_S = 120.0
# statuses that mean "the server failed", not "your input is bad"
SERVER_FAULT_STATUSES = {"500", "502", "503", "504", "INTERNAL", "UNAVAILABLE", "UNKNOWN"}


# ==============================================================================================
# the serve stack
# ==============================================================================================
class Stack:
    """Envoy + supervised tritonserver on a copy of model_repository/ (engine settings set by
    keyword), with the supervisor's watchdog running, as `scripts/serve.sh` runs it."""

    def __init__(self, out_dir: Path, name: str, **engine_parameters):
        self.out_dir, self.name, self.parameters = out_dir, name, engine_parameters
        self.log_path = out_dir / f"{name}-tritonserver.log"
        self.events: list[str] = []  # what the supervisor said (restarts), what the watchdog hit
        self.stop_event = threading.Event()
        self.sup = None
        self._tmp = None
        self._watcher = None

    def __enter__(self) -> "Stack":
        from prefillonly.serving.host.addresses import free_ports
        from prefillonly.serving.host.supervisor import ServeOptions, Supervisor
        from prefillonly.serving.host.model_settings import copy_model_repository

        self._tmp = tempfile.mkdtemp(prefix="prefillonly-reliability-")
        repo = copy_model_repository(REPO, Path(self._tmp) / "repo", **self.parameters)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        http, grpc, metrics = free_ports(3)
        options = ServeOptions(model_repository=str(repo), http_port=http, grpc_port=grpc, metrics_port=metrics,
                               ready_timeout_s=900, log_path=str(self.log_path))
        self.sup = Supervisor(options, say=self._say)
        t0 = time.perf_counter()
        try:
            if not self.sup.start(self.stop_event):
                raise RuntimeError("serve stack start was interrupted")
        except BaseException:
            self.__exit__()
            raise
        self.ready_s = time.perf_counter() - t0
        self._watcher = threading.Thread(target=self._watch, name="reliability-watchdog", daemon=True)
        self._watcher.start()
        bu.log(f"{self.name}: serve stack ready in {self.ready_s:.0f} s (Envoy http {self.http_url}, grpc {self.grpc_url}; "
               f"tritonserver pid {self.sup.server.pid}; log {self.log_path})")
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self._watcher is not None:
            self._watcher.join(10)
        if self.sup is not None:
            self.sup.stop(timeout=60)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _say(self, msg: str) -> None:
        self.events.append(msg)
        bu.log(f"{self.name}: supervisor: {msg}")

    def _watch(self) -> None:
        try:
            self.sup.watch(self.stop_event)
        except Exception as e:  # e.g. Envoy died: the watchdog gives up; the report says so
            self.events.append(f"watchdog stopped: {type(e).__name__}: {e}")
            bu.log(f"{self.name}: watchdog stopped: {e}")

    @property
    def http_url(self) -> str:
        return self.sup.http_url

    @property
    def grpc_url(self) -> str:
        return self.sup.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.sup.metrics_url

    def processes(self) -> dict[str, list[int]]:
        """Role -> pids for everything the stack runs right now (pids change after a restart).
        The stubs of one model (the forwarder has several instances) share a role."""
        procs = {"tritonserver": [self.sup.server.pid]}
        for pid in self.sup.server.stub_pids():
            procs.setdefault(f"stub {stub_model(pid)}", []).append(pid)
        if self.sup.proxy is not None:
            procs["envoy"] = [self.sup.proxy.pid]
        return procs

    def health(self) -> dict:
        """Is everything still up, has nothing restarted, does a good request get an answer?"""
        from prefillonly.serving.host.process import process_alive

        answer = http_generate(self.http_url, {"text_input": "Is the sky blue? Answer:", "allowed_tokens": YES_NO}, 60)
        return {"tritonserver_running": self.sup.server.poll() is None,
                "stubs_alive": all(process_alive(p) for p in self.sup.server.stub_pids()) and bool(self.sup.server.stub_pids()),
                "envoy_running": self.sup.proxy is None or self.sup.proxy.poll() is None,
                "restarts": self.sup.restarts, "good_request": f"{answer.status} {answer.message}"[:80],
                "good_request_ok": answer.kind == "ok", "supervisor_events": list(self.events),
                "log_problems": log_problems(self.log_path)}


def stub_model(pid: int) -> str:
    """The model a Python backend stub serves: its first argument is <repo>/<model>/<version>/model.py."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid{pid}"
    for arg in args:
        if arg.endswith(b"model.py"):
            return Path(arg.decode(errors="replace")).parent.parent.name
    return f"pid{pid}"


def rss_bytes(pid: int | None) -> int | None:
    """VmRSS of a process, None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


LOG_PROBLEM_MARKERS = ("Segmentation fault", "signal 11", "core dumped", "terminate called", "Traceback",
                       "Stub process", "is not healthy", "Killed")


def log_problems(path: Path) -> list[str]:
    """Lines of the tritonserver log that speak of a crash (first 10)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:200] for line in lines if any(m in line for m in LOG_PROBLEM_MARKERS)][:10]


# ==============================================================================================
# one request in any call style: fields (JSON-like values) -> Answer
# ==============================================================================================
@dataclass
class Answer:
    kind: str  # ok | error (a final error response) | lost (none within the timeout) | transport (connection failed)
    status: str  # HTTP code, gRPC status name, "ok"/"error" on a stream, LOST, EXC
    message: str = ""
    results: list = field(default_factory=list)  # the ScoreResult dicts of an ok answer
    seconds: float = 0.0
    stream_ended: bool = False  # gRPC: the stream itself ended (must be opened again)


# inputs that Triton's generate endpoint (and our tensors) carry as one-element tensors
SCALAR_INPUTS = {"cache_prefix_len", "top_k", "priority", "user", "item_template", "apply_chat_template"}
TRITON_DTYPES = {"object": "BYTES", "int64": "INT64", "bool": "BOOL", "float32": "FP32"}


def as_array(value) -> np.ndarray:
    """A field value (str, bytes, int, float, bool or a list of one kind) as the tensor we send."""
    values = value if isinstance(value, list) else [value]
    if all(isinstance(v, (str, bytes)) for v in values):  # also the empty list: BYTES [0]
        return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    if all(isinstance(v, bool) for v in values):
        return np.array(values, dtype=bool)
    if all(isinstance(v, int) for v in values):
        return np.array(values, dtype=np.int64)
    return np.array(values, dtype=np.float32)


def tensor_inputs(module, fields: dict) -> list:
    """tritonclient InferInputs (module: tritonclient.http or .grpc) for the fields."""
    inputs = []
    for name, value in fields.items():
        array = as_array(value)
        tensor = module.InferInput(name, list(array.shape), TRITON_DTYPES[str(array.dtype)])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def json_body(fields: dict) -> bytes:
    """The generate endpoint's JSON body; bytes values go in raw (non-UTF-8 input cannot be JSON)."""
    raw: dict[str, bytes] = {}

    def encode(value):
        if isinstance(value, bytes):
            key = f"@@raw{len(raw)}@@"
            raw[key] = value
            return key
        return [encode(v) for v in value] if isinstance(value, list) else value

    body = json.dumps({k: encode(v) for k, v in fields.items()}).encode()
    for key, value in raw.items():
        body = body.replace(key.encode(), value)
    return body


def parse_results(values) -> list[dict]:
    """result_json as the generate endpoint (a scalar for one result) or a tensor gives it."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)):
        values = [values]
    return [json.loads(v) for v in values]


def ok_message(results: list[dict]) -> str:
    if not results:
        return "answered, no result_json"
    chosen = results[0].get("chosen", {}).get("text")
    return f"{len(results)} result(s), first chose {chosen!r}"


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


def http_generate(url: str, fields: dict, timeout: float, model: str = MODEL) -> Answer:
    """POST to /v2/models/<model>/generate (through Envoy)."""
    req = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=json_body(fields),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        kind = "lost" if is_timeout(e) else "transport"
        return Answer(kind, "LOST" if kind == "lost" else "EXC", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    try:
        reply = json.loads(raw or b"{}")
    except ValueError:
        reply = {"error": raw[:300].decode(errors="replace")}
    if not isinstance(reply, dict):
        reply = {"error": str(reply)[:300]}
    if status == 200:
        try:
            results = parse_results(reply.get("result_json"))
        except ValueError as e:
            return Answer("error", str(status), f"unparsable result_json: {e}", seconds=seconds)
        return Answer("ok", str(status), ok_message(results), results, seconds)
    return Answer("error", str(status), str(reply.get("error", reply)), seconds=seconds)


def grpc_status_name(e) -> str:
    return str(e.status() or "").replace("StatusCode.", "")


class GrpcStream:
    """One gRPC bidirectional stream to the decoupled model, one request in flight at a time (a
    stream's error responses carry no request id, so answers are matched by order)."""

    def __init__(self, url: str, headers: dict | None = None):
        import tritonclient.grpc as grpcclient

        self.module = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)), headers=headers)
        self.broken = False

    def call(self, fields: dict, timeout: float) -> Answer:
        t0 = time.perf_counter()
        try:
            self.client.async_stream_infer(MODEL, tensor_inputs(self.module, fields))
            result, error = self.answers.get(timeout=timeout)
        except queue.Empty:
            self.broken = True  # a late answer must not be taken for the next request's
            return Answer("lost", "LOST", f"no final response within {timeout:.0f} s", seconds=time.perf_counter() - t0)
        except Exception as e:  # the stream is gone (e.g. the server closed it)
            self.broken = True
            return Answer("transport", "EXC", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        if error is not None:
            status = grpc_status_name(error)
            self.broken = bool(status)  # a status means the stream itself ended with it
            return Answer("error", status or "error", error.message() or str(error), seconds=seconds, stream_ended=bool(status))
        try:
            results = parse_results(result.as_numpy("result_json"))
        except (ValueError, TypeError) as e:
            return Answer("error", "ok", f"unparsable result_json: {e}", seconds=seconds)
        return Answer("ok", "ok", ok_message(results), results, seconds)

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=self.broken)
            self.client.close()
        except Exception:
            pass


def grpc_stream_once(url: str, fields: dict, timeout: float) -> Answer:
    stream = GrpcStream(url)
    try:
        return stream.call(fields, timeout)
    finally:
        stream.close()


def http_infer(url: str, fields: dict, timeout: float) -> Answer:
    """KServe /v2/models/prefillonly_sync/infer with tritonclient.http (binary tensors)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url.split("://", 1)[-1], network_timeout=timeout, connection_timeout=timeout)
    t0 = time.perf_counter()
    try:
        result = client.infer(SYNC_MODEL, tensor_inputs(httpclient, fields))
        results = parse_results(result.as_numpy("result_json"))
        return Answer("ok", "200", ok_message(results), results, time.perf_counter() - t0)
    except InferenceServerException as e:
        return Answer("error", str(e.status() or "error"), e.message() or str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # gevent's timeout, a reset connection
        kind = "lost" if "timeout" in type(e).__name__.lower() or is_timeout(e) else "transport"
        return Answer(kind, "LOST" if kind == "lost" else "EXC", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    finally:
        client.close()


def grpc_unary(url: str, fields: dict, timeout: float) -> Answer:
    """Plain gRPC ModelInfer on the forwarder."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    t0 = time.perf_counter()
    try:
        result = client.infer(SYNC_MODEL, tensor_inputs(grpcclient, fields), client_timeout=timeout)
        results = parse_results(result.as_numpy("result_json"))
        return Answer("ok", "OK", ok_message(results), results, time.perf_counter() - t0)
    except InferenceServerException as e:
        status = grpc_status_name(e) or "error"
        kind = "lost" if status == "DEADLINE_EXCEEDED" and time.perf_counter() - t0 >= timeout * 0.99 else "error"
        return Answer(kind, status, e.message() or str(e), seconds=time.perf_counter() - t0)
    except Exception as e:
        return Answer("transport", "EXC", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    finally:
        client.close()


def call(style: str, stack: Stack, fields: dict, timeout: float) -> Answer:
    if style == "http_generate":
        return http_generate(stack.http_url, fields, timeout)
    if style == "grpc_stream":
        return grpc_stream_once(stack.grpc_url, fields, timeout)
    if style == "http_infer":
        return http_infer(stack.http_url, fields, timeout)
    return grpc_unary(stack.grpc_url, fields, timeout)


# ==============================================================================================
# 1. the bad-input matrix
# ==============================================================================================
@dataclass
class Case:
    name: str
    fields: dict
    expect: str  # ok | error | 413 (Envoy's body limit) | any (either answer is defensible)
    styles: tuple = STYLES  # the call styles the case applies to (others: n/a)
    special: str | None = None  # a case that is more than one call
    note: str = ""  # why a flagged cell may be Triton's behaviour rather than ours (shown only when flagged)


QUESTION = "Is the sky blue on a clear day? Answer:"
BIG_PROMPT = "hello world " * 170_000  # 2,040,000 bytes: over max_prompt_bytes (8,192 tokens x 162 bytes = 1,327,104)
HUGE_BODY_PROMPT = "hello world " * 349_526  # a body of ~4.2 MB: over 4 MiB and over Envoy's max_request_bytes (4,000,000)


def matrix_cases() -> list[Case]:
    http_only = ("http_generate", "http_infer")
    return [
        Case("good: one prompt", {"text_input": QUESTION, "allowed_tokens": YES_NO}, "ok"),
        Case("good: multi-item (2 items)", {"text_input": "User likes hiking.", "items": ["Alpine trails", "Stock news"],
                                             "item_template": "\nPost: {item}\nClick? Answer:", "allowed_tokens": YES_NO,
                                             "cache_prefix_len": 4, "user": "matrix"}, "ok"),  # the profile is 4 tokens
        Case("good: two prompts, allowed ids", {"text_input": ["Is fire hot? Answer:", "Is ice hot? Answer:"],
                                                 "allowed_token_ids": [YES_ID, NO_ID]}, "ok"),
        Case("allowed \"Yes\" and \" Yes\" (two different tokens)", {"text_input": QUESTION, "allowed_tokens": ["Yes", " Yes"]}, "ok"),
        Case("missing prompt", {"allowed_tokens": YES_NO}, "error"),
        Case("both text_input and input_ids", {"text_input": QUESTION, "input_ids": [1, 2, 3], "allowed_tokens": YES_NO}, "error"),
        Case("empty text", {"text_input": "", "allowed_tokens": YES_NO}, "error"),
        Case("no allowed tokens", {"text_input": QUESTION}, "error"),
        Case("allowed string of two tokens (\"Yes please\")", {"text_input": QUESTION, "allowed_tokens": ["Yes please"]}, "error"),
        Case("duplicate allowed tokens", {"text_input": QUESTION, "allowed_tokens": [" Yes", " Yes"]}, "error"),
        Case("prompt token id out of vocabulary (100,000)", {"input_ids": [1, 2, 100_000], "allowed_token_ids": [YES_ID]}, "error"),
        Case("negative allowed token id", {"text_input": QUESTION, "allowed_token_ids": [-1]}, "error"),
        Case("top_k too big (100,000)", {"text_input": QUESTION, "allowed_tokens": YES_NO, "top_k": 100_000}, "error"),
        Case("cache_prefix_len over the prompt (10,000)", {"text_input": QUESTION, "allowed_tokens": YES_NO,
                                                           "cache_prefix_len": 10_000}, "any"),
        Case("unknown input name (temperature)", {"text_input": QUESTION, "allowed_tokens": YES_NO, "temperature": 0.7}, "error",
             note="Triton's generate endpoint passes JSON fields that are not model inputs as request parameters, "
                  "so the model never sees an unknown input there"),
        Case("wrong dtype (FP32 input_ids)", {"input_ids": [1.5, 2.5, 3.5], "allowed_token_ids": [YES_ID]}, "error",
             note="over HTTP generate the status comes from Triton's own JSON-to-tensor conversion, before the model"),
        Case("non-UTF-8 bytes in text_input", {"text_input": b"caf\xe9 \xff\xfe Answer:", "allowed_tokens": YES_NO}, "error"),
        Case("items without a prompt", {"items": ["Alpine trails", "Stock news"], "allowed_tokens": YES_NO}, "error"),
        Case("item_template without {item}", {"text_input": "User likes hiking.", "items": ["Alpine trails"],
                                               "item_template": "\nPost: none\nClick? Answer:", "allowed_tokens": YES_NO}, "error"),
        Case("too many prompts (1,100)", {"text_input": ["Is it? Answer:"] * 1100, "allowed_tokens": [" Yes"]}, "error"),
        Case("too many items (1,000)", {"text_input": "Profile.", "items": ["x"] * 1000, "allowed_tokens": [" Yes"]}, "error"),
        Case("too many allowed ids (300)", {"text_input": "Hi", "allowed_token_ids": list(range(300))}, "error"),
        Case("prompt over max_prompt_bytes (2.04 MB)", {"text_input": BIG_PROMPT, "allowed_tokens": [" Yes"]}, "error"),
        Case("HTTP body over 4 MiB (4.19 MB)", {"text_input": HUGE_BODY_PROMPT, "allowed_tokens": [" Yes"]}, "413", styles=http_only),
        Case("header triton_grpc_error: true, error on the stream", {"text_input": QUESTION}, "error",
             styles=("grpc_stream",), special="grpc_error_header"),
    ]


def grpc_error_header_cell(stack: Stack, case: Case) -> Answer:
    """A bad request then a good one on one stream opened with `triton_grpc_error: true` (the
    header made Triton end the stream, and crashed it with a request in flight)."""
    stream = GrpcStream(stack.grpc_url, headers={"triton_grpc_error": "true"})
    try:
        bad = stream.call(case.fields, MATRIX_TIMEOUT_S)
        if stream.broken:
            bad.message = f"[the stream ended] {bad.message}"
            return bad
        good = stream.call({"text_input": QUESTION, "allowed_tokens": YES_NO}, MATRIX_TIMEOUT_S)
        bad.message = f"[then a good request on the stream: {good.kind}] {bad.message}"
        if good.kind != "ok":
            bad.kind = "transport"  # the stream did not survive: flagged
        return bad
    finally:
        stream.close()


def verdict(case: Case, answer: Answer) -> bool:
    """Did the cell get what the case expects?"""
    if answer.kind in ("lost", "transport"):
        return False
    if case.expect == "413":
        return answer.status == "413"
    if case.expect == "ok":
        return answer.kind == "ok"
    if case.expect == "error":
        return answer.kind == "error" and answer.status not in SERVER_FAULT_STATUSES
    return answer.status not in SERVER_FAULT_STATUSES  # any


def run_matrix(stack: Stack) -> dict:
    rows = []
    for case in matrix_cases():
        cells = {}
        for style in STYLES:
            if style not in case.styles:
                continue
            if case.special == "grpc_error_header":
                answer = grpc_error_header_cell(stack, case)
            else:
                answer = call(style, stack, case.fields, MATRIX_TIMEOUT_S)
            good = verdict(case, answer)
            cells[style] = {"kind": answer.kind, "status": answer.status, "message": answer.message[:MESSAGE_CHARS],
                            "seconds": round(answer.seconds, 3), "as_expected": good}
            bu.log(f"  {'  ' if good else '!!'} {case.name} / {style}: {answer.status} {answer.message[:MESSAGE_CHARS]!r} "
                   f"({answer.seconds:.2f} s)")
        rows.append({"case": case.name, "expect": case.expect, "note": case.note, "cells": cells})
    health = stack.health()
    bu.log(f"after the matrix: tritonserver running {health['tritonserver_running']}, stubs alive {health['stubs_alive']}, "
           f"envoy running {health['envoy_running']}, restarts {health['restarts']}, good request: {health['good_request']}")
    if health["log_problems"]:
        bu.log(f"  tritonserver log: {health['log_problems']}")
    return {"rows": rows, "health": health}


def md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("`", "'")


def render_matrix(data: dict) -> str:
    header = ["case", "expected"] + [STYLE_TITLES[s] for s in STYLES]
    table = []
    for row in data["rows"]:
        cells = []
        for style in STYLES:
            c = row["cells"].get(style)
            if c is None:
                cells.append("n/a")
            else:
                cells.append(("" if c["as_expected"] else "**⚠** ") + md_cell(f"{c['status']} {c['message']}"))
        table.append([md_cell(row["case"]), row["expect"]] + cells)
    flagged = [(row["case"], s) for row in data["rows"] for s, c in row["cells"].items() if not c["as_expected"]]
    notes = [f"- {row['case']}: {row['note']}." for row in data["rows"]
             if row.get("note") and not all(c["as_expected"] for c in row["cells"].values())]
    h = data["health"]
    alive = h["tritonserver_running"] and h["stubs_alive"] and h["envoy_running"] and h["good_request_ok"]
    lines = [
        f"Each case sent once in each call style, through Envoy; a cell is the status (HTTP code; gRPC status name; "
        f"`error`/`ok` on a stream, where an error response carries no status) and the first {MESSAGE_CHARS} characters "
        f"of the message (for an answer: how many results and the first chosen token). **⚠** = not what the case "
        f"expects (an answer to bad input, an error to good input, a 5xx/INTERNAL/UNAVAILABLE status for bad input, "
        f"no answer within {MATRIX_TIMEOUT_S:.0f} s, a broken connection); `any` = either answer is defensible.",
        "",
        bu.markdown_table(header, table),
        "",
        f"Flagged cells: {len(flagged)}" + (": " + "; ".join(f"{md_cell(c)} / {STYLE_TITLES[s]}" for c, s in flagged) if flagged else "") + ".",
        *notes,
        "",
        f"After the matrix: server {'alive' if alive else '**NOT alive**'} (tritonserver running: {h['tritonserver_running']}, "
        f"engine stubs alive: {h['stubs_alive']}, Envoy running: {h['envoy_running']}, a good request: {md_cell(h['good_request'])}), "
        f"restarts = {h['restarts']}" + (" (expected 0)" if h["restarts"] else "") + ".  ",
        "Crash lines in the tritonserver log: " + ("; ".join(md_cell(x) for x in h["log_problems"]) if h["log_problems"] else "none") + ".",
    ]
    return "\n".join(lines)


# ==============================================================================================
# 2. the soak
# ==============================================================================================
WORDS = """
hiking alpine trail summit river canyon forest camping tent backpack compass sunrise glacier meadow
cooking recipe garlic basil pasta risotto sourdough espresso bakery spice curry noodle dumpling
football striker goalkeeper league derby transfer tactics stadium marathon cycling tennis rowing
jazz saxophone vinyl concert orchestra guitar synth playlist festival opera drummer chorus
finance stocks bonds dividend inflation mortgage budget savings pension crypto index portfolio
science physics quantum telescope galaxy neutron enzyme genome fossil volcano climate satellite
travel airport passport ferry hostel museum cathedral bazaar harbor lighthouse vineyard island
gaming console strategy puzzle speedrun arcade pixel dungeon quest multiplayer tournament
gardening tulip compost orchard greenhouse seedling pruning lavender cactus irrigation
parenting toddler school homework bedtime picnic playground birthday lullaby stroller
fashion denim linen sneakers tailoring vintage scarf jacket boutique runway knitwear
photography lens aperture portrait landscape darkroom tripod exposure shutter film
history empire dynasty archive manuscript revolution medieval pharaoh treaty monument
technology laptop compiler database kernel router sensor robot drone battery startup
reading novel poetry library author thriller memoir essay paperback chapter sequel
likes enjoys follows reads watches shares prefers avoids dislikes collects visits bookmarks
often rarely weekly daily recently mostly usually sometimes never always eagerly quietly
new old local remote cheap premium quick slow rare popular classic modern indie handmade
""".split()
SOAK_ALLOWED = YES_NO
ITEM_TEMPLATE = "\nPost: {item}\nWould the user click on this post? Answer:"
KIND_SHARES = (("single", 0.70), ("multi_item", 0.10), ("multi_prompt", 0.10), ("bad", 0.10))
EXPECTED_RESULTS = {"single": 1, "multi_item": 4, "multi_prompt": 3, "bad": 0}


def token_counter():
    """Token count of a text with the default model's tokenizer (the converted model's folder)."""
    from tokenizers import Tokenizer

    from prefillonly.config import default_cache_dir
    from prefillonly.default_model import ensure_default_model

    tokenizer = Tokenizer.from_file(str(Path(ensure_default_model(default_cache_dir())) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = rng.choices(WORDS, k=rng.randint(lo, hi))
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", ";"])


def text_of_tokens(rng: random.Random, count, target: int, lo: int = 6, hi: int = 16) -> str:
    """Sentences of varied words until about `target` tokens."""
    sentences, total = [], 0
    while total < target:
        s = sentence(rng, lo, hi)
        sentences.append(s)
        total += count(" " + s)
    return " ".join(sentences)


@dataclass
class User:
    namespace: str
    profile: str
    profile_tokens: int


def make_users(n: int, seed: int, count, profile_tokens=(300, 900)) -> list[User]:
    """n users, each a profile of profile_tokens (lo, hi) tokens, the same for the same seed."""
    users = []
    for u in range(n):
        rng = random.Random(seed * 1_000_003 + u)
        profile = f"User {u} profile: " + text_of_tokens(rng, count, rng.randint(*profile_tokens))
        users.append(User(f"soak-user-{u:04d}", profile, count(profile)))
    return users


def make_post(rng: random.Random, count) -> str:
    return text_of_tokens(rng, count, rng.randint(30, 60), 5, 12)


@dataclass
class Job:
    index: int
    kind: str  # single | multi_item | multi_prompt | bad
    transport: str  # http_generate | grpc_stream
    user: str
    fields: dict


BAD_VARIANTS = (
    ("duplicate allowed", lambda f: {**f, "allowed_tokens": [" Yes", " Yes"]}),
    ("two-token allowed", lambda f: {**f, "allowed_tokens": ["Yes please"]}),
    ("no allowed tokens", lambda f: {k: v for k, v in f.items() if k != "allowed_tokens"}),
    ("allowed id out of vocabulary", lambda f: {**{k: v for k, v in f.items() if k != "allowed_tokens"},
                                                "allowed_token_ids": [1_000_000]}),
    ("item_template without {item}", lambda f: {**f, "items": ["a post"], "item_template": "\nPost: none\nAnswer:"}),
)


def make_job(index: int, rng: random.Random, users: list[User], count) -> Job:
    user = rng.choice(users)
    r, kind = rng.random(), KIND_SHARES[-1][0]
    for name, share in KIND_SHARES:
        if r < share:
            kind = name
            break
        r -= share
    base = {"allowed_tokens": SOAK_ALLOWED, "user": user.namespace, "cache_prefix_len": user.profile_tokens}
    if kind == "multi_item":
        fields = {**base, "text_input": user.profile, "items": [make_post(rng, count) for _ in range(4)], "item_template": ITEM_TEMPLATE}
    elif kind == "multi_prompt":
        fields = {**base, "text_input": [user.profile + ITEM_TEMPLATE.replace("{item}", make_post(rng, count)) for _ in range(3)]}
    else:
        fields = {**base, "text_input": user.profile + ITEM_TEMPLATE.replace("{item}", make_post(rng, count))}
        if kind == "bad":
            fields = BAD_VARIANTS[index % len(BAD_VARIANTS)][1](fields)
    return Job(index, kind, rng.choice(("http_generate", "grpc_stream")), user.namespace, fields)


def make_jobs(n: int, users: list[User], seed: int, count) -> list[Job]:
    rng = random.Random(seed)
    return [make_job(i, rng, users, count) for i in range(n)]


# -- the load ----------------------------------------------------------------------------------
def outcome_of(job: Job, answer: Answer) -> str:
    """ok | expected_error | unexpected_error | unexpected_ok | wrong_answer | lost | transport."""
    if answer.kind in ("lost", "transport"):
        return answer.kind
    if job.kind == "bad":
        return "expected_error" if answer.kind == "error" else "unexpected_ok"
    if answer.kind == "error":
        return "unexpected_error"
    return "ok" if len(answer.results) == EXPECTED_RESULTS[job.kind] else "wrong_answer"


def record(job: Job, answer: Answer, t_sent: float) -> dict:
    peaks = [r.get("peak_bytes") for r in answer.results if r.get("peak_bytes") is not None]
    return {"index": job.index, "kind": job.kind, "transport": job.transport, "user": job.user, "t_sent": t_sent,
            "seconds": answer.seconds, "outcome": outcome_of(job, answer), "status": answer.status,
            "message": "" if answer.kind == "ok" else answer.message[:160],
            "results": len(answer.results), "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in answer.results),
            "cached_tokens": sum(r.get("cached_tokens", 0) for r in answer.results),
            "peak_bytes": max(peaks) if peaks else None}


def soak_worker(stack: Stack, jobs: queue.Queue, records: list, t0: float, timeout: float) -> None:
    """Takes jobs until none are left, one request in flight; its own gRPC stream, reopened when it ends."""
    stream = None
    try:
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            t_sent = time.monotonic() - t0
            try:
                if job.transport == "http_generate":
                    answer = http_generate(stack.http_url, job.fields, timeout)
                else:
                    stream = stream or GrpcStream(stack.grpc_url)
                    answer = stream.call(job.fields, timeout)
                    if stream.broken:
                        stream.close()
                        stream = None
            except Exception as e:  # a client-side failure must not stop the worker (its jobs would never be sent)
                answer = Answer("transport", "EXC", f"client: {type(e).__name__}: {e}")
            records.append(record(job, answer, t_sent))  # list.append is atomic
    finally:
        if stream is not None:
            stream.close()


class Sampler(threading.Thread):
    """Every `interval` s: VmRSS of every process of the stack and the engine's metrics."""

    METRICS = {"cache_tier1_bytes": 'prefillonly_cache_bytes{tier="1"}', "cache_tier2_bytes": 'prefillonly_cache_bytes{tier="2"}',
               "waiting": "prefillonly_waiting_requests",
               "completed": 'prefillonly_requests_total{outcome="completed"}',
               "failed": 'prefillonly_requests_total{outcome="failed"}',
               "tokens_computed": 'prefillonly_prompt_tokens_total{source="computed"}',
               "tokens_cached": 'prefillonly_prompt_tokens_total{source="cache"}'}
    BUDGETS = ("weights", "activation", "cache_tier1", "cache_tier2")

    def __init__(self, stack: Stack, t0: float, interval: float = 1.0):
        super().__init__(name="reliability-sampler", daemon=True)
        self.stack, self.t0, self.interval = stack, t0, interval
        self.samples: list[dict] = []
        self.budgets: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.sample())
            except Exception as e:  # e.g. mid-restart; the next sample tries again
                bu.log(f"  sample failed: {type(e).__name__}: {e}")
            self.done.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def sample(self) -> dict:
        from prefillonly.serving.host.prometheus import scrape_metrics

        row = {"t_s": round(time.monotonic() - self.t0, 2)}
        for role, pids in self.stack.processes().items():
            sizes = [rss_bytes(pid) for pid in pids]
            # several stubs of one model: their sum (shared pages counted once per process)
            row[f"rss {role}"] = sum(x for x in sizes if x is not None) if any(x is not None for x in sizes) else None
            row[f"n {role}"] = len(pids)
        try:
            values = scrape_metrics(self.stack.metrics_url, prefixes=("prefillonly_",))
        except Exception:  # server down: the RSS columns say more
            values = {}
        for column, key in self.METRICS.items():
            row[column] = values.get(key)
        for kind in self.BUDGETS:
            value = values.get(f'prefillonly_memory_budget_bytes{{kind="{kind}"}}')
            if value is not None:
                self.budgets[kind] = value
        return row


def run_soak(stack: Stack, jobs: list[Job], concurrency: int, timeout: float, interval: float) -> dict:
    t0 = time.monotonic()
    sampler = Sampler(stack, t0, interval)
    sampler.start()
    time.sleep(3 * interval + 0.5)  # the baseline: a few samples before any traffic
    work: queue.Queue = queue.Queue()
    for job in jobs:
        work.put(job)
    records: list[dict] = []
    t_traffic = time.monotonic() - t0
    workers = [threading.Thread(target=soak_worker, args=(stack, work, records, t0, timeout), daemon=True)
               for _ in range(concurrency)]
    for w in workers:
        w.start()
    progress_every = max(1, len(jobs) // 10)
    last_logged = 0
    while any(w.is_alive() for w in workers):
        time.sleep(1.0)
        if len(records) - last_logged >= progress_every:
            last_logged = len(records)
            s = sampler.samples[-1]
            bu.log(f"  {len(records)}/{len(jobs)} answered in {time.monotonic() - t0 - t_traffic:.0f} s; "
                   f"engine stub RSS {mib(engine_rss(s))} MiB, cache {mib(s.get('cache_tier1_bytes'))} MiB")
    t_end = time.monotonic() - t0
    time.sleep(2 * interval)  # a couple of samples after the last answer
    sampler.done.set()
    sampler.join(10)
    return {"t_traffic_s": t_traffic, "t_end_s": t_end, "records": sorted(records, key=lambda r: r["index"]),
            "samples": sampler.samples, "budgets": sampler.budgets, "health": stack.health()}


# -- the numbers -------------------------------------------------------------------------------
def mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def engine_rss(sample: dict):
    return sample.get(f"rss stub {MODEL}")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def column_values(samples: list[dict], column: str, lo: float = -1e12, hi: float = 1e12) -> list[float]:
    """The samples' values of `column` taken between lo and hi seconds."""
    return [s[column] for s in samples if lo <= s["t_s"] <= hi and s.get(column) is not None]


def windows(t_traffic: float, t_end: float) -> dict[str, tuple[float, float]]:
    """The parts of the run the plateau is judged on (seconds since the sampler started)."""
    span = max(t_end - t_traffic, 1e-9)
    return {"baseline": (-1e12, t_traffic), "first_30": (t_traffic, t_traffic + 0.3 * span),
            "first_70": (t_traffic, t_traffic + 0.7 * span), "last_30": (t_end - 0.3 * span, 1e12)}


def rss_table(samples: list[dict], t_traffic: float, t_end: float) -> dict[str, dict]:
    """Per process: baseline (median before traffic), max over the first 30% / 70% and the last
    30% of the traffic, max overall, final."""
    roles = sorted({k[4:] for s in samples for k in s if k.startswith("rss ")})
    w = windows(t_traffic, t_end)
    table = {}
    for role in roles:
        column = f"rss {role}"
        base, everything = column_values(samples, column, *w["baseline"]), column_values(samples, column)
        table[role] = {
            "baseline": statistics.median(base) if base else None,
            **{f"max_{name}": max(column_values(samples, column, *w[name]), default=None)
               for name in ("first_30", "first_70", "last_30")},
            "max": max(everything, default=None),
            "final": everything[-1] if everything else None,
            "processes": max((s.get(f"n {role}") or 0 for s in samples), default=0),
        }
    return table


def plateau(samples: list[dict], t_traffic: float, t_end: float) -> dict:
    """Engine RSS growth from the first 70% to the last 30% of the run, and how much of it the
    prefix cache's own growth explains (RSS rises with the cache until the cache is full)."""
    w = windows(t_traffic, t_end)
    column = f"rss stub {MODEL}"

    def growth(col):
        early, late = column_values(samples, col, *w["first_70"]), column_values(samples, col, *w["last_30"])
        return (max(late) - max(early)) if early and late else None

    rss, cache = growth(column), growth("cache_tier1_bytes")
    return {"rss_growth": rss, "cache_growth": cache,
            "unexplained_growth": None if rss is None or cache is None else rss - cache}


def summarise_soak(soak: dict, args) -> dict:
    records, samples, budgets = soak["records"], soak["samples"], soak["budgets"]
    outcomes = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    by_kind = {}
    for r in records:
        key = f"{r['kind']} / {r['transport']}"
        by_kind.setdefault(key, {}).setdefault(r["outcome"], 0)
        by_kind[key][r["outcome"]] += 1
    latency = {}
    for kind, _ in KIND_SHARES:
        secs = [r["seconds"] for r in records if r["kind"] == kind and r["outcome"] in ("ok", "expected_error")]
        latency[kind] = {"p50_s": percentile(secs, 50), "p99_s": percentile(secs, 99), "max_s": max(secs, default=float("nan"))}
    unexpected = {}
    for r in records:
        if r["outcome"] not in ("ok", "expected_error"):
            unexpected[f"{r['outcome']}: {r['status']} {r['message'][:100]}"] = unexpected.get(
                f"{r['outcome']}: {r['status']} {r['message'][:100]}", 0) + 1
    peaks = [r["peak_bytes"] for r in records if r["peak_bytes"] is not None]
    table = rss_table(samples, soak["t_traffic_s"], soak["t_end_s"])
    engine = table.get(f"stub {MODEL}", {})
    activation_peak = max(peaks, default=0)
    cache_budget = budgets.get("cache_tier1", 0) + budgets.get("cache_tier2", 0)
    bound_baseline = (engine.get("baseline") or 0) + cache_budget + activation_peak
    bound_budget = budgets.get("weights", 0) + cache_budget + activation_peak
    max_cache = max((s.get("cache_tier1_bytes") or 0 for s in samples), default=0)
    traffic = [s for s in samples if s["t_s"] >= soak["t_traffic_s"]]
    first, last = (traffic[0] if traffic else {}), (samples[-1] if samples else {})

    def delta(key):
        return (last.get(key) or 0) - (first.get(key) or 0)

    computed, cached = delta("tokens_computed"), delta("tokens_cached")
    duration = soak["t_end_s"] - soak["t_traffic_s"]
    return {
        "requests": len(records), "duration_s": duration, "requests_per_s": len(records) / duration if duration else 0,
        "outcomes": outcomes, "by_kind": by_kind, "latency": latency, "unexpected": unexpected,
        "answered_ok": outcomes.get("ok", 0), "answered_error": outcomes.get("expected_error", 0) + outcomes.get("unexpected_error", 0),
        "lost": outcomes.get("lost", 0), "transport_failures": outcomes.get("transport", 0),
        "activation_peak_bytes": activation_peak, "budgets": budgets, "rss": table,
        "bound_baseline_bytes": bound_baseline, "bound_budget_bytes": bound_budget,
        "engine_max_rss": engine.get("max"),
        "within_bound": engine.get("max") is not None and engine["max"] <= bound_baseline,
        "within_budget_bound": engine.get("max") is not None and engine["max"] <= bound_budget,
        "max_cache_bytes": max_cache,
        "cache_fill": max_cache / budgets["cache_tier1"] if budgets.get("cache_tier1") else None,
        "plateau": plateau(samples, soak["t_traffic_s"], soak["t_end_s"]),
        "tokens_computed": computed, "tokens_cached": cached,
        "hit_rate": cached / (computed + cached) if computed + cached else 0.0,
        "computed_tokens_per_s": computed / duration if duration else 0.0,
        "users": args.users, "profile_tokens": list(args.profile_tokens), "concurrency": args.concurrency, "timeout_s": args.timeout,
        "health": soak["health"],
    }


# -- files -------------------------------------------------------------------------------------
def write_csv(path: Path, rows: list[dict]) -> None:
    columns = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot_soak(path: Path, soak: dict, summary: dict) -> bool:
    plt = bu.pyplot()
    if plt is None:
        return False
    samples, t_traffic = soak["samples"], soak["t_traffic_s"]
    t = [s["t_s"] - t_traffic for s in samples]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    for role, r in summary["rss"].items():
        label = f"RSS {role}" + (f" ({r['processes']}, summed)" if r.get("processes", 1) > 1 else "")
        ax.plot(t, [(s.get(f"rss {role}") or float("nan")) / 2**20 for s in samples], label=label)
    ax.plot(t, [(s.get("cache_tier1_bytes") or float("nan")) / 2**20 for s in samples], "--", label="prefix cache in use (tier 1)")
    ax.axhline(summary["bound_baseline_bytes"] / 2**20, color="red", linestyle=":",
               label="engine baseline + cache budget + activation peak")
    ax.axhline(summary["bound_budget_bytes"] / 2**20, color="purple", linestyle="-.",
               label="weights + cache budget + activation peak")
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.axvline(soak["t_end_s"] - t_traffic, color="grey", linewidth=0.5)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("MiB")
    ax.set_title(f"Soak: {summary['requests']:,} requests, {summary['users']} users, concurrency {summary['concurrency']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plateau_line(s: dict) -> str:
    p, fill = s["plateau"], s["cache_fill"]
    if p["rss_growth"] is None:
        return "Plateau: not enough samples.  "
    text = (f"Plateau: the engine stub's max RSS over the last 30% of the run is {p['rss_growth'] / 2**20:+,.0f} MiB "
            f"from its max over the first 70%, while the prefix cache in use grew {p['cache_growth'] / 2**20:+,.0f} MiB: "
            f"**{p['unexplained_growth'] / 2**20:+,.0f} MiB** not explained by the cache. ")
    if fill is not None:
        text += f"The cache filled to {fill:.0%} of its budget"
        text += "." if fill >= 0.95 else " (never full: the bound below is not tested at its limit; more users fill it)."
    return text + "  "


def render_soak(s: dict, plot_link: str | None) -> str:
    b = s["budgets"]
    outcome_rows = [[name, s["outcomes"].get(name, 0)] for name in
                    ("ok", "expected_error", "unexpected_error", "unexpected_ok", "wrong_answer", "lost", "transport")]
    kind_rows = [[k, sum(v.values()), v.get("ok", 0), v.get("expected_error", 0),
                  sum(n for o, n in v.items() if o not in ("ok", "expected_error"))] for k, v in sorted(s["by_kind"].items())]
    lat_rows = [[k, f"{v['p50_s']:.2f}", f"{v['p99_s']:.2f}", f"{v['max_s']:.2f}"] for k, v in s["latency"].items()]
    rss_rows = [[role + (f" ({r['processes']} processes, summed)" if r.get("processes", 1) > 1 else ""), mib(r["baseline"]), mib(r["max_first_30"]), mib(r["max_last_30"]), mib(r["max"]), mib(r["final"]),
                 "-" if not (r["max_last_30"] and r["max_first_70"]) else f"{(r['max_last_30'] - r['max_first_70']) / 2**20:+,.0f}"]
                for role, r in s["rss"].items()]
    engine = s["rss"].get(f"stub {MODEL}", {})
    h = s["health"]
    lines = [
        f"{s['requests']:,} requests in {s['duration_s']:.0f} s ({s['requests_per_s']:.2f} req/s) from {s['users']} users "
        f"(cache namespaces, profiles of {'-'.join(map(str, s.get('profile_tokens', (300, 900))))} tokens), {s['concurrency']} client threads (one request in flight each), "
        f"split between HTTP generate and gRPC streaming; mix: 70% one prompt (profile + a 30-60-token post, "
        f"`cache_prefix_len` = the profile's tokens), 10% multi-item (4 posts), 10% three prompts, 10% bad input "
        f"(5 variants in turn). Engine cache budget: the default ({mib(b.get('cache_tier1'))} MiB tier 1, "
        f"{mib(b.get('cache_tier2'))} MiB tier 2). Prefix hit rate {s['hit_rate']:.0%} "
        f"({s['tokens_cached']:,.0f} of {s['tokens_computed'] + s['tokens_cached']:,.0f} prompt tokens); "
        f"{s['computed_tokens_per_s']:,.0f} computed tokens/s.",
        "",
        bu.markdown_table(["outcome", "requests"], outcome_rows),
        "",
        f"Sent {s['requests']:,}; answered OK {s['answered_ok']:,}; answered with an error {s['answered_error']:,} "
        f"(the bad-input share expects one); **lost {s['lost']}** (no final response within {s['timeout_s']:.0f} s); "
        f"broken connections {s['transport_failures']}.",
        "",
    ]
    if s["unexpected"]:
        lines += ["Unexpected answers:", ""] + [f"- {n} x {md_cell(m)}" for m, n in sorted(s["unexpected"].items(), key=lambda x: -x[1])] + [""]
    lines += [
        bu.markdown_table(["kind / call", "sent", "ok", "expected error", "other"], kind_rows),
        "",
        bu.markdown_table(["kind", "p50 s", "p99 s", "max s"], lat_rows),
        "",
        "RSS (VmRSS, MiB; sampled every second; baseline = median before the first request, right after ready; "
        "growth = max over the last 30% of the run - max over the first 70%):",
        "",
        bu.markdown_table(["process", "baseline", "max first 30%", "max last 30%", "max", "final", "growth"], rss_rows),
        "",
        f"Engine budgets (metrics): weights {mib(b.get('weights'))} MiB, activation budget {mib(b.get('activation'))} MiB, "
        f"cache {mib(b.get('cache_tier1'))} + {mib(b.get('cache_tier2'))} MiB; measured activation peak (max ScoreResult "
        f"`peak_bytes`) {mib(s['activation_peak_bytes'])} MiB; max prefix cache in use {mib(s['max_cache_bytes'])} MiB.  ",
        plateau_line(s),
        f"Bound: engine baseline + cache budget + activation peak = {mib(s['bound_baseline_bytes'])} MiB; the engine stub's "
        f"RSS peaked at {mib(engine.get('max'))} MiB: **{'within' if s['within_bound'] else 'OVER'}** the bound.  ",
        f"Weights + cache budget + activation peak = {mib(s['bound_budget_bytes'])} MiB (no Python/torch runtime): the "
        f"engine stub's peak RSS is {'within' if s['within_budget_bound'] else 'over'} it.  ",
        f"After the soak: tritonserver running {h['tritonserver_running']}, stubs alive {h['stubs_alive']}, Envoy running "
        f"{h['envoy_running']}, restarts = {h['restarts']}; crash lines in the log: "
        + ("; ".join(md_cell(x) for x in h["log_problems"]) if h["log_problems"] else "none") + ".",
    ]
    if plot_link:
        lines += ["", f"![RSS over the soak]({plot_link})"]
    return "\n".join(lines)


# ==============================================================================================
# faults: the engine process killed; a stop with a backlog longer than the exit timeout
# ==============================================================================================
FAULT_PROMPT = {"input_ids": [5] * 3000, "allowed_token_ids": [YES_ID, NO_ID], "cache_prefix_len": 0}


def in_threads(calls) -> list:
    """Start each zero-argument call in its own thread: (threads, results list filled in order as they end)."""
    out = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, c()), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, out


def wait_until(predicate, timeout: float, step: float = 0.1) -> float | None:
    """Seconds until predicate() held, or None after `timeout`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if predicate():
            return time.perf_counter() - t0
        time.sleep(step)
    return None


def tally(answers: list) -> dict:
    counts: dict = {}
    for a in answers:
        code = a.message.split(":")[0] if a is not None else ""
        status = "" if a is None or a.status == "error" else f" {a.status}"  # a stream error has no status
        key = "lost" if a is None else (a.kind if a.kind != "error" else f"error{status}: {code}")
        counts[key] = counts.get(key, 0) + 1
    return counts


def fault_kill_engine(out_dir: Path, dtype: str, timeout: float) -> dict:
    """kill -9 of the engine's process with requests in flight (HTTP generate and gRPC streams)."""
    from prefillonly.serving.host.probe import ready_status

    with Stack(out_dir, "fault-kill", dtype=dtype) as stack:
        url, grpc = stack.http_url, stack.grpc_url
        calls = [lambda: http_generate(url, FAULT_PROMPT, timeout) for _ in range(3)]
        calls += [lambda: grpc_stream_once(grpc, FAULT_PROMPT, timeout) for _ in range(3)]
        threads, answers = in_threads(calls)
        time.sleep(1.5)
        (stub,) = [p for p in stack.sup.server.stub_pids() if stub_model(p) == MODEL]
        os.kill(stub, signal.SIGKILL)
        not_ready_s = wait_until(lambda: ready_status(url) != 200, 30)
        for t in threads:
            t.join(timeout)
        ready_again_s = wait_until(lambda: ready_status(url) == 200, 300, 0.5)
        after = http_generate(url, {"text_input": "Is the sky blue? Answer:", "allowed_tokens": YES_NO}, 60)
        return {"in_flight": len(calls), "answers": tally(answers), "not_ready_after_s": not_ready_s,
                "serving_again_after_s": None if ready_again_s is None else (not_ready_s or 0) + ready_again_s,
                "restarts": stack.sup.restarts, "request_after": f"{after.status} {after.message}"[:80],
                "events": list(stack.events)}


def fault_stop_with_backlog(out_dir: Path, dtype: str, timeout: float, n: int = 16) -> dict:
    """What SIGTERM to the serve command does (Supervisor.stop) with a backlog of n requests of
    ~3,000 tokens each: far longer than the exit timeout."""
    with Stack(out_dir, "fault-stop", dtype=dtype) as stack:
        grpc, exit_timeout = stack.grpc_url, stack.sup.options.exit_timeout_secs
        threads, answers = in_threads([lambda: grpc_stream_once(grpc, FAULT_PROMPT, timeout) for _ in range(n)])
        time.sleep(2.0)
        t0 = time.perf_counter()
        stack.sup.stop()
        stopped_s = time.perf_counter() - t0
        for t in threads:
            t.join(timeout)
        return {"requests": n, "exit_timeout_secs": exit_timeout, "stopped_in_s": stopped_s, "answers": tally(answers),
                "lost": sum(a is None or a.kind == "lost" for a in answers)}


def run_faults(out_dir: Path, dtype: str, timeout: float) -> dict:
    bu.log("[faults] kill -9 of the engine process with 6 requests in flight")
    kill = fault_kill_engine(out_dir, dtype, timeout)
    bu.log(f"[faults] {kill}")
    bu.log("[faults] stop with a backlog of 16 long requests")
    stop = fault_stop_with_backlog(out_dir, dtype, timeout)
    bu.log(f"[faults] {stop}")
    return {"date": bu.now_iso(), "dtype": dtype, "kill": kill, "stop": stop}


def render_faults(f: dict) -> str:
    k, s = f["kill"], f["stop"]
    fmt = lambda counts: ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))  # noqa: E731
    sec = lambda v: "never" if v is None else f"{v:.1f} s"  # noqa: E731
    return "\n".join([
        "| fault | what every request got | recovery |", "|---|---|---|",
        f"| `kill -9` of the engine's process, {k['in_flight']} requests in flight (3 HTTP generate, 3 gRPC streams) | "
        f"{fmt(k['answers'])} | not ready after {sec(k['not_ready_after_s'])}, serving again after "
        f"{sec(k['serving_again_after_s'])} (restarts: {k['restarts']}); next request: {md_cell(k['request_after'])} |",
        f"| stop (SIGTERM to the serve command) with {s['requests']} requests of 3,000 tokens queued, exit timeout "
        f"{s['exit_timeout_secs']} s | {fmt(s['answers'])}; lost: {s['lost']} | stopped in {s['stopped_in_s']:.1f} s |",
    ])


# ==============================================================================================
# the report
# ==============================================================================================
DTYPE_WHY = {"float32": " (not the config's bfloat16: on AVX2-only hosts bf16 matmuls are ~8x slower than fp32, "
                        "which would stretch the soak to many hours)"}


def run_line(phase: dict) -> str:
    """When, how and with what dtype one phase ran (phases may come from different runs)."""
    command = f", command `{phase['command']}`" if phase.get("command") else ""
    return f"Run {phase.get('date', '')}, dtype {phase.get('dtype')}{command}."


def render(out_dir: Path, results_md: Path, meta: dict) -> str:
    matrix, soak = bu.load_json(out_dir / "matrix.json"), bu.load_json(out_dir / "soak.json")
    faults = bu.load_json(out_dir / "faults.json")
    lines = ["Written by `python -m perf.reliability [matrix|faults|soak|all]` (each phase's own command below)  ",
             f"Date: {meta['date']}  ", f"Machine: {bu.machine_line(meta['machine'])}  ",
             f"Stack: Envoy (front door: body limit max_request_bytes = {meta['max_request_bytes']:,} bytes, header stripping) -> tritonserver {TRITON_SERVER_VERSION} (nvidia-pytriton wheel) "
             f"under the serve supervisor (prefillonly.serving.host.supervisor, watchdog on), model_repository/ with the default "
             f"model (SmolLM2-135M), dtype {meta['dtype']}" + DTYPE_WHY.get(meta["dtype"], "") + ", other engine settings as "
             f"in config.pbtxt (default cache budget, default thread count). Raw data: `{meta['out_rel']}/`.", ""]
    if matrix:
        lines += ["### Bad-input matrix", "", run_line(matrix), "",
                  render_matrix(matrix), ""]
    if faults:
        lines += ["### Faults survived", "", run_line(faults), "",
                  render_faults(faults), ""]
    if soak:
        link = os.path.relpath(out_dir / "soak_rss.png", results_md.parent) if (out_dir / "soak_rss.png").is_file() else None
        lines += ["### Soak", "", run_line(soak), "", render_soak(soak["summary"], link), ""]
    return "\n".join(lines)


def print_matrix(data: dict) -> None:
    print(render_matrix(data), flush=True)


def print_soak(summary: dict) -> None:
    keys = ("requests", "duration_s", "requests_per_s", "outcomes", "lost", "transport_failures", "hit_rate",
            "computed_tokens_per_s", "activation_peak_bytes", "engine_max_rss", "bound_baseline_bytes", "within_bound",
            "within_budget_bound", "cache_fill", "plateau")
    print(json.dumps({k: summary[k] for k in keys}, indent=1, default=str), flush=True)
    for role, r in summary["rss"].items():
        print(f"  RSS {role} ({r['processes']} process(es)): "
              + ", ".join(f"{k} {mib(v)} MiB" for k, v in r.items() if k != "processes"), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", nargs="?", default="all", choices=("matrix", "faults", "soak", "all"))
    p.add_argument("--quick", action="store_true", help="200 requests, 20 users; results under --out only")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=None, help="soak requests (default 3000, quick 200)")
    p.add_argument("--users", type=int, default=None, help="soak users = cache namespaces (default 400, quick 20)")
    p.add_argument("--concurrency", type=int, default=8, help="soak client threads")
    p.add_argument("--profile-tokens", type=int, nargs=2, default=(300, 900), metavar=("LO", "HI"),
                   help="length range of the users' profiles in tokens (default 300 900)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without a final response = lost")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default perf/results/reliability (quick: perf/out/reliability_quick)")
    args = p.parse_args(argv)
    args.requests = args.requests or (200 if args.quick else 3000)
    args.users = args.users or (20 if args.quick else 400)
    out_dir = Path(args.out) if args.out else bu.PERF_DIR / ("out/reliability_quick" if args.quick else "results/reliability")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results_md = out_dir / "RESULTS.md" if args.quick else bu.PERF_DIR / "RESULTS.md"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks: stacks stop

    import torch

    from prefillonly.serving.host.envoy_config import DEFAULT_MAX_REQUEST_BYTES

    meta = {"command": bu.command_line(), "date": bu.now_iso(), "dtype": args.dtype, "max_request_bytes": DEFAULT_MAX_REQUEST_BYTES,
            "machine": bu.machine_info(torch.get_num_threads()),
            "out_rel": os.path.relpath(out_dir, bu.REPO_ROOT) if out_dir.is_relative_to(bu.REPO_ROOT) else str(out_dir)}
    problems = 0
    t_start = time.perf_counter()
    if args.phase in ("matrix", "all"):
        bu.log(f"[matrix] {len(matrix_cases())} cases x {len(STYLES)} call styles")
        with Stack(out_dir, "matrix", dtype=args.dtype) as stack:
            matrix = run_matrix(stack)
        matrix.update(date=bu.now_iso(), dtype=args.dtype, command=meta["command"])
        bu.save_json(out_dir / "matrix.json", matrix)
        print_matrix(matrix)
        h = matrix["health"]
        problems += sum(not c["as_expected"] for row in matrix["rows"] for c in row["cells"].values())
        problems += h["restarts"] + (not (h["tritonserver_running"] and h["stubs_alive"] and h["good_request_ok"]))
    if args.phase in ("faults", "all"):
        faults = run_faults(out_dir, args.dtype, args.timeout)
        faults["command"] = meta["command"]
        bu.save_json(out_dir / "faults.json", faults)
        problems += faults["kill"]["restarts"] != 1 or faults["kill"]["answers"].get("lost", 0) or faults["stop"]["lost"]
    if args.phase in ("soak", "all"):
        count = token_counter()
        users = make_users(args.users, args.seed, count, tuple(args.profile_tokens))
        jobs = make_jobs(args.requests, users, args.seed, count)
        bu.log(f"[soak] {len(jobs)} requests, {len(users)} users (profiles {min(u.profile_tokens for u in users)}-"
               f"{max(u.profile_tokens for u in users)} tokens), concurrency {args.concurrency}")
        with Stack(out_dir, "soak", dtype=args.dtype) as stack:
            soak = run_soak(stack, jobs, args.concurrency, args.timeout, args.interval)
        summary = summarise_soak(soak, args)
        write_csv(out_dir / "soak_samples.csv", soak["samples"])
        write_csv(out_dir / "soak_requests.csv", soak["records"])
        plot_soak(out_dir / "soak_rss.png", soak, summary)
        bu.save_json(out_dir / "soak.json", {"date": bu.now_iso(), "dtype": args.dtype, "command": meta["command"], "summary": summary})
        print_soak(summary)
        problems += summary["lost"] + summary["transport_failures"] + summary["health"]["restarts"]
        problems += sum(n for o, n in summary["outcomes"].items() if o not in ("ok", "expected_error"))
    bu.replace_section(results_md, SECTION, render(out_dir, results_md, meta))
    bu.log(f"done in {time.perf_counter() - t_start:.0f} s; wrote {out_dir} and the '{SECTION}' section of {results_md}; "
           f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
