"""The bad-input matrix: each case sent once in each call style; a cell is flagged when the answer
is not what the case expects."""

from __future__ import annotations

from dataclasses import dataclass

from clients.transport import STYLES, Answer, GrpcStream, answer, stream_answer
from perf import benchutil as bu
from perf.reliability.stack import YES_NO, Stack
from perf.workloads import NO_ID, YES_ID

MESSAGE_CHARS = 90
MATRIX_TIMEOUT_S = 120.0
# statuses that mean "the server failed", not "your input is bad"
SERVER_FAULT_STATUSES = {"500", "502", "503", "504", "INTERNAL", "UNAVAILABLE", "UNKNOWN"}


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
    with GrpcStream(stack.grpc_url, headers={"triton_grpc_error": "true"}) as stream:
        bad = stream_answer(stream, case.fields, MATRIX_TIMEOUT_S)
        if stream.broken:
            bad.message = f"[the stream ended] {bad.message}"
            return bad
        good = stream_answer(stream, {"text_input": QUESTION, "allowed_tokens": YES_NO}, MATRIX_TIMEOUT_S)
    bad.message = f"[then a good request on the stream: {good.kind}] {bad.message}"
    if good.kind != "ok":
        bad.kind = "transport"  # the stream did not survive: flagged
    return bad


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
                got = grpc_error_header_cell(stack, case)
            else:
                got = answer(style, stack.http_url, stack.grpc_url, case.fields, MATRIX_TIMEOUT_S)
            good = verdict(case, got)
            cells[style] = {"kind": got.kind, "status": got.status, "message": got.message[:MESSAGE_CHARS],
                            "seconds": round(got.seconds, 3), "as_expected": good}
            bu.log(f"  {'  ' if good else '!!'} {case.name} / {style}: {got.status} {got.message[:MESSAGE_CHARS]!r} "
                   f"({got.seconds:.2f} s)")
        rows.append({"case": case.name, "expect": case.expect, "note": case.note, "cells": cells})
    health = stack.health()
    bu.log(f"after the matrix: tritonserver running {health['tritonserver_running']}, stubs alive {health['stubs_alive']}, "
           f"envoy running {health['envoy_running']}, restarts {health['restarts']}, good request: {health['good_request']}")
    if health["log_problems"]:
        bu.log(f"  tritonserver log: {health['log_problems']}")
    return {"rows": rows, "health": health}
