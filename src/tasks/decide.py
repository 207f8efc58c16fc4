"""The `decisions` kind (wire task `decide`): typed questions about one input, every question
over one shared prefill, each option scored exactly (contract/decisions.py: the question form;
decisions/render.py: the token layout).

One engine request shaped as a tree: the rendered input is the shared prompt (computed once, kept
in the prefix cache), each question's part (per option order, with debias) an item over it, and
each option's answer tokens a continuation over its question (tokens after the first as a logprob
span; the first read from the question's last row). A question whose options are all one token
has no continuations: its last row is all it reads. An option's probability is its whole answer's
likelihood renormalised over the question's options, averaged over the option orders scored.
"""

from __future__ import annotations

import math

from ..contract.decisions import Answer, DecisionCall, DecisionError, DecisionResult
from ..contract.errors import PromptTooLongError
from ..contract.wire import DECIDE
from ..request import Request
from .base import RequestKind, RowOutput, SubmitContext


class DecisionsKind(RequestKind):
    name = "decisions"
    wire_task = DECIDE
    options = ("priority",)

    def build(self, ctx: SubmitContext, prompt) -> Request:
        from ..decisions.render import DecisionRenderer

        call = prompt if isinstance(prompt, DecisionCall) else DecisionCall.from_json(_text(prompt))
        call.check()
        if ctx.encoder.tokenizer is None:
            raise DecisionError("this model has no tokenizer: decisions need one to render the questions", "model")
        rendered = DecisionRenderer(ctx.encoder.tokenizer).render(call)
        shared = rendered.shared_ids
        parts = [p.token_ids for p in rendered.parts]
        trees = [p.option_ids if any(len(o) > 1 for o in p.option_ids) else [] for p in rendered.parts]
        longest = len(shared) + max(len(p.token_ids) + max(map(len, p.option_ids)) for p in rendered.parts)
        if longest > ctx.max_input_len:
            raise PromptTooLongError(f"the input with its longest question and option is {longest} tokens, over this "
                                     f"model's limit of {ctx.max_input_len}")
        own = sum(map(len, parts)) + sum(len(o) for t in trees for o in t)
        if own > ctx.max_decision_tokens:
            raise DecisionError(f"the questions and their options come to {own:,} tokens, over the limit of "
                                f"{ctx.max_decision_tokens:,} for one call (max_decision_tokens): split the questions over "
                                "several calls", "questions")
        return Request(self, shared, [], 0, item_ids=parts, item_continuations=trees if any(trees) else None,
                       task_state=(call, rendered))

    def item_result(self, request: Request, index: int, context, row: RowOutput, token_text) -> list[float]:
        """One question part's options' log-likelihoods, in the question's option order."""
        import torch

        options = request.task_state[1].parts[index].option_ids
        first = torch.log_softmax(row.logits.float(), dim=-1)
        spans = row.span if isinstance(row.span, list) else [None] * len(options)
        return [float(first[o[0]]) + (float(s.logprobs.double().sum()) if s is not None else 0.0) for o, s in zip(options, spans)]

    def items_done(self, request: Request, results: list, cached_tokens: int) -> DecisionResult:
        call, rendered = request.task_state
        per_question: list[list[list[float]]] = [[] for _ in call.questions]
        for part, lls in zip(rendered.parts, results):
            per_question[part.question].append(_softmax(lls))
        answers = []
        for i, (q, dists) in enumerate(zip(call.questions, per_question)):
            probs = tuple(sum(d[j] for d in dists) / len(dists) for j in range(len(q.options)))
            first = next(p for p in rendered.parts if p.question == i)
            answers.append(Answer(q.type, q.name, probs,
                                  tuple(rendered.shared_ids + first.token_ids) if call.return_token_ids else None,
                                  tuple(map(tuple, first.option_ids)) if call.return_token_ids else None))
        total = request.prompt_tokens
        return DecisionResult(tuple(answers), input_tokens=total, cached_tokens=cached_tokens,
                              computed_tokens=total - cached_tokens)


def _softmax(lls: list[float]) -> list[float]:
    top = max(lls)
    e = [math.exp(x - top) for x in lls]
    s = sum(e)
    return [x / s for x in e]


def _text(prompt) -> str:
    if isinstance(prompt, (bytes, bytearray)):
        try:
            return bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecisionError(f"not UTF-8 ({e})", "text_input") from None
    if isinstance(prompt, str):
        return prompt
    raise DecisionError(f"a decision call is a DecisionCall or its JSON, got {type(prompt).__name__}", "text_input")
