"""The request kinds and their registry: the one place that maps a wire task to a kind.

    kind = kind_for(task, has_items)       # the Triton model's protocol: what a call asks
    engine.submit_task(kind.name, prompt, ...)   # the engine: kind.build -> Request -> queue
    request.kind.result(...)               # the runner: the forward's rows -> the answer
    kind.to_outputs(results)               # the protocol: answers -> output tensors

A kind is one module (score.py, items.py, loglikelihood.py, prompt_logprobs.py, decide.py, pooled.py: embed,
classify and classify_items; base.py says what each provides); adding one is a module plus `register(...)`, nothing else.
"""

from __future__ import annotations

from ..contract.errors import InvalidRequestError
from .base import RequestKind, RowOutput, SubmitContext
from .decide import DecisionsKind
from .items import ItemsKind
from .loglikelihood import LoglikelihoodKind
from .pooled import ClassifyItemsKind, ClassifyKind, EmbedKind
from .prompt_logprobs import PromptLogprobsKind
from .score import ScoreKind

_KINDS: dict[str, RequestKind] = {}


def register(kind: RequestKind) -> RequestKind:
    """Add a kind; its name must be new, and no other kind may answer the same wire task with
    the same items-or-not (kind_for must find exactly one)."""
    if kind.name in _KINDS:
        raise ValueError(f"a request kind named {kind.name!r} is registered already")
    clash = [k.name for k in _KINDS.values() if (k.wire_task, k.takes_items) == (kind.wire_task, kind.takes_items)]
    if clash:
        raise ValueError(f"kind {kind.name!r} answers task {kind.wire_task!r} like {clash[0]!r} does")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Take a kind out (tests that register their own)."""
    _KINDS.pop(name, None)


def kind_named(name: str) -> RequestKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown request kind {name!r}; known: {', '.join(_KINDS)}") from None


def wire_tasks() -> list[str]:
    """The `task` values a request may send, in registration order."""
    return list(dict.fromkeys(k.wire_task for k in _KINDS.values()))


def kind_for(task: str, has_items: bool) -> RequestKind:
    """The kind that answers wire task `task` with (or without) items; InvalidRequestError naming
    what is wrong otherwise."""
    kinds = [k for k in _KINDS.values() if k.wire_task == task]
    if not kinds:
        raise InvalidRequestError(f"unknown task {task!r}; choose one of {', '.join(wire_tasks())}")
    for k in kinds:
        if k.takes_items == has_items:
            return k
    if has_items:
        raise InvalidRequestError(f"task {task!r} takes prompts, not items")
    raise InvalidRequestError(f"task {task!r} needs {kinds[0].items_phrase} as items (texts) or item_ids with item_lengths")


for _kind in (ScoreKind(), ItemsKind(), LoglikelihoodKind(), PromptLogprobsKind(), DecisionsKind(), EmbedKind(), ClassifyKind(),
              ClassifyItemsKind()):
    register(_kind)

__all__ = ["RequestKind", "RowOutput", "SubmitContext", "register", "unregister", "kind_named", "kind_for", "wire_tasks"]
