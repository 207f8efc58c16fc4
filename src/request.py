"""The engine's request record, from submit to answer, and the checks that build it.

Engine.submit_task has the request's kind (tasks/) validate and tokenize in the caller's thread and
build one Request: the prompt as token ids, what to score, the step shape, its cache keys, its
priority and deadline, and the Future its answer goes to. The scheduler sees it as a Schedulable
(scheduler/plan.py: token counts, block keys, the step shape, and the arrival fields it writes);
the runner reads its token ids and asks its kind for the answer; scheduler.finish answers it. It
is plain data (no closures), so everything below the engine can be tested without a model. The
checks that turn a caller's arguments into a Request live here too: each raises
InvalidRequestError naming the bad argument.
"""

from __future__ import annotations

import numbers
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .contract.errors import InvalidRequestError, PromptTooLongError
from .contract.tenants import TENANT_MARK, tenant_name_problem

ITEM_PLACEHOLDER = "{item}"
MAX_SPAN_TOP_K = 20  # top tokens per position of a logprob span (OpenAI's legacy `logprobs` allows 5, vLLM 20)


class RequestFuture(Future):
    """The Future submit() returns. started_at: time.monotonic() when the worker started the
    request (None while it waits), so that a server can report queue wait; prompt_tokens and
    cached_tokens: the request's own, counted once (a multi-item request's results each report
    the shared prompt), so that a server can count tokens per tenant."""

    started_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(eq=False)
class Request:
    # the request's kind (tasks/: score, items, loglikelihood, prompt_logprobs, ...): it built this
    # record, declared the step shape below, and turns the forward's rows into the answer
    kind: Any
    token_ids: list[int]  # the prompt (of a multi-item request: the shared prompt)
    allowed_ids: list[int]  # output tokens to score, in the order asked
    top_k: int = 0  # also return the k most likely tokens of the whole vocabulary
    # the step shape, declared by the kind (the scheduler and the runner read these, never the kind):
    item_ids: list[list[int]] | None = None  # multi-item: each item is computed as a suffix of token_ids
    # a logprob span: the prompt's own tokens' log-probabilities at its last `logprob_rows` positions
    # (each given the tokens before it), with the top `logprob_top_k` tokens there
    logprob_rows: int = 0
    logprob_top_k: int = 0
    item_logprobs: bool = False  # each item's own tokens' logprobs (a span of its length - 1 rows)
    # a tree: per item, continuations scored over it (each one's first token read from the item's
    # last row, the rest from a span over its own rows; decisions' options over their question)
    item_continuations: list[list[list[int]]] | None = None
    # pooled output (embeddings, classifier scores): the prompt's (or each item's) final hidden
    # states pooled as the executor's Sequence.pool says: "last", "mean", "cls" or "score"
    pool: str | None = None
    task_state: Any = None  # what the kind keeps from build for its answer (decisions: the call, its rendering)
    namespace: str | None = None  # cache hits never cross namespaces
    tenant: str | None = None  # the team it came for: its own cache namespace, its fair share of the scheduler
    priority: int = 0  # higher runs first
    deadline: float | None = None  # scheduler clock time after which it must not start
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix-cache keys (set at enqueue)
    # leading blocks of block_hashes the cache may keep: the keep boundary (cache_prefix_len) in whole
    # blocks, set at submit (the only unit below the engine's API)
    kept_blocks: int = 0
    future: RequestFuture = field(default_factory=RequestFuture)
    # written by the scheduler when it queues the request
    arrived: float = 0.0
    seq: int = 0
    frozen_estimate_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the request computes (a multi-item request: shared prompt + every item)."""
        items = sum(map(len, self.item_ids)) if self.item_ids else 0
        continuations = sum(len(c) for cs in self.item_continuations for c in cs) if self.item_continuations else 0
        return len(self.token_ids) + items + continuations

    @property
    def cache_tokens(self) -> int:
        """Tokens the prefix cache sees: the prompt (of a multi-item request, the shared prompt)."""
        return len(self.token_ids)

    @property
    def item_tokens(self) -> list[int] | None:
        return [len(x) for x in self.item_ids] if self.item_ids is not None else None

    @property
    def continuation_tokens(self) -> list[list[int]] | None:
        return [[len(c) for c in cs] for cs in self.item_continuations] if self.item_continuations is not None else None

    @property
    def rope_length(self) -> int:
        """The sequence length that picks a length-switched RoPE's factors (LongRoPE): the prompt,
        or the shared prompt with its longest item and continuation (every item of a request computes
        in the regime of that length; the engine refuses a request whose items fall on both sides)."""
        if not self.item_ids:
            return len(self.token_ids)
        conts = self.item_continuations or [[] for _ in self.item_ids]
        return len(self.token_ids) + max(len(x) + max(map(len, c), default=0) for x, c in zip(self.item_ids, conts))

    @property
    def runs_alone(self) -> bool:
        """Never batched with other requests: a multi-item request is a step of its own, its shared
        prompt first, then its items batched over the shared K/V (derived from item_ids, so no kind
        can declare items without it). A logprob span shares a step: the step's memory check counts
        each member's span."""
        return self.item_ids is not None

    def start(self, cached_tokens: int = 0) -> bool:
        """The worker picked it, `cached_tokens` of it from the prefix cache: its Future runs (False:
        it was cancelled first)."""
        if not self.future.set_running_or_notify_cancel():
            return False
        self.future.started_at = time.monotonic()
        self.future.prompt_tokens, self.future.cached_tokens = self.prompt_tokens, cached_tokens
        return True


def check_top_k(top_k, vocab_size: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise InvalidRequestError(f"top_k must be an integer, got {top_k!r}")
    if not 0 <= top_k <= vocab_size:
        raise InvalidRequestError(f"top_k {top_k} must be between 0 and the vocabulary size {vocab_size}")
    return int(top_k)


def check_span_top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise InvalidRequestError(f"top_k must be an integer, got {top_k!r}")
    if not 0 <= top_k <= MAX_SPAN_TOP_K:
        raise InvalidRequestError(f"top_k {top_k} must be between 0 and {MAX_SPAN_TOP_K} for per-position logprobs")
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
        if value is not None and TENANT_MARK in value:
            raise InvalidRequestError(f"{name} must not contain the character U+001F")
    return namespace if namespace is not None else user


def check_tenant(tenant) -> str | None:
    """A tenant's name (None: no tenant): 1 to 64 characters of [A-Za-z0-9._-]."""
    if tenant is None:
        return None
    problem = tenant_name_problem(tenant)  # the rule the key files' tenants follow too
    if problem:
        raise InvalidRequestError(f"tenant: {problem:.200}")
    return tenant


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
