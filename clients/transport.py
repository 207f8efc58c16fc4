"""How requests reach the prefillonly model: the one transport layer of the client, the
benchmarks and the tests (standard library, numpy and tritonclient only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """POST a JSON body (Triton's /generate or /infer); (HTTP status, decoded JSON reply), errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
