"""The `items` kind (wire task `score` with items): N items that share one prompt, each scored as
a suffix of it (one ScoreResult per item, in item order).

The request is a step of its own: the shared prompt once (through the prefix cache), then its
items batched over the shared K/V in the groups the scheduler planned."""

from __future__ import annotations

import numpy as np

from ..contract.wire import SCORE
from ..request import Request
from .base import RequestKind, RowOutput, SubmitContext, check_items
from .score import score_outputs, scored_tokens


class ItemsKind(RequestKind):
    name = "items"
    wire_task = SCORE
    takes_items = True
    takes_allowed = True
    per_prompt = False
    options = ("cache_prefix_len", "top_k", "priority", "apply_chat_template", "item_template")

    def build(self, ctx: SubmitContext, prompt, *, items, allowed, item_template: str | None = None, top_k: int = 0,
              apply_chat_template: bool = False) -> Request:
        allowed_ids, top_k = scored_tokens(ctx, allowed, top_k)
        shared = ctx.encoder.encode_prompt(prompt, apply_chat_template=apply_chat_template)
        item_ids = ctx.encoder.encode_items(items, item_template)
        check_items(ctx, shared, item_ids, "items")
        return Request(self, shared, allowed_ids, top_k, item_ids=item_ids)

    def item_result(self, request: Request, index: int, context, row: RowOutput, token_text):
        from ..worker.outputs import build_result

        return build_result(row.logits, request.allowed_ids, request.top_k, token_text,
                            len(request.token_ids) + len(request.item_ids[index]), row.cached_tokens, row.peak_bytes)

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        return score_outputs(results)
