"""A small client for the prefillonly Triton model, on tritonclient (HTTP generate or gRPC streaming).

    from prefillonly_client import PrefillOnlyClient
    with PrefillOnlyClient("localhost:8001", protocol="grpc") as c:
        r = c.score("Is the sky blue? Answer:", [" Yes", " No"])
        r["chosen"]["text"], r["chosen"]["prob"]
        rs = c.score_items("User likes hiking.", ["Alpine trails", "Stock news"], [" Yes", " No"],
                           item_template="\\nPost: {item}\\nClick? Answer:")

CLI (JSON out, one result per line):
    python clients/prefillonly_client.py --url localhost:8000 --prompt "Is the sky blue? Answer:" --allowed " Yes" " No"
    python clients/prefillonly_client.py --url localhost:8001 --protocol grpc --ids 1 2 3 --allowed-ids 9230 2838
    python clients/prefillonly_client.py --prompt "User likes hiking." --items "Alpine trails" "Stock news" \\
        --item-template "\\nPost: {item}\\nClick? Answer:" --allowed " Yes" " No"

Results are the server's `result_json` documents (the engine's ScoreResult as a dict).
Errors raise PrefillOnlyClientError with the server's message.

`user=` (the cache namespace) is also sent as the `x-prefillonly-user` header, on HTTP and as
gRPC stream metadata: behind the fleet's Envoy (deploy/) a user's requests then land on the
replica holding that user's cached prefix. Each gRPC call opens its own stream, so the header
routes every call (Envoy routes a whole stream by its opening headers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import sys
import urllib.error
import urllib.request

import numpy as np

MODEL = "prefillonly"
USER_HEADER = "x-prefillonly-user"  # prefillonly.serving.host.envoy.USER_HEADER (this file stands alone)


class PrefillOnlyClientError(RuntimeError):
    pass


class PrefillOnlyClient:
    def __init__(self, url: str = "localhost:8000", protocol: str = "http", model: str = MODEL, timeout_s: float = 300):
        """protocol: "http" (HTTP generate), "grpc" (gRPC streaming, the decoupled model) or
        "infer" (plain HTTP /infer through the prefillonly_sync forwarder)."""
        if protocol not in ("http", "grpc", "infer"):
            raise ValueError(f"protocol must be 'http', 'grpc' or 'infer', got {protocol!r}")
        self.url = url if "://" in url or protocol != "http" else f"http://{url}"
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self._grpc = None

    def score(self, prompt, allowed, **options) -> dict:
        """One prompt (text or token ids) -> its ScoreResult dict."""
        return self._call(_request(prompt, allowed, **options))[0]

    def score_many(self, prompts: list[str], allowed, **options) -> list[dict]:
        """Several text prompts in one call -> one ScoreResult dict each, in order."""
        return self._call(_request(list(prompts), allowed, **options))

    def score_items(self, prompt, items: list, allowed, item_template: str | None = None, **options) -> list[dict]:
        """One shared prompt and N items -> N ScoreResult dicts (the shared part is computed once)."""
        return self._call(_request(prompt, allowed, items=list(items), item_template=item_template, **options))

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transports -----------------------------------------------------------------------
    def _call(self, fields: dict) -> list[dict]:
        return {"http": self._call_http, "grpc": self._call_grpc, "infer": self._call_infer}[self.protocol](fields)

    def _call_http(self, fields: dict) -> list[dict]:
        body = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
        body = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in body.items()}
        req = urllib.request.Request(f"{self.url}/v2/models/{self.model}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **_routing_headers(fields)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise PrefillOnlyClientError(json.loads(e.read() or b"{}").get("error", f"HTTP {e.code}")) from None
        docs = out["result_json"]
        return [json.loads(d) for d in (docs if isinstance(docs, list) else [docs])]

    def _call_grpc(self, fields: dict) -> list[dict]:
        import tritonclient.grpc as grpcclient

        if self._grpc is None:
            self._grpc = grpcclient.InferenceServerClient(self.url)
        inputs = _infer_inputs(grpcclient, fields)
        answers: queue.Queue = queue.Queue()
        self._grpc.start_stream(callback=lambda result, error: answers.put((result, error)), headers=_routing_headers(fields) or None)
        try:
            self._grpc.async_stream_infer(self.model, inputs)
            result, error = answers.get(timeout=self.timeout_s)
        finally:
            self._grpc.stop_stream()
        if error is not None:
            raise PrefillOnlyClientError(str(error))
        return [json.loads(d) for d in result.as_numpy("result_json")]

    def _call_infer(self, fields: dict) -> list[dict]:
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        client = httpclient.InferenceServerClient(self.url.split("://", 1)[-1], network_timeout=self.timeout_s,
                                                  connection_timeout=self.timeout_s)
        try:
            result = client.infer(f"{self.model}_sync", _infer_inputs(httpclient, fields), headers=_routing_headers(fields) or None)
        except InferenceServerException as e:
            raise PrefillOnlyClientError(e.message()) from None
        finally:
            client.close()
        return [json.loads(d) for d in result.as_numpy("result_json")]


def _request(prompt, allowed, items=None, item_template=None, top_k=None, cache_prefix_len=None, priority=None,
             apply_chat_template=None, user=None) -> dict:
    fields = {}
    if isinstance(prompt, str):
        fields["text_input"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        fields["text_input"] = prompt
    else:
        fields["input_ids"] = np.asarray(prompt, dtype=np.int64)
    strings = [a for a in allowed if isinstance(a, str)]
    ids = [int(a) for a in allowed if not isinstance(a, str)]
    if strings:
        fields["allowed_tokens"] = strings
    if ids:
        fields["allowed_token_ids"] = np.asarray(ids, dtype=np.int64)
    if items is not None:
        fields["items"] = items
    for name, value in (("item_template", item_template), ("user", user)):
        if value is not None:
            fields[name] = value
    for name, value in (("top_k", top_k), ("cache_prefix_len", cache_prefix_len), ("priority", priority)):
        if value is not None:
            fields[name] = np.asarray([value], dtype=np.int64)
    if apply_chat_template is not None:
        fields["apply_chat_template"] = np.asarray([bool(apply_chat_template)])
    return fields


def _infer_inputs(module, fields: dict) -> list:
    """The request's fields as tritonclient InferInputs of `module` (tritonclient.grpc or .http)."""
    inputs = []
    for name, value in fields.items():
        arr = _as_array(value)
        t = module.InferInput(name, list(arr.shape), _triton_type(arr))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _routing_headers(fields: dict) -> dict:
    """The affinity header for a request that names its user (nothing otherwise). A user id that
    is not printable ASCII (not a valid header value) is sent as a stable digest of itself."""
    user = fields.get("user")
    if not isinstance(user, str) or not user:
        return {}
    if not (user.isascii() and user.isprintable()):
        user = "sha256-" + hashlib.sha256(user.encode()).hexdigest()
    return {USER_HEADER: user}


def _as_array(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    values = value if isinstance(value, list) else [value]
    return np.array([v.encode() for v in values], dtype=np.object_)


def _triton_type(arr: np.ndarray) -> str:
    return {np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL"}.get(arr.dtype, "BYTES")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Score prompts on the prefillonly Triton model; JSON lines out")
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--protocol", choices=["http", "grpc", "infer"], default="http")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", help="one or more text prompts")
    src.add_argument("--ids", type=int, nargs="+", help="one prompt as token ids")
    p.add_argument("--allowed", nargs="*", default=[], help='allowed tokens as strings (mind the space: " Yes")')
    p.add_argument("--allowed-ids", type=int, nargs="*", default=[])
    p.add_argument("--items", nargs="+")
    p.add_argument("--item-template")
    p.add_argument("--top-k", type=int)
    p.add_argument("--cache-prefix-len", type=int)
    p.add_argument("--user")
    a = p.parse_args(argv)
    prompt = a.ids if a.ids else (a.prompt[0] if len(a.prompt) == 1 else a.prompt)
    options = dict(top_k=a.top_k, cache_prefix_len=a.cache_prefix_len, user=a.user)
    try:
        with PrefillOnlyClient(a.url, a.protocol) as client:
            allowed = a.allowed + a.allowed_ids
            if a.items:
                results = client.score_items(prompt, a.items, allowed, item_template=a.item_template, **options)
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                results = client.score_many(prompt, allowed, **options)
            else:
                results = [client.score(prompt, allowed, **options)]
    except PrefillOnlyClientError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    for r in results:
        print(json.dumps(r, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
