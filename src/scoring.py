"""From the last position's logits to a ScoreResult."""

from __future__ import annotations

import torch

from .result import ScoreResult, TokenScore


def score_logits(logits: torch.Tensor, allowed_ids: list[int], top_k: int, token_text) -> tuple[list[TokenScore], TokenScore, list[TokenScore]]:
    """logits: [vocab] float32. Returns (allowed TokenScores in order, chosen, top_k TokenScores)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # over the full vocabulary
    allowed = torch.tensor(allowed_ids, dtype=torch.long, device=logprobs.device)
    allowed_lp = logprobs.index_select(0, allowed)
    allowed_p = torch.softmax(allowed_lp, dim=-1)  # renormalised over the allowed set
    tokens = [
        TokenScore(id=i, text=token_text(i), logprob=float(lp), prob=float(p))
        for i, lp, p in zip(allowed_ids, allowed_lp.tolist(), allowed_p.tolist())
    ]
    chosen = tokens[int(torch.argmax(allowed_p))]
    top = []
    if top_k:
        values, indices = torch.topk(logprobs, top_k)
        top = [TokenScore(id=int(i), text=token_text(int(i)), logprob=float(v), prob=float(torch.exp(v))) for v, i in zip(values, indices)]
    return tokens, chosen, top


def build_result(logits, allowed_ids, top_k, token_text, prompt_tokens, cached_tokens, peak_bytes) -> ScoreResult:
    tokens, chosen, top = score_logits(logits, allowed_ids, top_k, token_text)
    return ScoreResult(tokens=tokens, chosen=chosen, top_k=top, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, peak_bytes=peak_bytes)
