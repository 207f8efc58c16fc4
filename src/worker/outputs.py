"""From a forward's logits to what a request returns: the last position's logits to a ScoreResult,
a logprob span to a continuation's log-likelihood or a prompt's per-position logprobs."""

from __future__ import annotations

import torch

from ..contract.wire import ClassificationResult, ContinuationScore, EmbeddingResult, PromptLogprobs, ScoreResult, TokenScore


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
    top = _top_scores(*torch.topk(logprobs, top_k), token_text) if top_k else []
    return tokens, chosen, top


def build_result(logits, allowed_ids, top_k, token_text, prompt_tokens, cached_tokens, peak_bytes) -> ScoreResult:
    tokens, chosen, top = score_logits(logits, allowed_ids, top_k, token_text)
    return ScoreResult(tokens=tokens, chosen=chosen, top_k=top, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, peak_bytes=peak_bytes)


def context_choice(context_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(log-probabilities, argmax) after a log-likelihood request's context: computed once, read by
    every continuation's first token (continuation_score)."""
    logprobs = torch.log_softmax(context_logits.float(), dim=-1)
    return logprobs, int(torch.argmax(logprobs))


def continuation_score(context: tuple[torch.Tensor, int], continuation: list[int], span, context_tokens: int,
                       cached_tokens: int) -> ContinuationScore:
    """A continuation's log-likelihood: its first token from the context's log-probabilities
    (context_choice), the rest from its own forward's span (executor.SpanLogprobs over its rows but
    the last; None for a one-token continuation)."""
    first, best = context
    logprobs = [float(first[continuation[0]])]
    greedy = best == continuation[0]
    if span is not None:
        logprobs += span.logprobs.tolist()
        greedy = greedy and bool(span.greedy.all())
    return ContinuationScore(logprob=float(sum(logprobs)), is_greedy=greedy, tokens=len(continuation),
                             token_logprobs=logprobs, context_tokens=context_tokens, cached_tokens=cached_tokens)


def prompt_logprobs(token_ids: list[int], span, last_logits: torch.Tensor, token_text, cached_tokens: int) -> PromptLogprobs:
    """The prompt's per-position logprobs from its span (which covers positions S - n .. S - 1),
    and the most likely next tokens after it (as many as per position, at least the argmax)."""
    n, k = span.logprobs.shape[0], span.top_ids.shape[1]
    top = _top_scores(span.top_logprobs, span.top_ids, token_text) if k else []
    values, ids = torch.topk(torch.log_softmax(last_logits.float(), dim=-1), max(1, k))
    return PromptLogprobs(token_ids=list(token_ids), start=len(token_ids) - n, token_logprobs=span.logprobs.tolist(),
                          greedy=span.greedy.tolist(), top_k=top, cached_tokens=cached_tokens,
                          next_top_k=_top_scores(values, ids, token_text))


def _top_scores(values: torch.Tensor, ids: torch.Tensor, token_text) -> list:
    """TokenScores of top-k logprobs and ids ([k], or [n, k]: one list per row), prob = exp(logprob)
    in the tensors' dtype; each tensor turned into Python values once (a span has a row per position)."""
    def row(lps, probs, tokens):
        return [TokenScore(id=i, text=token_text(i), logprob=v, prob=p) for v, p, i in zip(lps, probs, tokens)]

    lps, probs, tokens = values.tolist(), values.exp().tolist(), ids.tolist()
    return row(lps, probs, tokens) if values.dim() == 1 else [row(*r) for r in zip(lps, probs, tokens)]


def embedding_result(pooled: torch.Tensor, dimensions: int | None, normalize: bool, pooling: str, prompt_tokens: int,
                     cached_tokens: int, truncated_tokens: int) -> EmbeddingResult:
    """A pooled [hidden] float32 vector as an embedding: Matryoshka-truncated to `dimensions` first,
    then L2-normalised where asked (so a truncated embedding is unit length too, as OpenAI's and
    vLLM's `dimensions` give it)."""
    vector = pooled[:dimensions] if dimensions else pooled
    if normalize:
        vector = torch.nn.functional.normalize(vector.double(), dim=0).float()
    return EmbeddingResult(embedding=vector.tolist(), pooling=pooling, normalized=normalize, prompt_tokens=prompt_tokens,
                           cached_tokens=cached_tokens, truncated_tokens=truncated_tokens)


def classification_result(scores: torch.Tensor, labels: tuple[str, ...], activation: str, prompt_tokens: int,
                          cached_tokens: int, truncated_tokens: int = 0) -> ClassificationResult:
    """A classifier head's raw scores ([labels] float32) with their probabilities by the checkpoint's
    problem type (softmax, sigmoid, or none: the raw score) and the top label."""
    if activation == "softmax":
        probs = torch.softmax(scores.double(), 0).float()
    elif activation == "sigmoid":
        probs = torch.sigmoid(scores.double()).float()
    else:
        probs = scores
    return ClassificationResult(logits=scores.tolist(), probs=probs.tolist(), labels=list(labels),
                                label=labels[int(torch.argmax(scores))], activation=activation, prompt_tokens=prompt_tokens,
                                cached_tokens=cached_tokens, truncated_tokens=truncated_tokens)
