"""Liveness: one real 1-token inference through the whole engine path, with a timeout.

Triton's /v2/health/ready only says the model loaded; it stays 200 when the engine's process has
died or its worker is wedged. A probe that gets an answer from the engine (a result, or an
engine error such as `overloaded`: the engine is alive, just busy) proves it runs. Used by the
serve supervisor and, as `python -m prefillonly.serving probe`, by container liveness checks.
The probe runs at the highest priority, so it waits only for the request already running; it is
counted in the request metrics like any other request. While one long step runs (a decision call
of hundreds of questions is one step) and its forwards keep finishing, the engine answers the probe
at once with engine_busy, its progress being the proof; a step with no forward finished for
PROGRESS_WINDOW_S (engine.py) gets the probe queued, and a wedged worker never answers it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ...contract.wire import ENGINE_RETRY_LATER_CODES, LIVENESS_USER
from .process import http_status

PROBE_PRIORITY = 1 << 62  # ahead of every client request: only the running one is waited for
PROBE_BODY = {"input_ids": [0], "allowed_token_ids": [0], "cache_prefix_len": 0, "priority": PROBE_PRIORITY,
              "user": LIVENESS_USER}
# answers that come from the engine itself: it is alive (busy, closing, or refusing the probe)
ALIVE_ERROR_CODES = (*ENGINE_RETRY_LATER_CODES, "invalid_request")


def probe(http_url: str, model: str = "prefillonly", timeout: float = 60.0) -> tuple[bool, str]:
    """(alive, what happened) for one probe request to `http_url` (Triton's or the front door's)."""
    req = urllib.request.Request(f"{http_url}/v2/models/{model}/generate", data=json.dumps(PROBE_BODY).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.loads(r.read() or b"{}")
            # result_json: every task's answer (on an embedding model or a classifier the model
            # runs the probe as the pooled task the checkpoint answers: protocol.make_answerable)
            return ("result_json" in reply), f"HTTP {r.status}: answered"
    except urllib.error.HTTPError as e:
        try:
            error = str(json.loads(e.read() or b"{}").get("error", ""))
        except ValueError:
            error = ""
        alive = error.startswith(ALIVE_ERROR_CODES)
        return alive, f"HTTP {e.code}: {error or e.reason}"
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, reset, timed out
        return False, f"no answer within {timeout:.0f} s: {getattr(e, 'reason', e)}"


def ready_status(http_url: str, timeout: float = 5.0) -> int:
    """HTTP status of GET /v2/health/ready (0: no answer at all). 200 = every model ready."""
    return http_status(f"{http_url}/v2/health/ready", timeout)
