"""The `loglikelihood` kind: the log-likelihood of each continuation (the items) after one context
(the prompt), as lm-evaluation-harness asks it; one ContinuationScore per continuation.

The context runs once; each continuation's first token is read from the context's last logits
(items_context), the rest from a logprob span over the continuation's own rows."""

from __future__ import annotations

from ..contract.wire import LOGLIKELIHOOD
from ..request import Request
from .base import RequestKind, RowOutput, SubmitContext, check_items


class LoglikelihoodKind(RequestKind):
    name = "loglikelihood"
    wire_task = LOGLIKELIHOOD
    takes_items = True
    per_prompt = False
    options = ("cache_prefix_len", "priority")
    items_phrase = "the continuations"

    def build(self, ctx: SubmitContext, prompt, *, items) -> Request:
        shared, item_ids = ctx.encoder.encode_continuations(prompt, items)
        check_items(ctx, shared, item_ids, "continuations")
        return Request(self, shared, [], 0, item_ids=item_ids, item_logprobs=True)

    def items_context(self, shared_logits):
        from ..worker.outputs import context_choice

        return context_choice(shared_logits)

    def item_result(self, request: Request, index: int, context, row: RowOutput, token_text):
        from ..worker.outputs import continuation_score

        return continuation_score(context, request.item_ids[index], row.span, len(request.token_ids), row.cached_tokens)
