"""The wire contract of the prefillonly Triton model: what crosses between it and its callers.

One leaf module, standard library only (numpy is imported by the two functions that build
tensors), read by every side: the Triton models (model_repository/, serving/model/protocol.py),
the front door (serving/host/envoy_config.py), the scoring frontend (frontend/) and the clients
(clients/transport.py, which loads this file by path where prefillonly is not installed).

- the models' names, and their inputs and outputs (name, Triton datatype, dims) as data: each
  config.pbtxt declares exactly these (tests/serving/test_wire.py checks);
- a request as a dict of fields named as the inputs (`request_fields`), and as tritonclient
  tensors (`infer_inputs`);
- the error codes every error message starts with ("overloaded: ..."), which of them mean "not
  now, retry" and the Triton / HTTP / gRPC status each is answered with;
- the affinity headers and the one rule that turns a user id into the header's value;
- a result: `result_json` (ScoreResult.to_json, one per prompt or item) decoded back into the
  same frozen ScoreResult the engine returned (`decode_results`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

MODEL, SYNC_MODEL = "prefillonly", "prefillonly_sync"  # the decoupled model, and its plain (non-decoupled) forwarder


# -- tensors ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # Triton's: BYTES (TYPE_STRING in a config.pbtxt), INT64, FP32, BOOL
    dims: tuple[int, ...] = (-1,)  # -1: any length

    @property
    def config_type(self) -> str:
        """The data_type a config.pbtxt writes for it."""
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"


# Inputs, all optional except a prompt (text_input or input_ids) and the allowed tokens
# (serving/model/protocol.py says what each means). HTTP generate maps a JSON field to the input
# of its name: a string becomes a one-element BYTES tensor, a list a longer one.
INPUT_TENSORS = (
    Tensor("text_input", "BYTES"), Tensor("input_ids", "INT64"), Tensor("allowed_tokens", "BYTES"),
    Tensor("allowed_token_ids", "INT64"), Tensor("items", "BYTES"), Tensor("item_ids", "INT64"),
    Tensor("item_lengths", "INT64"), Tensor("item_template", "BYTES", (1,)), Tensor("cache_prefix_len", "INT64", (1,)),
    Tensor("top_k", "INT64", (1,)), Tensor("priority", "INT64", (1,)), Tensor("apply_chat_template", "BOOL", (1,)),
    Tensor("user", "BYTES", (1,)), Tensor("task", "BYTES", (1,)), Tensor("logprobs_start", "INT64", (1,)),
    # pooled tasks (embed, classify): Matryoshka truncation, L2 normalisation (default: the checkpoint's),
    # a named prompt of the checkpoint prepended, and cutting a prompt over the max input length
    # ("right" keeps its start, "left" its end; none: refused as too long)
    Tensor("dimensions", "INT64", (1,)), Tensor("normalize", "BOOL", (1,)), Tensor("prompt_name", "BYTES", (1,)),
    Tensor("truncate", "BYTES", (1,)),
)
# What a request asks (the `task` input) of the built-in kinds: score the allowed tokens after each
# prompt (the default); the log-likelihood of each continuation (the items) after one context (the
# prompt); or the prompt's own tokens' log-probabilities from `logprobs_start` on (with the `top_k`
# there). The engine's registry of kinds (prefillonly.tasks) answers these and any registered since.
SCORE, LOGLIKELIHOOD, PROMPT_LOGPROBS = "score", "loglikelihood", "prompt_logprobs"
# typed decisions: text_input is one decision call's JSON (contract/decisions.py DecisionCall),
# result_json its DecisionResult
DECIDE = "decide"
# pooled outputs: each prompt's embedding (the final hidden states pooled as the checkpoint says), or a
# sequence classifier's / reward model's label scores after each prompt (with items: after the shared
# prompt + each item, the prompt computed once: best-of-N responses to one prompt)
EMBED, CLASSIFY = "embed", "classify"
# Outputs, one element per result (prompts, or items of a multi-item call) in order; the allowed
# tokens' probabilities row-major (result i's k allowed tokens in the order asked). A loglikelihood
# or prompt_logprobs answer has result_json (a ContinuationScore or PromptLogprobs each),
# prompt_tokens and cached_tokens only.
RESULT_JSON = "result_json"  # the whole ScoreResult as JSON: what the frontend and the clients read
OUTPUT_TENSORS = (
    Tensor(RESULT_JSON, "BYTES"), Tensor("chosen_token", "BYTES"), Tensor("chosen_token_id", "INT64"),
    Tensor("chosen_prob", "FP32"), Tensor("allowed_probs", "FP32"), Tensor("allowed_logprobs", "FP32"),
    Tensor("prompt_tokens", "INT64"), Tensor("cached_tokens", "INT64"),
    # embed: [results, dimensions]; classify: [results, labels] raw scores (logits) and their
    # probabilities (softmax, sigmoid, or the raw score for a regression / reward head)
    Tensor("embedding", "FP32", (-1, -1)), Tensor("class_logits", "FP32", (-1, -1)), Tensor("class_probs", "FP32", (-1, -1)),
)
INPUTS = {t.name: t.datatype for t in INPUT_TENSORS}
OUTPUTS = {t.name: t.datatype for t in OUTPUT_TENSORS}
TRITON_TYPES = {"object": "BYTES", "int64": "INT64", "bool": "BOOL", "float32": "FP32"}  # numpy dtype -> Triton's


# -- requests -----------------------------------------------------------------------------------
def request_fields(prompt, allowed, *, items=None, item_template=None, top_k=None, cache_prefix_len=None,
                   priority=None, apply_chat_template=None, user=None, task=None, logprobs_start=None,
                   dimensions=None, normalize=None, prompt_name=None, truncate=None) -> dict:
    """One request's fields, named as the inputs: `prompt` a text, several texts or token ids;
    `allowed` strings and/or ids (none for the loglikelihood and prompt_logprobs tasks); `items`
    texts, or token-id lists (sent as item_ids + item_lengths). An option left None is not sent."""
    import numpy as np

    fields = {}
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        fields["text_input"] = prompt
    else:
        fields["input_ids"] = np.asarray(prompt, dtype=np.int64)
    strings = [a for a in allowed if isinstance(a, str)]
    ids = [int(a) for a in allowed if not isinstance(a, str)]
    if strings:
        fields["allowed_tokens"] = strings
    if ids:
        fields["allowed_token_ids"] = np.asarray(ids, dtype=np.int64)
    if items is not None and items and all(not isinstance(x, str) for x in items):
        fields["item_ids"] = np.asarray([t for item in items for t in item], dtype=np.int64)
        fields["item_lengths"] = np.asarray([len(item) for item in items], dtype=np.int64)
    elif items is not None:
        fields["items"] = list(items)
    for name, value in (("item_template", item_template), ("user", user), ("task", task), ("prompt_name", prompt_name),
                        ("truncate", truncate)):
        if value is not None:
            fields[name] = value
    for name, value in (("top_k", top_k), ("cache_prefix_len", cache_prefix_len), ("priority", priority),
                        ("logprobs_start", logprobs_start), ("dimensions", dimensions)):
        if value is not None:
            fields[name] = np.asarray([value], dtype=np.int64)
    for name, value in (("apply_chat_template", apply_chat_template), ("normalize", normalize)):
        if value is not None:
            fields[name] = np.asarray([bool(value)])
    return fields


def as_array(value):
    """A field's value as the tensor sent: an array as it is; str or bytes -> BYTES, bool -> BOOL,
    int -> INT64, float -> FP32 (a scalar as a one-element tensor)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    values = value if isinstance(value, list) else [value]
    if all(isinstance(v, (str, bytes)) for v in values):  # also the empty list: BYTES [0]
        return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    if all(isinstance(v, bool) for v in values):
        return np.array(values, dtype=bool)
    if all(isinstance(v, int) for v in values):
        return np.array(values, dtype=np.int64)
    return np.array(values, dtype=np.float32)


def infer_inputs(module, fields: dict) -> list:
    """The fields as InferInputs of `module` (tritonclient.grpc, .grpc.aio or .http)."""
    inputs = []
    for name, value in fields.items():
        array = as_array(value)
        tensor = module.InferInput(name, list(array.shape), TRITON_TYPES[str(array.dtype)])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


# -- errors -------------------------------------------------------------------------------------
# Every error message starts with "<code>: " (the engine's PrefillOnlyError.code, or one of these),
# on every route: the code is what callers can rely on where Triton does not carry the status.
ENGINE_RETRY_LATER_CODES = ("overloaded", "engine_closed", "deadline_exceeded", "engine_busy",
                            "rate_limited")  # the engine's "not now" (rate_limited: the tenant's quota)
# The `user` of a liveness probe (serving/host/probe.py): the Triton model answers it with
# engine_busy instead of queueing it while a long step keeps making progress (Engine.progressing_step).
LIVENESS_USER = "__prefillonly_liveness__"
UNAVAILABLE = "unavailable"  # no engine answered: Triton restarting or unreachable, the front door's local reply
UNAUTHENTICATED = "unauthenticated"  # the front door's local reply to a missing or wrong API key (HTTP 401)
RATE_LIMITED = "rate_limited"  # over the tenant's quota: HTTP 429 with Retry-After on the frontend's routes
CANCELLED, INTERNAL = "cancelled", "internal"  # the Triton model's own: the client went away, a bug
RETRY_LATER_CODES = (*ENGINE_RETRY_LATER_CODES, UNAVAILABLE)  # may succeed later or elsewhere: back off, retry
# Triton's status of an error answer -> (HTTP status, gRPC status) it reaches a caller with: Triton's
# own mapping for the first three; CANCELLED (the caller has gone) is 400 on the frontend's routes
STATUSES = {"UNAVAILABLE": (503, "UNAVAILABLE"), "INVALID_ARG": (400, "INVALID_ARGUMENT"),
            "INTERNAL": (500, "INTERNAL"), "CANCELLED": (400, "CANCELLED")}


def code_of(message: str) -> str | None:
    """The code an error message starts with ("overloaded: 3 waiting" -> "overloaded"); None without one."""
    head, colon, _ = message.partition(":")
    head = head.strip()
    return head if colon and head.isidentifier() and head.islower() else None


def retry_later(code: str | None) -> bool:
    return code in RETRY_LATER_CODES


def triton_status(code: str | None) -> str:
    """The Triton status (a key of STATUSES) an error of `code` is answered with: retry-later codes
    UNAVAILABLE, "cancelled" CANCELLED, "internal" INTERNAL, every other code (bad input) INVALID_ARG."""
    if retry_later(code):
        return "UNAVAILABLE"
    return {CANCELLED: "CANCELLED", INTERNAL: "INTERNAL"}.get(code, "INVALID_ARG")


def http_status(code: str | None) -> int:
    return STATUSES[triton_status(code)][0]


# -- affinity -----------------------------------------------------------------------------------
USER_HEADER = "x-prefillonly-user"  # a request's user: the front door routes by it (gRPC metadata is a header too)
REPLICA_HEADER = "x-prefillonly-replica"  # on every answer through the front door: host:port of the replica


def user_header_value(user: str) -> str:
    """The header value for a user id: the id itself, or, where it is not printable ASCII (not a
    valid header value), a stable digest of it, so that the same user always lands on one replica."""
    return user if user.isascii() and user.isprintable() else "sha256-" + hashlib.sha256(user.encode()).hexdigest()


def routing_headers(user) -> dict:
    """The affinity header of a request of `user` (nothing for no user or an empty one)."""
    return {USER_HEADER: user_header_value(user)} if isinstance(user, str) and user else {}


# -- results ------------------------------------------------------------------------------------
class _JsonResult:
    """A result's plain-JSON forms: to_dict, and to_json (its `result_json` form)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


@dataclass(frozen=True)
class TokenScore:
    id: int
    text: str
    logprob: float  # log-probability over the full vocabulary
    prob: float  # allowed tokens: renormalised over the allowed set; top_k entries: exp(logprob)

    @classmethod
    def from_dict(cls, d: dict) -> "TokenScore":
        return cls(id=d["id"], text=d["text"], logprob=d["logprob"], prob=d["prob"])


@dataclass(frozen=True)
class ScoreResult(_JsonResult):
    """What a scoring request returns (names fixed by docs/design.md §5); the package exports it."""
    tokens: list[TokenScore]  # one per allowed token, in the order asked
    chosen: TokenScore  # the allowed token with the highest probability
    top_k: list[TokenScore] = field(default_factory=list)  # full-vocabulary top tokens, if asked
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from a cache instead of being computed
    peak_bytes: int | None = None  # measured peak memory growth of the request (None if unmeasurable)

    @classmethod
    def from_dict(cls, d: dict) -> "ScoreResult":
        return cls(tokens=[TokenScore.from_dict(t) for t in d["tokens"]], chosen=TokenScore.from_dict(d["chosen"]),
                   top_k=[TokenScore.from_dict(t) for t in d.get("top_k", ())], prompt_tokens=d.get("prompt_tokens", 0),
                   cached_tokens=d.get("cached_tokens", 0), peak_bytes=d.get("peak_bytes"))


@dataclass(frozen=True)
class ContinuationScore(_JsonResult):
    """One continuation's log-likelihood after a context (Engine.loglikelihood; lm-evaluation-
    harness's loglikelihood): the sum of its tokens' log-probabilities, each given the context and
    the continuation's tokens before it, and whether every one of them was the most likely token."""
    logprob: float
    is_greedy: bool
    tokens: int  # the continuation's tokens
    token_logprobs: list[float] = field(default_factory=list)  # one per continuation token
    context_tokens: int = 0
    cached_tokens: int = 0  # context tokens whose K/V came from the prefix cache

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.tokens

    @classmethod
    def from_dict(cls, d: dict) -> "ContinuationScore":
        return cls(logprob=d["logprob"], is_greedy=d["is_greedy"], tokens=d["tokens"],
                   token_logprobs=list(d.get("token_logprobs", ())), context_tokens=d.get("context_tokens", 0),
                   cached_tokens=d.get("cached_tokens", 0))


@dataclass(frozen=True)
class PromptLogprobs(_JsonResult):
    """Per position of a prompt from `start` on (start >= 1): the log-probability of the prompt's own
    token there given every token before it, whether it was the most likely one, and the k most
    likely tokens at that position (Engine.prompt_logprobs; an OpenAI `echo` with `logprobs`)."""
    token_ids: list[int]  # the whole prompt
    start: int
    token_logprobs: list[float]  # for positions start .. len(token_ids) - 1
    greedy: list[bool]
    top_k: list[list[TokenScore]] = field(default_factory=list)  # per position, when asked
    cached_tokens: int = 0
    next_top_k: list[TokenScore] = field(default_factory=list)  # after the prompt: the argmax first (max(1, top_k) of them)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_dict(cls, d: dict) -> "PromptLogprobs":
        return cls(token_ids=list(d["token_ids"]), start=d["start"], token_logprobs=list(d["token_logprobs"]),
                   greedy=list(d["greedy"]), top_k=[[TokenScore.from_dict(t) for t in row] for row in d.get("top_k", ())],
                   cached_tokens=d.get("cached_tokens", 0), next_top_k=[TokenScore.from_dict(t) for t in d.get("next_top_k", ())])


@dataclass(frozen=True)
class EmbeddingResult(_JsonResult):
    """One prompt's embedding (Engine.embed): its final hidden states (after the final norm) pooled
    as the checkpoint says (last token, mean or first), truncated to `dimensions` and then
    L2-normalised where asked; float32 values."""
    embedding: list[float]
    pooling: str = "last"  # last | mean | cls
    normalized: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose hidden states came from the prefix cache
    truncated_tokens: int = 0  # tokens cut from the prompt by `truncate`

    @classmethod
    def from_dict(cls, d: dict) -> "EmbeddingResult":
        return cls(embedding=list(d["embedding"]), pooling=d.get("pooling", "last"), normalized=d.get("normalized", False),
                   prompt_tokens=d.get("prompt_tokens", 0), cached_tokens=d.get("cached_tokens", 0),
                   truncated_tokens=d.get("truncated_tokens", 0))


@dataclass(frozen=True)
class ClassificationResult(_JsonResult):
    """A sequence classifier's or reward model's answer after one prompt (Engine.classify): its score
    head's raw outputs (`logits`, one per label, in label order), their `probs` by the checkpoint's
    problem type (softmax: single-label; sigmoid: multi-label; the raw score: regression or a
    one-label reward head, `activation` "none"), the label names (id2label) and the top label."""
    logits: list[float]
    probs: list[float]
    labels: list[str]
    label: str  # the label with the highest score
    activation: str = "softmax"  # softmax | sigmoid | none
    prompt_tokens: int = 0
    cached_tokens: int = 0
    truncated_tokens: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "ClassificationResult":
        return cls(logits=list(d["logits"]), probs=list(d["probs"]), labels=list(d["labels"]), label=d["label"],
                   activation=d.get("activation", "softmax"), prompt_tokens=d.get("prompt_tokens", 0),
                   cached_tokens=d.get("cached_tokens", 0), truncated_tokens=d.get("truncated_tokens", 0))


def decode_answer(document: dict):
    """One result_json document as its type: a ContinuationScore (it has `is_greedy`), a
    PromptLogprobs (`token_logprobs` without `is_greedy`), an EmbeddingResult (`embedding`), a
    ClassificationResult (`logits`) or a ScoreResult."""
    if "embedding" in document:
        return EmbeddingResult.from_dict(document)
    if "logits" in document:
        return ClassificationResult.from_dict(document)
    if "is_greedy" in document:
        return ContinuationScore.from_dict(document)
    if "token_logprobs" in document:
        return PromptLogprobs.from_dict(document)
    return ScoreResult.from_dict(document)


def result_documents(values) -> list[dict]:
    """The JSON documents of an answer's result_json: a tensor or list of them, or a single one
    (HTTP generate sends one result as a scalar)."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)):
        values = [values]
    return [json.loads(v) for v in values]


def decode_results(values) -> list[ScoreResult]:
    """An answer's result_json as ScoreResults."""
    return [ScoreResult.from_dict(d) for d in result_documents(values)]


def decode_answers(values) -> list:
    """An answer's result_json of any task: ScoreResults, ContinuationScores or PromptLogprobs."""
    return [decode_answer(d) for d in result_documents(values)]
