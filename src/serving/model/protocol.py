"""The Triton model's wire format: input tensors -> engine calls, ScoreResults -> output tensors.

Pure numpy, no Triton imports, so it is tested without a server; model.py only moves tensors
between pb_utils and these functions. Input names match what Triton's HTTP generate endpoint
maps JSON fields to (a JSON string becomes a one-element BYTES tensor, a list a longer one).

Inputs (all optional except a prompt and the allowed tokens):
  text_input            BYTES [n]   one or more independent prompts (one result each)
  input_ids             INT64 [s]   a prompt as token ids (instead of text_input)
  allowed_tokens        BYTES [k]   allowed outputs as strings (" Yes": mind the space)
  allowed_token_ids     INT64 [k]   allowed outputs as ids (with or instead of the strings)
  items                 BYTES [m]   multi-item: score prompt + item_i for each item
  item_ids, item_lengths  INT64 [t], INT64 [m]   multi-item with items as token ids: the items'
                        ids back to back, and each item's length (instead of items)
  item_template         BYTES [1]   e.g. "\\nPost: {item}\\nAnswer:"
  cache_prefix_len, top_k, priority   INT64 [1]
  apply_chat_template   BOOL [1]
  user                  BYTES [1]   cache namespace (tenant / user isolation)
  task                  BYTES [1]   "score" (the default), "loglikelihood" (the prompt is the context,
                        the items its continuations; no allowed tokens), "prompt_logprobs" (each
                        prompt's own tokens' logprobs from logprobs_start on, top_k <= 20 at each),
                        "decide", "embed" (each prompt's embedding) or "classify" (a classifier's
                        label scores after each prompt; with items: after the one prompt + each item)
  logprobs_start        INT64 [1]   prompt_logprobs: the first position scored (default 1)
  dimensions            INT64 [1]   embed: keep the first n dimensions (Matryoshka), before normalising
  normalize             BOOL  [1]   embed: L2-normalise (default: as the checkpoint says)
  prompt_name           BYTES [1]   embed: the checkpoint's named prompt put before each text
  truncate              BYTES [1]   embed, classify without items: cut a prompt over the input length,
                        "right" (keep its start) or "left" (keep its end); absent: refused as too long
Outputs, one element per result (prompts, or items of a multi-item call), in order:
  result_json           BYTES [r]   the whole ScoreResult as JSON (ScoreResult.to_json; the unambiguous form)
  chosen_token          BYTES [r]
  chosen_token_id       INT64 [r]
  chosen_prob           FP32  [r]
  allowed_probs         FP32  [r*k] row-major: result i's k allowed tokens in the order asked
  allowed_logprobs      FP32  [r*k] full-vocabulary log-probabilities, same layout
  prompt_tokens, cached_tokens   INT64 [r]
  embedding             FP32  [r, d] embed: each result's vector (d: its dimensions)
  class_logits, class_probs   FP32 [r, labels]   classify: the score head's raw outputs and their
                        probabilities (softmax, sigmoid, or the raw score, as the checkpoint says)
(loglikelihood, prompt_logprobs and decide: result_json, a ContinuationScore, PromptLogprobs or
DecisionResult each, and prompt_tokens and cached_tokens only; embed and classify: result_json (an
EmbeddingResult or ClassificationResult each), the counts and their own columns above, no chosen
token. A task that lists no option refuses it: normalize on a score request is invalid_request.)
The names, datatypes and dims, the error codes and their statuses are data in prefillonly.contract.wire.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from dataclasses import dataclass, field

import numpy as np

from ...contract.errors import EngineBusyError, InvalidRequestError, PrefillOnlyError
from ...contract.limits import RequestLimits
from ...contract.wire import CANCELLED, INPUTS, INTERNAL, LIVENESS_USER, SCORE, triton_status
from ... import tasks
from ...tasks.pooled import check_flag


def error_reply(error: BaseException) -> tuple[str, str]:
    """(Triton status name, one-line message that starts with "<code>: ") for a failed request.
    The code prefix is what clients (and the forwarder) can rely on: Triton does not carry the
    status through every path (README "Errors")."""
    if isinstance(error, PrefillOnlyError):
        code, detail = error.code, str(error)
    elif isinstance(error, CancelledError):
        code, detail = CANCELLED, "the client cancelled the request before it ran"
    else:
        code, detail = INTERNAL, f"{type(error).__name__}: {error}"
    detail = " ".join(detail.splitlines())  # one log line per event
    return triton_status(code), detail if detail.startswith(code) else f"{code}: {detail}"


@dataclass
class ScoreCall:
    """What one Triton request asks of the engine."""

    prompts: list  # texts (str) or one list of token ids
    allowed: list  # strings and/or ids
    items: list | None = None
    options: dict = field(default_factory=dict)  # keyword arguments of the engine's submit_task for the kind
    kind: str = "score"  # the registered request kind (tasks/) that answers it
    limits_checked: bool = False  # its counts and sizes were checked against the engine's RequestLimits


def parse_request(tensors: dict[str, np.ndarray], limits: RequestLimits | None = None) -> ScoreCall:
    """Validate and convert one request's input tensors; InvalidRequestError names the problem.
    Cheap by design (it runs on the thread that takes Triton's requests): counts and byte
    lengths are checked against `limits` before any text is decoded; tokenizing is the engine's.
    The request's kind (tasks.kind_for: its task and whether it has items) says which inputs apply."""
    unknown = sorted(set(tensors) - set(INPUTS))
    if unknown:
        raise InvalidRequestError(f"unknown input(s) {', '.join(unknown)}; known: {', '.join(INPUTS)}")
    prompts = _prompts(tensors, limits)
    allowed = _allowed(tensors, limits)
    items = _items(tensors, limits)
    kind = tasks.kind_for(_task(tensors), items is not None)
    if kind.takes_allowed and not allowed:
        raise InvalidRequestError("missing allowed tokens: give allowed_tokens (strings) and/or allowed_token_ids")
    if not kind.takes_allowed and allowed:
        raise InvalidRequestError(f"allowed tokens apply to task {SCORE!r}; task {kind.wire_task!r} scores the prompt's own tokens")
    if items is not None and len(prompts) != 1:
        raise InvalidRequestError("items need exactly one shared prompt, got several text_input values")
    if "item_template" in tensors and items is None:
        raise InvalidRequestError("item_template given without items")
    if "item_template" in tensors and "items" not in tensors:
        raise InvalidRequestError("item_template applies to text items, not to item_ids")
    options = _kind_options(tensors, kind, limits)
    if "user" in tensors:
        options["user"] = _text(_scalar(tensors["user"], "user"), "user")
    return ScoreCall(prompts=prompts, allowed=allowed, items=items, options=options, kind=kind.name,
                     limits_checked=limits is not None)


def _prompts(tensors: dict[str, np.ndarray], limits: RequestLimits | None) -> list:
    has_text, has_ids = "text_input" in tensors, "input_ids" in tensors
    if has_text == has_ids:
        raise InvalidRequestError("give exactly one of text_input (text) or input_ids (token ids)" if has_text
                                  else "missing prompt: give text_input (text) or input_ids (token ids)")
    if not has_text:
        return [_ints(tensors["input_ids"], "input_ids")]
    texts = _flat(tensors["text_input"])
    if limits is not None:
        limits.check_count(len(texts), "prompts (text_input values)", "max_prompts_per_request")
    prompts = [_text(x, "text_input", limits) for x in texts]
    if not prompts:
        raise InvalidRequestError("text_input is empty")
    return prompts


def _allowed(tensors: dict[str, np.ndarray], limits: RequestLimits | None) -> list:
    allowed_texts = _flat(tensors.get("allowed_tokens", []))
    allowed_ids = np.asarray(tensors.get("allowed_token_ids", np.zeros(0, np.int64)))
    if limits is not None:
        limits.check_count(len(allowed_texts) + allowed_ids.size, "allowed tokens", "max_allowed_tokens")
    return [_text(x, "allowed_tokens", limits) for x in allowed_texts] + _ints(allowed_ids, "allowed_token_ids")


def _task(tensors: dict[str, np.ndarray]) -> str:
    return _text(_scalar(tensors["task"], "task"), "task") if "task" in tensors else SCORE


# the option inputs and the engine keyword each becomes; a kind lists those it takes (an option of
# another kind is refused, not ignored)
OPTION_INPUTS = {"cache_prefix_len": "cache_prefix_len", "top_k": "top_k", "priority": "priority",
                 "logprobs_start": "start", "apply_chat_template": "apply_chat_template", "item_template": "item_template",
                 "dimensions": "dimensions", "normalize": "normalize", "prompt_name": "prompt_name", "truncate": "truncate"}
# how each option's one value is read (the rest are INT64); the kind checks the value itself
_FLAG_OPTIONS = ("apply_chat_template", "normalize")
_TEXT_OPTIONS = ("item_template", "prompt_name", "truncate")


def _kind_options(tensors: dict[str, np.ndarray], kind, limits: RequestLimits | None) -> dict:
    options = {}
    for name, keyword in OPTION_INPUTS.items():
        if name not in tensors:
            continue
        if name not in kind.options:
            raise InvalidRequestError(f"{name} does not apply to task {kind.wire_task!r}")
        if name in _FLAG_OPTIONS:
            options[keyword] = _scalar_bool(tensors[name], name)
        elif name in _TEXT_OPTIONS:
            options[keyword] = _text(_scalar(tensors[name], name), name, limits)
        else:
            options[keyword] = _scalar_int(tensors[name], name)
    return options


def submit_call(engine, call: ScoreCall) -> list:
    """The engine requests of one parsed call, all or nothing: one per prompt for a kind that
    runs each prompt on its own, else one; if one is refused, those queued are cancelled and the
    error raised (the Triton request is answered with it). What parse_request checked against the
    engine's limits the engine does not check again. A liveness probe while a long step keeps making
    progress is answered engine_busy at once (Engine.progressing_step), else it runs as a kind the
    checkpoint answers (make_answerable)."""
    if call.options.get("user") == LIVENESS_USER:
        progress = engine.progressing_step()
        if progress is not None:  # alive and working: the probe need not wait for that step's end
            raise EngineBusyError(f"the engine is busy, {progress}")
        make_answerable(engine, call)
    kind = tasks.kind_named(call.kind)
    arguments = dict(call.options)
    if kind.takes_allowed:
        arguments["allowed"] = call.allowed
    if kind.takes_items:
        arguments["items"] = call.items
    futures = []
    try:
        for prompt in call.prompts if kind.per_prompt else call.prompts[:1]:
            futures.append(engine.submit_task(kind.name, prompt, limits_checked=call.limits_checked, **arguments))
    except Exception:
        for f in futures:
            f.cancel()
        raise
    return futures


def make_answerable(engine, call: ScoreCall) -> ScoreCall:
    """Where the served checkpoint cannot answer `call`'s kind (a score asked of an embedding model
    or a sequence classifier), turn it, in place (its answer is then that kind's), into the pooled
    kind it does answer (embed, classify) over the same prompts, keeping the options that kind
    takes: what the model's warm-up and the liveness probe run, so that they reach the engine's
    worker instead of being refused before it. Returns `call`."""
    head = getattr(getattr(engine, "spec", None), "head", None)
    if head is None or head in tasks.kind_named(call.kind).heads:
        return call
    kind = next(k for k in map(tasks.kind_named, ("embed", "classify")) if head in k.heads)
    call.kind, call.allowed, call.items = kind.name, [], None
    call.options = {name: value for name, value in call.options.items() if name in kind.options or name == "user"}
    return call


def _items(tensors: dict[str, np.ndarray], limits: RequestLimits | None) -> list | None:
    """The items of a multi-item request: texts (`items`) or token-id lists (`item_ids` cut by
    `item_lengths`); None when the request has none."""
    has_ids = "item_ids" in tensors or "item_lengths" in tensors
    if "items" in tensors and has_ids:
        raise InvalidRequestError("give items (texts) or item_ids with item_lengths (token ids), not both")
    if "items" in tensors:
        item_texts = _flat(tensors["items"])
        if limits is not None:
            limits.check_count(len(item_texts), "items", "max_items")
        return [_text(x, "items", limits) for x in item_texts]
    if not has_ids:
        return None
    if "item_ids" not in tensors or "item_lengths" not in tensors:
        raise InvalidRequestError("item_ids and item_lengths go together: the items' ids back to back and each item's length")
    lengths = _ints(tensors["item_lengths"], "item_lengths")
    if limits is not None:
        limits.check_count(len(lengths), "items", "max_items")
    ids = _ints(tensors["item_ids"], "item_ids")
    if any(n <= 0 for n in lengths):
        raise InvalidRequestError(f"item_lengths must be positive (item {next(i for i, n in enumerate(lengths) if n <= 0)} is not)")
    if sum(lengths) != len(ids):
        raise InvalidRequestError(f"item_lengths add up to {sum(lengths)} but item_ids has {len(ids)} ids")
    ends = np.cumsum(lengths).tolist()
    return [ids[end - n:end] for n, end in zip(lengths, ends)]


def results_to_outputs(call: ScoreCall, results: list) -> dict[str, np.ndarray]:
    """The output tensors of a call's answers, as its kind puts them on the wire."""
    return tasks.kind_named(call.kind).to_outputs(results)


def _flat(a) -> list:
    return list(np.asarray(a, dtype=object).reshape(-1)) if np.size(a) else []


def _text(value, name: str, limits: RequestLimits | None = None) -> str:
    if limits is not None:
        limits.check_text(value, name)  # np.bytes_ is bytes
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"{name} is not valid UTF-8: byte 0x{bytes(value)[e.start]:02x} at offset {e.start}") from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name} must be text (BYTES), got {type(value).__name__}")


def _ints(a, name: str) -> list[int]:
    arr = np.asarray(a)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"{name} must be integers (INT64), got {arr.dtype}")
    return [int(x) for x in arr.reshape(-1)]


def _scalar(a, name: str):
    arr = np.asarray(a, dtype=object if np.asarray(a).dtype == object else None).reshape(-1)
    if arr.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one value, got {arr.size}")
    return arr[0]


def _scalar_bool(a, name: str) -> bool:
    return check_flag(_scalar(a, name), name)


def _scalar_int(a, name: str) -> int:
    value = _scalar(a, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidRequestError(f"{name} must be an integer (INT64), got {value!r}")
    return int(value)
