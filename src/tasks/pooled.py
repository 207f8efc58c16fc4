"""The pooled kinds: `embed` (an embedding of each prompt), `classify` (a sequence classifier's or
reward model's label scores after each prompt) and `classify_items` (wire task `classify` with
items: N responses to one shared prompt, the prompt computed once: best-of-N reward scoring).

Each reads the final hidden states the forward leaves (Request.pool; worker/executor.py pools
them): a prompt whose prefix the cache holds pools from the cached blocks' hidden states and
computes only its new tokens. Which checkpoints answer which kind is the kind's `heads`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from ..contract.checkpoint import CLASSIFIER_HEAD, LM_HEAD, NO_HEAD
from ..contract.errors import InvalidRequestError
from ..contract.wire import CLASSIFY, EMBED
from ..request import Request, check_length
from .base import RequestKind, RowOutput, SubmitContext, check_items, document_outputs

TRUNCATE_SIDES = ("right", "left")  # right: cut the end (keep the start); left: cut the start


@dataclass(frozen=True)
class PooledState:
    """What a pooled request's answer needs beyond its rows (Request.task_state)."""

    truncated_tokens: int = 0
    dimensions: int | None = None  # embed: Matryoshka truncation
    normalize: bool = False  # embed: L2-normalise
    labels: tuple[str, ...] = ()  # classify: the label names
    activation: str = "none"  # classify: softmax | sigmoid | none


class EmbedKind(RequestKind):
    name = "embed"
    wire_task = EMBED
    options = ("cache_prefix_len", "priority", "dimensions", "normalize", "prompt_name", "truncate")
    heads = (LM_HEAD, NO_HEAD)

    def build(self, ctx: SubmitContext, prompt, *, dimensions=None, normalize=None, prompt_name=None,
              truncate=None) -> Request:
        pooling = ctx.pooling
        ids, cut = pooled_prompt(ctx, prompt, named_prompt(pooling.prompts, prompt_name, pooling.default_prompt_name, prompt),
                                 truncate)
        state = PooledState(cut, check_dimensions(dimensions, ctx.spec.hidden_size),
                            pooling.normalize if normalize is None else check_flag(normalize, "normalize"))
        return Request(self, ids, [], 0, pool=pooling.mode, task_state=state)

    def result(self, request: Request, row: RowOutput, token_text):
        from ..worker.outputs import embedding_result

        s = request.task_state
        return embedding_result(row.pooled, s.dimensions, s.normalize, request.pool, len(request.token_ids), row.cached_tokens,
                                s.truncated_tokens)

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        return {**document_outputs(results), "embedding": np.array([r.embedding for r in results], dtype=np.float32)}


class ClassifyKind(RequestKind):
    name = "classify"
    wire_task = CLASSIFY
    options = ("cache_prefix_len", "priority", "truncate")
    heads = (CLASSIFIER_HEAD,)

    def build(self, ctx: SubmitContext, prompt, *, truncate=None) -> Request:
        ids, cut = pooled_prompt(ctx, prompt, None, truncate)
        return Request(self, ids, [], 0, pool="score", task_state=classifier_state(ctx, cut))

    def result(self, request: Request, row: RowOutput, token_text):
        return _classification(request, row, len(request.token_ids))

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        return classification_outputs(results)


class ClassifyItemsKind(RequestKind):
    name = "classify_items"
    wire_task = CLASSIFY
    takes_items = True
    per_prompt = False
    options = ("cache_prefix_len", "priority")
    heads = (CLASSIFIER_HEAD,)
    items_phrase = "the responses"

    def build(self, ctx: SubmitContext, prompt, *, items) -> Request:
        shared = ctx.encoder.encode_prompt(prompt)
        item_ids = ctx.encoder.encode_items(items, None)
        check_items(ctx, shared, item_ids, "responses")
        return Request(self, shared, [], 0, item_ids=item_ids, pool="score", task_state=classifier_state(ctx, 0))

    def item_result(self, request: Request, index: int, context, row: RowOutput, token_text):
        return _classification(request, row, len(request.token_ids) + len(request.item_ids[index]))

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        return classification_outputs(results)


def _classification(request: Request, row: RowOutput, prompt_tokens: int):
    from ..worker.outputs import classification_result

    s = request.task_state
    return classification_result(row.pooled, s.labels, s.activation, prompt_tokens, row.cached_tokens, s.truncated_tokens)


def classifier_state(ctx: SubmitContext, truncated_tokens: int) -> PooledState:
    return PooledState(truncated_tokens, labels=ctx.spec.labels, activation=ctx.spec.label_activation)


def classification_outputs(results: list) -> dict[str, np.ndarray]:
    return {**document_outputs(results), "class_logits": np.array([r.logits for r in results], dtype=np.float32),
            "class_probs": np.array([r.probs for r in results], dtype=np.float32)}


def pooled_prompt(ctx: SubmitContext, prompt, prefix_text: str | None, truncate) -> tuple[list[int], int]:
    """(token ids, tokens cut) of a pooled request's prompt: a named prompt's text put before a text
    prompt (tokenized together, as sentence-transformers does), then, with `truncate`, cut to the
    max input length (leading and trailing special tokens kept, as a tokenizer's truncation keeps
    them); without it a prompt over the length is refused."""
    side = check_truncate(truncate)
    ids = ctx.encoder.encode_prompt(prompt, what="input", text_prefix=prefix_text or "")
    if side is None or len(ids) <= ctx.max_input_len:
        check_length(len(ids), ctx.max_input_len)
        return ids, 0
    return cut_tokens(ids, ctx.max_input_len, side, ctx.encoder.special_ids()), len(ids) - ctx.max_input_len


def cut_tokens(ids: list[int], length: int, side: str, special: set[int]) -> list[int]:
    """`ids` cut to `length` tokens from `side`, its leading and trailing special tokens kept."""
    lead = next((i for i, t in enumerate(ids) if t not in special), len(ids))
    trail = next((i for i, t in enumerate(reversed(ids)) if t not in special), 0) if lead < len(ids) else 0
    keep = length - lead - trail
    if keep < 1:  # nothing of the text would be left: cut plainly
        return ids[:length] if side == "right" else ids[len(ids) - length :]
    body = ids[lead : len(ids) - trail]
    body = body[:keep] if side == "right" else body[len(body) - keep :]
    return ids[:lead] + body + ids[len(ids) - trail :]


def named_prompt(prompts: dict[str, str], name, default: str | None, prompt) -> str | None:
    """The text of the named prompt `name` (else the checkpoint's default prompt, for a text input);
    InvalidRequestError naming the known prompts for an unknown name, or a name with token ids."""
    if name is None:
        return prompts.get(default) if default is not None and not _is_ids(prompt) else None
    if not isinstance(name, str):
        raise InvalidRequestError(f"prompt_name must be a string, got {type(name).__name__}")
    if name not in prompts:
        raise InvalidRequestError(f"prompt_name {name!r} is not one of this model's prompts: {', '.join(prompts) or 'it has none'}")
    if _is_ids(prompt):
        raise InvalidRequestError("prompt_name applies to text input, not token ids")
    return prompts[name]


def _is_ids(prompt) -> bool:
    return not isinstance(prompt, (str, bytes, bytearray))


def check_dimensions(value, hidden_size: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"dimensions must be an integer, got {value!r}")
    if not 1 <= value <= hidden_size:
        raise InvalidRequestError(f"dimensions {value} must be between 1 and the model's hidden size {hidden_size}")
    return None if value == hidden_size else int(value)


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidRequestError(f"{name} must be true or false, got {value!r}")
    return bool(value)


def check_truncate(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in TRUNCATE_SIDES:
        raise InvalidRequestError(f"truncate must be one of {', '.join(TRUNCATE_SIDES)} (the side cut), got {value!r}")
    return value.lower()
