"""OpenAI's legacy `echo` with `logprobs` on /v1/completions: the prompt's own tokens scored.

lm-evaluation-harness's `local-completions` model computes a log-likelihood this way: it sends
context + continuation with `echo: true, logprobs: 1, max_tokens: 1` and sums
`choices[i].logprobs.token_logprobs[ctxlen:-1]`, checking greedy-ness against `top_logprobs`.
One choice per prompt, in order:

    text            the prompt's text, then the one generated token's (max_tokens 1)
    logprobs        tokens          every prompt token as text, then the generated one
                    token_logprobs  null for the first token (nothing precedes it), then each
                                    token's log-probability given the tokens before it
                    top_logprobs    null first, then {token text: logprob} of the `logprobs`
                                    most likely tokens at each position
                    text_offset     each token's character offset in `text`
"""

from __future__ import annotations

from ..contract.wire import PromptLogprobs, ScoreResult, TokenScore


def echo_choice(index: int, prompt_ids: list[int], answer: PromptLogprobs | ScoreResult, token_text, top_k: int,
                generate: bool, prompt_text: str | None) -> dict:
    """One choice. `answer`: the prompt's PromptLogprobs, or for a one-token prompt (no position
    to score) its ScoreResult, whose top_k are the next tokens."""
    tokens = [token_text(i) for i in prompt_ids]
    token_logprobs: list = [None]
    top_logprobs: list = [None]
    if isinstance(answer, PromptLogprobs):
        token_logprobs += answer.token_logprobs
        rows = answer.top_k or [[] for _ in answer.token_logprobs]
        top_logprobs += [_top(row, top_k) for row in rows]
        following = answer.next_top_k
    else:
        following = answer.top_k
    text = prompt_text if prompt_text is not None else "".join(tokens)
    if generate:  # max_tokens 1: the most likely next token follows the prompt
        tokens.append(following[0].text)
        token_logprobs.append(following[0].logprob)
        top_logprobs.append(_top(following, top_k))
        text += following[0].text
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"index": index, "text": text, "finish_reason": "length",
            "logprobs": {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}}


def _top(row: list[TokenScore], k: int) -> dict:
    top: dict = {}
    for t in row[:k]:
        top.setdefault(t.text, t.logprob)  # two ids with one text: the likelier one's
    return top
