"""A small client for the prefillonly Triton model, on tritonclient (HTTP generate or gRPC streaming).

    from prefillonly_client import PrefillOnlyClient
    with PrefillOnlyClient("localhost:8001", protocol="grpc") as c:
        r = c.score("Is the sky blue? Answer:", [" Yes", " No"])
        r["chosen"]["text"], r["chosen"]["prob"]
        rs = c.score_items("User likes hiking.", ["Alpine trails", "Stock news"], [" Yes", " No"],
                           item_template="\\nPost: {item}\\nClick? Answer:")
        c.embed(["first text", "second text"], dimensions=64)[0].embedding     # an embedding checkpoint (or a causal LM)
        c.classify("Question: ...", responses=[" answer 1", " answer 2"])[0].probs  # a classifier / reward model

CLI (JSON out, one result per line):
    python clients/prefillonly_client.py --url localhost:8000 --prompt "Is the sky blue? Answer:" --allowed " Yes" " No"
    python clients/prefillonly_client.py --url localhost:8001 --protocol grpc --ids 1 2 3 --allowed-ids 9230 2838
    python clients/prefillonly_client.py --prompt "User likes hiking." --items "Alpine trails" "Stock news" \\
        --item-template "\\nPost: {item}\\nClick? Answer:" --allowed " Yes" " No"

Results of score, score_many and score_items are the server's `result_json` documents (the
engine's ScoreResult as a dict); embed and classify decode them as the engine's EmbeddingResult and
ClassificationResult (prefillonly.contract.wire).
Errors raise PrefillOnlyClientError with the server's message.

`user=` (the cache namespace) is also sent as the `x-prefillonly-user` header, on HTTP and as
gRPC stream metadata: behind the fleet's Envoy (deploy/) a user's requests then land on the
replica holding that user's cached prefix. Each gRPC call opens its own stream, so the header
routes every call (Envoy routes a whole stream by its opening headers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:  # imported as clients.prefillonly_client (the repository's tests and benchmarks)
    from .transport import (CLASSIFY, EMBED, MODEL, RESULT_JSON, GrpcStream, decode_answers, http_generate, request_fields,
                            result_documents, routing_headers, unary_infer)
except ImportError:  # run as a script, or imported with clients/ on sys.path
    from transport import (CLASSIFY, EMBED, MODEL, RESULT_JSON, GrpcStream, decode_answers, http_generate, request_fields,
                           result_documents, routing_headers, unary_infer)


class PrefillOnlyClientError(RuntimeError):
    pass


class PrefillOnlyClient:
    def __init__(self, url: str = "localhost:8000", protocol: str = "http", model: str = MODEL, timeout_s: float = 300,
                 api_key: str | None = None):
        """protocol: "http" (HTTP generate), "grpc" (gRPC streaming, the decoupled model) or
        "infer" (plain HTTP /infer through the prefillonly_sync forwarder). api_key: sent as
        `Authorization: Bearer <key>` (gRPC: that metadata), for a server started with API keys
        (default $PREFILLONLY_API_KEY; none: nothing sent)."""
        if protocol not in ("http", "grpc", "infer"):
            raise ValueError(f"protocol must be 'http', 'grpc' or 'infer', got {protocol!r}")
        self.url = url if "://" in url or protocol != "http" else f"http://{url}"
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        api_key = api_key if api_key is not None else os.environ.get("PREFILLONLY_API_KEY")
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._grpc = None

    def _headers(self, fields: dict) -> dict | None:
        return {**routing_headers(fields), **self._auth} or None

    def score(self, prompt, allowed, **options) -> dict:
        """One prompt (text or token ids) -> its ScoreResult dict."""
        return self._call(request_fields(prompt, allowed, **options))[0]

    def score_many(self, prompts: list[str], allowed, **options) -> list[dict]:
        """Several text prompts in one call -> one ScoreResult dict each, in order."""
        return self._call(request_fields(list(prompts), allowed, **options))

    def score_items(self, prompt, items: list, allowed, item_template: str | None = None, **options) -> list[dict]:
        """One shared prompt and N items (texts, or token-id lists) -> N ScoreResult dicts (the shared
        part is computed once)."""
        return self._call(request_fields(prompt, allowed, items=list(items), item_template=item_template, **options))

    def embed(self, texts, dimensions=None, normalize=None, prompt_name=None, truncate=None, user=None):
        """A text (or token ids) -> its EmbeddingResult; a list of texts or id lists -> one each, in
        order (as Engine.embed). An option left None is the checkpoint's (its normalisation, its
        default named prompt) or none: a prompt over the input length is refused unless `truncate`
        ("right": cut the end, "left": the start). dimensions: the first n values, then normalised."""
        return self._pooled(texts, dict(task=EMBED, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name,
                                        truncate=truncate, user=user))

    def classify(self, prompt, responses=None, truncate=None, user=None):
        """A sequence classifier's (or reward model's) label scores, as Engine.classify: a text (or
        token ids) -> its ClassificationResult; a list of them -> one each; with `responses` (texts,
        appended without special tokens, or id lists) -> one per response, each after prompt +
        response, the prompt computed once (best-of-N). truncate: as embed (a prompt alone only)."""
        if responses is not None:
            return self._answers(request_fields(prompt, [], items=list(responses), task=CLASSIFY, truncate=truncate,
                                                user=user))
        return self._pooled(prompt, dict(task=CLASSIFY, truncate=truncate, user=user))

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pooled(self, prompts, options: dict):
        """One prompt (a text, token ids) -> its result; texts -> one request, a result each; id
        lists -> one request each (a request carries one id prompt)."""
        if not (isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], int)):
            return self._answers(request_fields(prompts, [], **options))[0]
        if all(isinstance(p, str) for p in prompts):
            return self._answers(request_fields(list(prompts), [], **options))
        return [self._answers(request_fields(p, [], **options))[0] for p in prompts]

    # -- transports -----------------------------------------------------------------------
    def _call(self, fields: dict) -> list[dict]:
        """The answer's result_json documents (dicts)."""
        return result_documents(self._result_json(fields))

    def _answers(self, fields: dict) -> list:
        """The answer's results as their types (prefillonly.contract.wire: EmbeddingResult, ...)."""
        return decode_answers(self._result_json(fields))

    def _result_json(self, fields: dict):
        return {"http": self._call_http, "grpc": self._call_grpc, "infer": self._call_infer}[self.protocol](fields)

    def _call_http(self, fields: dict):
        status, reply = http_generate(self.url, fields, self.timeout_s, self.model, self._auth)
        if status != 200 or RESULT_JSON not in reply:
            raise PrefillOnlyClientError(reply.get("error", f"HTTP {status}"))
        return reply[RESULT_JSON]

    def _call_grpc(self, fields: dict):
        import tritonclient.grpc as grpcclient

        if self._grpc is None:
            self._grpc = grpcclient.InferenceServerClient(self.url)
        stream = GrpcStream(self._grpc, self._headers(fields), self.model)
        try:
            result, error = stream.call(fields, self.timeout_s)
        finally:
            stream.close()
        if error is not None:
            raise PrefillOnlyClientError(str(error))
        return result.as_numpy(RESULT_JSON)

    def _call_infer(self, fields: dict):
        from tritonclient.utils import InferenceServerException

        try:
            result = unary_infer(self.url, fields, self.timeout_s, "http", f"{self.model}_sync", self._auth)
        except InferenceServerException as e:
            raise PrefillOnlyClientError(e.message()) from None
        return result.as_numpy(RESULT_JSON)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Score prompts on the prefillonly Triton model; JSON lines out")
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--protocol", choices=["http", "grpc", "infer"], default="http")
    p.add_argument("--api-key", default=None, help="the server's API key (default $PREFILLONLY_API_KEY)")
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
        with PrefillOnlyClient(a.url, a.protocol, api_key=a.api_key) as client:
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
