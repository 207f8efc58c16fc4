"""A scoring request as data: what the scheduler queues and the runner computes.

Engine.submit* validates and tokenizes in the caller's thread and builds a ScoreRequest; from
there on the request is plain data (no closures), so the scheduler can group requests into one
forward step and everything below can be tested without a model. The checks that turn a
caller's arguments into a ScoreRequest live here too: each raises InvalidRequestError naming
the bad argument.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .errors import InvalidRequestError, PromptTooLongError

ITEM_PLACEHOLDER = "{item}"


@dataclass(eq=False)
class ScoreRequest:
    token_ids: list[int]  # the prompt (of a multi-item request: the shared prompt)
    allowed_ids: list[int]  # output tokens to score, in the order asked
    top_k: int = 0  # also return the k most likely tokens of the whole vocabulary
    keep_len: int = 0  # leading tokens the prefix cache may keep (the cache boundary)
    namespace: str | None = None  # cache hits never cross namespaces
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix-cache keys, hashed once at submit
    item_ids: list[list[int]] | None = None  # multi-item: each item is scored as a suffix of token_ids

    @property
    def total_tokens(self) -> int:
        """Prompt tokens the request carries (a multi-item request: shared prompt + every item)."""
        return len(self.token_ids) + (sum(map(len, self.item_ids)) if self.item_ids else 0)

    @property
    def rope_length(self) -> int:
        """The sequence length that picks a length-switched RoPE's factors (LongRoPE): the prompt,
        or the shared prompt with its longest item (every item of a request computes in the regime
        of that length; the engine refuses a request whose items fall on both sides)."""
        return len(self.token_ids) + (max(map(len, self.item_ids)) if self.item_ids else 0)

    @property
    def runs_alone(self) -> bool:
        """A multi-item request is a step of its own: its shared prompt first, then its items
        batched over the shared K/V."""
        return self.item_ids is not None


def check_top_k(top_k, vocab_size: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise InvalidRequestError(f"top_k must be an integer, got {top_k!r}")
    if not 0 <= top_k <= vocab_size:
        raise InvalidRequestError(f"top_k {top_k} must be between 0 and the vocabulary size {vocab_size}")
    return int(top_k)


def check_cache_prefix_len(value, prompt_len: int) -> int:
    """The keep boundary: at most this many leading tokens go into the prefix cache (default all)."""
    if value is None:
        return prompt_len
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"cache_prefix_len must be an integer, got {value!r}")
    if not 0 <= value <= prompt_len:
        raise InvalidRequestError(f"cache_prefix_len {value} must be between 0 and the prompt length {prompt_len}")
    return int(value)


def check_namespace(namespace, user) -> str | None:
    """The cache namespace: `cache_namespace`, else the user."""
    for name, value in (("cache_namespace", namespace), ("user", user)):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return namespace if namespace is not None else user


def check_length(n: int, max_input_len: int) -> None:
    if n > max_input_len:
        raise PromptTooLongError(f"prompt has {n} tokens, over the max input length {max_input_len}")


def check_priority(priority) -> int:
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    return int(priority)


def check_deadline(deadline_s) -> float | None:
    if deadline_s is None:
        return None
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, numbers.Real) or not deadline_s > 0:
        raise InvalidRequestError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    return float(deadline_s)


def check_item_template(template) -> None:
    """Only the literal {item} is replaced; everything else is text (no format specs, no fields:
    str.format would let a client ask for `{item:>4000000}` or `{item.__class__}`)."""
    if not isinstance(template, str):
        raise InvalidRequestError(f"item_template must be a string, got {type(template).__name__}")
    if ITEM_PLACEHOLDER not in template:
        raise InvalidRequestError(f"item_template {template[:80]!r} has no {ITEM_PLACEHOLDER}: each item would be lost")
