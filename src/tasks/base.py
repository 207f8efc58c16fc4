"""What every request kind provides, and the pieces kinds share.

A kind (score, items, loglikelihood, prompt_logprobs, or one a caller registers) is one object
that owns, for its requests:
  - the wire: its task name, whether it takes items and allowed tokens, which options it accepts
    (serving/model/protocol.py asks, never the field combinations);
  - the Request: its arguments' checks and tokenizing (`build`), including the step shape the
    scheduler reads as declared fields (item lengths, so the request runs alone; a logprob span per
    row);
  - the result: from the forward's rows to its answer type (`result`, or `item_result` for a kind
    whose items run over a shared prompt), and the answer's output tensors (`to_outputs`).
Tensor-free at import: the Triton model's protocol reads kinds without torch; the result builders
import worker/outputs.py (torch) when they first run, on the engine's side only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..contract.checkpoint import LM_HEAD
from ..contract.errors import InvalidRequestError
from ..contract.limits import DEFAULT_MAX_DECISION_TOKENS
from ..contract.wire import RESULT_JSON
from ..request import Request, check_length


@dataclass(frozen=True)
class SubmitContext:
    """What building a Request needs from the engine: its prompt encoder (tokenizer and limits),
    the model's description (vocabulary, RoPE regime) and the longest prompt it takes."""

    encoder: Any  # prompts.PromptEncoder
    spec: Any  # model.spec.ModelSpec
    max_input_len: int
    max_decision_tokens: int = DEFAULT_MAX_DECISION_TOKENS  # question + option tokens of one decision call
    pooling: Any = None  # contract.pooling_files.PoolingFiles: how the checkpoint embeds (None: it does not)


@dataclass(frozen=True)
class RowOutput:
    """One result's rows of a forward: the last row's float32 logits, the logprob span (when the
    request asked for one; for an item with continuations, a list: each continuation's span, None
    for a one-token one), the prompt tokens read from the cache, the step's measured peak, and the
    pooled vector (Request.pool: float32 [hidden] or a classifier's [labels])."""

    logits: Any
    span: Any
    cached_tokens: int
    peak_bytes: int
    pooled: Any = None


class RequestKind:
    """The base of every kind; see the module docstring. Class attributes describe the wire."""

    name: ClassVar[str]  # the registry's key (tasks/__init__.py)
    wire_task: ClassVar[str]  # the `task` input that asks for it
    takes_items: ClassVar[bool] = False  # True: exactly one shared prompt and its items
    takes_allowed: ClassVar[bool] = False  # True: allowed tokens are required; False: refused
    per_prompt: ClassVar[bool] = True  # one engine request per prompt of a call (False: one in all)
    options: ClassVar[tuple[str, ...]] = ()  # wire options besides user (protocol.OPTION_INPUTS)
    items_phrase: ClassVar[str] = "items"  # what its items are, in error messages
    # the checkpoint heads (contract.checkpoint: lm, embedding, classifier) whose model answers it;
    # the engine refuses the kind on any other, naming why
    heads: ClassVar[tuple[str, ...]] = (LM_HEAD,)

    def build(self, ctx: SubmitContext, prompt, **arguments) -> Request:
        """Check and tokenize the kind's own arguments into a Request (InvalidRequestError naming
        the bad one); the engine adds the options every kind shares (cache, namespace, priority)."""
        raise NotImplementedError

    def result(self, request: Request, row: RowOutput, token_text):
        """A request's answer from its rows of a batch forward."""
        raise NotImplementedError

    def items_context(self, shared_logits):
        """What every item's result reads from the shared prompt's last logits (None: nothing)."""
        return None

    def item_result(self, request: Request, index: int, context, row: RowOutput, token_text):
        """Item `index`'s answer from its rows of an item group's forward."""
        raise NotImplementedError

    def items_done(self, request: Request, results: list, cached_tokens: int):
        """A multi-item request's answer from its items' results, in item order (the list itself;
        a kind whose items make one answer together, as decisions' questions do, builds it here)."""
        return results

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        """The output tensors of one Triton request's answers (result_json and the token counts;
        a kind may add its own columns)."""
        return document_outputs(results)


def document_outputs(results: list) -> dict[str, np.ndarray]:
    """result_json (each answer's JSON document) and the prompt and cached token counts."""
    return {RESULT_JSON: np.array([r.to_json().encode() for r in results], dtype=np.object_),
            "prompt_tokens": np.array([r.prompt_tokens for r in results], dtype=np.int64),
            "cached_tokens": np.array([r.cached_tokens for r in results], dtype=np.int64)}


def check_items(ctx: SubmitContext, shared: list[int], item_ids: list[list[int]], what: str) -> None:
    """Shared prompt + longest item within the input length; every item in one RoPE regime."""
    check_length(len(shared) + max(len(x) for x in item_ids), ctx.max_input_len)
    spec = ctx.spec
    if len({spec.rope_long(len(shared) + len(x)) for x in item_ids}) > 1:
        raise InvalidRequestError(
            f"the {what} put prompt + item on both sides of {spec.rope_switch_length} tokens, where this model's "
            f"LongRoPE switches to its long factors (transformers would rotate them differently): send the {what} "
            f"shorter and longer than that as two requests")
