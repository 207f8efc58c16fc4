"""The `score` kind: the probabilities of the allowed tokens after each prompt (ScoreResult).

Each prompt of a call is its own request; requests of this kind share forward steps."""

from __future__ import annotations

import numpy as np

from ..contract.wire import SCORE
from ..request import Request, check_length, check_top_k
from .base import RequestKind, RowOutput, SubmitContext, document_outputs


class ScoreKind(RequestKind):
    name = "score"
    wire_task = SCORE
    takes_allowed = True
    options = ("cache_prefix_len", "top_k", "priority", "apply_chat_template")

    def build(self, ctx: SubmitContext, prompt, *, allowed, top_k: int = 0, apply_chat_template: bool = False) -> Request:
        allowed_ids, top_k = scored_tokens(ctx, allowed, top_k)
        ids = ctx.encoder.encode_prompt(prompt, apply_chat_template=apply_chat_template)
        check_length(len(ids), ctx.max_input_len)
        return Request(self, ids, allowed_ids, top_k)

    def result(self, request: Request, row: RowOutput, token_text):
        from ..worker.outputs import build_result

        return build_result(row.logits, request.allowed_ids, request.top_k, token_text, len(request.token_ids),
                            row.cached_tokens, row.peak_bytes)

    def to_outputs(self, results: list) -> dict[str, np.ndarray]:
        return score_outputs(results)


def scored_tokens(ctx: SubmitContext, allowed, top_k) -> tuple[list[int], int]:
    """The allowed tokens' ids and the checked top_k: what a ScoreResult is built from (the score
    and items kinds alike)."""
    return ctx.encoder.resolve_allowed(allowed), check_top_k(top_k, ctx.spec.vocab_size)


def score_outputs(results: list) -> dict[str, np.ndarray]:
    """The ScoreResults' documents and their columns: the chosen token, the allowed tokens'
    probabilities and logprobs row-major (result i's k allowed tokens in the order asked)."""
    return {
        **document_outputs(results),
        "chosen_token": np.array([r.chosen.text.encode() for r in results], dtype=np.object_),
        "chosen_token_id": np.array([r.chosen.id for r in results], dtype=np.int64),
        "chosen_prob": np.array([r.chosen.prob for r in results], dtype=np.float32),
        "allowed_probs": np.array([t.prob for r in results for t in r.tokens], dtype=np.float32),
        "allowed_logprobs": np.array([t.logprob for r in results for t in r.tokens], dtype=np.float32),
    }
