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

With API keys on, the front door wants one from the probe too (its generate route is not a health
path): `probe_key()` finds it where the serve command found its own, and the probe is then a
request of that key's tenant (give it a tenant of its own: it counts in that tenant's quota).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from ...contract.tenants import TenantConfigError, load_tenant_keys
from ...contract.wire import ENGINE_RETRY_LATER_CODES, LIVENESS_USER, UNAUTHENTICATED
from .process import http_status

PROBE_PRIORITY = 1 << 62  # ahead of every client request: only the running one is waited for
PROBE_BODY = {"input_ids": [0], "allowed_token_ids": [0], "cache_prefix_len": 0, "priority": PROBE_PRIORITY,
              "user": LIVENESS_USER}
# answers that come from the engine itself: it is alive (busy, closing, or refusing the probe)
ALIVE_ERROR_CODES = (*ENGINE_RETRY_LATER_CODES, "invalid_request")


def probe_key(environ=os.environ) -> str | None:
    """The API key a probe sends when none is given: $PREFILLONLY_PROBE_KEY, else the first key of
    $PREFILLONLY_API_KEYS, else the first key listed in $PREFILLONLY_API_KEY_FILE (read now, so a
    rotated file is followed); None when there are none (a server without keys)."""
    if environ.get("PREFILLONLY_PROBE_KEY"):
        return environ["PREFILLONLY_PROBE_KEY"]
    keys = environ.get("PREFILLONLY_API_KEYS", "").replace(",", " ").split()
    if keys:
        return keys[0]
    if environ.get("PREFILLONLY_API_KEY_FILE"):
        try:
            listed = load_tenant_keys(key_file=environ["PREFILLONLY_API_KEY_FILE"])
        except TenantConfigError:
            return None  # the probe then says the front door wants a key
        return next(iter(listed.keys))
    return None


def probe(http_url: str, model: str = "prefillonly", timeout: float = 60.0, api_key: str | None = None) -> tuple[bool, str]:
    """(alive, what happened) for one probe request to `http_url` (Triton's or the front door's),
    with `Authorization: Bearer api_key` when a key is given."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{http_url}/v2/models/{model}/generate", data=json.dumps(PROBE_BODY).encode(),
                                 headers=headers)
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
        unauthenticated = error.startswith(UNAUTHENTICATED)
        hint = " (the front door wants an API key: --api-key or $PREFILLONLY_PROBE_KEY)" if unauthenticated else ""
        return alive, f"HTTP {e.code}: {error or e.reason}{hint}"
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, reset, timed out
        return False, f"no answer within {timeout:.0f} s: {getattr(e, 'reason', e)}"


def ready_status(http_url: str, timeout: float = 5.0) -> int:
    """HTTP status of GET /v2/health/ready (0: no answer at all). 200 = every model ready."""
    return http_status(f"{http_url}/v2/health/ready", timeout)
