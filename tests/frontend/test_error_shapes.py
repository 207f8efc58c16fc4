"""Each API's error shape and status for each kind of refusal (frontend/errors.py), without a
server: what the routes answer when the engine is overloaded, unreachable or fails, which the
serving tests cannot cause on demand. TEI's statuses are its router's: 422 Validation, 400 Empty,
429 Overloaded, 424 Backend, 503 Unhealthy."""

from __future__ import annotations

import json

import pytest

from prefillonly.frontend.error_shapes import APIError, error_response

CASES = [  # (error, tei status, tei error_type, openai status)
    (APIError("documents[1] is bad"), 422, "Validation", 400),
    (APIError("texts is empty", code="empty"), 400, "Empty", 400),
    (APIError("overloaded: 9 waiting", status=503, code="overloaded"), 429, "Overloaded", 503),
    (APIError("no engine answered", status=503, code="unavailable"), 503, "Unhealthy", 503),
    (APIError("boom", status=500, code="internal"), 424, "Backend", 500),
    (APIError("model 'x' is not served here", status=404), 404, "Validation", 404),
]


@pytest.mark.parametrize("error,tei_status,tei_type,status", CASES, ids=[c[0].code + str(c[0].status) for c in CASES])
def test_each_style_answers_with_its_shape_and_status(error, tei_status, tei_type, status):
    tei = error_response("tei", error)
    assert tei.status_code == tei_status and json.loads(tei.body) == {"error": error.message, "error_type": tei_type}
    openai = error_response("openai", error)
    body = json.loads(openai.body)["error"]
    assert openai.status_code == status and body["message"] == error.message and body["code"] == status
    sglang = json.loads(error_response("sglang", error).body)
    assert sglang == {"object": "error", **body}
    cohere = error_response("cohere", error)
    assert cohere.status_code == status and json.loads(cohere.body) == {"message": error.message}
    assert error.message.split(":")[0] == error.code  # every message starts with the engine's code
