"""The `prompt_logprobs` kind: each of a prompt's own tokens' log-probability from position
`start` on (each given every token before it) and the top_k (<= 20) tokens there; a PromptLogprobs.

A logprob span over the prompt's last rows; cached positions read the final hidden states the
prefix cache keeps with their K/V, so nothing is recomputed."""

from __future__ import annotations

from ..contract.errors import InvalidRequestError
from ..contract.wire import PROMPT_LOGPROBS
from ..request import Request, check_length, check_span_top_k
from .base import RequestKind, RowOutput, SubmitContext


class PromptLogprobsKind(RequestKind):
    name = "prompt_logprobs"
    wire_task = PROMPT_LOGPROBS
    options = ("cache_prefix_len", "top_k", "priority", "logprobs_start")

    def build(self, ctx: SubmitContext, prompt, *, start: int = 1, top_k: int = 0) -> Request:
        ids = ctx.encoder.encode_prompt(prompt)
        check_length(len(ids), ctx.max_input_len)
        if len(ids) < 2:
            raise InvalidRequestError("prompt has 1 token: per-position logprobs need at least 2")
        if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start < len(ids):
            raise InvalidRequestError(f"start must be an integer in [1, {len(ids) - 1}] (the prompt has {len(ids)} tokens), got {start!r}")
        return Request(self, ids, [], 0, logprob_rows=len(ids) - start, logprob_top_k=check_span_top_k(top_k))

    def result(self, request: Request, row: RowOutput, token_text):
        from ..worker.outputs import prompt_logprobs

        return prompt_logprobs(request.token_ids, row.span, row.logits, token_text, row.cached_tokens)
