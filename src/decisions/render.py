"""How a decision call becomes token ids (template TEMPLATE_VERSION, "decisions-v1").

The input is rendered once, as the shared prefix of every question's prompt:

    chat template(input messages, the last user message's text + "\\n\\n" + <question block>,
                  generation prompt, thinking off)

split where the question block starts: everything before it is the shared prefix (tokenized once,
kept in the prefix cache); each question's block and the template's text after it (the end of the
user turn and the assistant header) is that question's part, up to the answer position. A call
whose input does not end with a user message gets a user message of its own for the question. A
tokenizer without a chat template renders `<input texts, one per line>\\n\\n<question block>\\nAnswer:`
instead.

Question blocks (the instructions as given; options listed in the order being scored):

    predicate   Question: <instructions>\\n[yes: <description>\\nno: <description>\\n]Answer yes or no.
    choice      Question: <instructions>\\nOptions:\\n- <value>[: <description>]\\n...Answer with one option exactly as listed.
    score       Question: <instructions>\\nLevels, lowest first:\\n0: <label>[ - <description>]\\n...Answer with the level's number.

An option's answer is its text tokenized alone after the answer position: "yes" / "no" for a
predicate, the value for a choice (a boolean as true / false; every value of a question as JSON
where two would read alike, e.g. true and "true"), the level's number for a score. Where one
option's tokens begin another's, every option of that question ends with the end-of-turn token
(the special token the template closes the user turn with, else end-of-sequence), so each is
scored as a whole answer. The parts are tokenized apart (special tokens only
where the template writes them), and these ids are exactly what the model is fed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..contract.decisions import CHOICE, PREDICATE, DecisionCall, DecisionError, Question

_MARK = "\u2063QUESTION\u2063"  # where the question block goes; split out of the rendered text
PREDICATE_ANSWERS = ("yes", "no")


@dataclass(frozen=True)
class RenderedQuestion:
    question: int  # its index in the call
    order: tuple[int, ...]  # the option order it lists (indices into question.options)
    token_ids: list[int]  # its part: from the end of the shared prefix to the answer position
    option_ids: list[list[int]]  # each option's answer tokens, in the question's own option order


@dataclass(frozen=True)
class RenderedCall:
    shared_ids: list[int]
    parts: list[RenderedQuestion]  # per question, per option order (debias), question-major


class DecisionRenderer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def render(self, call: DecisionCall) -> RenderedCall:
        shared_text, after = self._frame(call)
        shared = self._encode(shared_text, special=not self.chat)
        if not shared:
            raise DecisionError("the input renders to no tokens", "input")
        end = self._end_of_answer(after)
        parts = []
        for i, q in enumerate(call.questions):
            options = self.option_ids(q, end)
            for order in orders(q, call.permutations):
                parts.append(RenderedQuestion(i, order, self._encode(question_block(q, order) + after), options))
        return RenderedCall(shared, parts)

    def _frame(self, call: DecisionCall) -> tuple[str, str]:
        """(the shared prefix's text, the text after every question block)."""
        if not self.chat:
            return "\n".join(m.text for m in call.input) + "\n\n", "\nAnswer:"
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in call.input]
        if messages[-1]["role"] == "user":
            messages[-1] = {"role": "user", "content": messages[-1]["content"] + "\n\n" + _MARK}
        else:
            messages.append({"role": "user", "content": _MARK})
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        except Exception as e:  # a template that refuses these roles (Gemma's alternation rule)
            raise DecisionError(f"the model's chat template refuses this input: {e}", "input") from None
        if text.count(_MARK) != 1:
            raise DecisionError("the model's chat template does not keep the question text as written", "input")
        before, after = text.split(_MARK)
        return before, after

    def _end_of_answer(self, after: str) -> int | None:
        """The token that ends an answer: the template's end of turn (the special token its user
        turn closes with, e.g. <|im_end|>), else the end-of-sequence token."""
        closing = self._encode(after)[:1]
        added = getattr(self.tok, "added_tokens_decoder", {})  # chat markers are added special tokens
        if closing and (closing[0] in set(getattr(self.tok, "all_special_ids", ())) or
                        getattr(added.get(closing[0]), "special", False)):
            return closing[0]
        return getattr(self.tok, "eos_token_id", None)

    def option_ids(self, q: Question, end: int | None) -> list[list[int]]:
        ids = [self._encode(text) for text in answer_texts(q)]
        if any(not x for x in ids):
            raise DecisionError("an option renders to no tokens", "questions")
        if any(a != b and b[: len(a)] == a for a in ids for b in ids) or len({tuple(x) for x in ids}) < len(ids):
            if end is None:
                raise DecisionError("one option's tokens begin another's and the model has no end-of-turn token to "
                                    "tell them apart", "questions")
            ids = [x + [end] for x in ids]
        return ids

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special))


def orders(q: Question, permutations: int) -> list[tuple[int, ...]]:
    """The option orders a question is scored under: as given; with debias (permutations k >= 2)
    rotations of the options and each rotation reversed, the rotations' shifts a set closed under
    negation (mod n). Such a set is the same whether the options come as given or reversed (the
    reversed list's rotation by s, reversed, is the original's rotation by -s), so the averaged
    probabilities do not move when a caller reverses the options. At most k orders: the largest
    such set of k // 2 shifts or fewer, spread over the options (all 2n orders for k >= 2n); a
    predicate lists no options, so it has one."""
    n = len(q.options)
    if q.type == PREDICATE or permutations <= 1:
        return [tuple(range(n))]
    out = []
    for s in _negation_closed_shifts(n, max(1, permutations // 2)):
        rotation = tuple((s + i) % n for i in range(n))
        out += [rotation, rotation[::-1]]
    return list(dict.fromkeys(out))  # two options: each rotation is the other's reverse


def _negation_closed_shifts(n: int, most: int) -> list[int]:
    """At most `most` shifts mod n, 0 among them, closed under negation: equally spaced where `most`
    divides n (or covers it), else 0, n/2 where n is even and there is room, and pairs +-d."""
    if most >= n:
        return list(range(n))
    if n % most == 0:
        return list(range(0, n, n // most))
    shifts = [0] + ([n // 2] if n % 2 == 0 and most % 2 == 0 else [])
    d = 1
    while len(shifts) + 2 <= most:
        shifts += [d, n - d]
        d += 1
    return shifts


def answer_texts(q: Question) -> list[str]:
    """Each option's answer text, in the question's option order."""
    if q.type == PREDICATE:
        return list(PREDICATE_ANSWERS)
    if q.type == CHOICE:
        plain = [v if isinstance(v, str) else json.dumps(v) for v in (o.value for o in q.options)]
        if len(set(plain)) < len(plain):  # true and "true": told apart as JSON
            return [json.dumps(o.value, ensure_ascii=False) for o in q.options]
        return plain
    return [str(i) for i in range(len(q.options))]


def question_block(q: Question, order: tuple[int, ...]) -> str:
    lines = [f"Question: {q.instructions}"]
    texts = answer_texts(q)
    if q.type == PREDICATE:
        described = [(t, o.description) for t, o in zip(PREDICATE_ANSWERS, q.options) if o.description]
        lines += [f"{t}: {d}" for t, d in described]
        lines.append("Answer yes or no.")
    elif q.type == CHOICE:
        lines.append("Options:")
        lines += [f"- {texts[j]}" + (f": {q.options[j].description}" if q.options[j].description else "") for j in order]
        lines.append("Answer with one option exactly as listed.")
    else:
        lines.append("Levels, lowest first:")
        lines += [f"{j}: {q.options[j].value}" + (f" - {q.options[j].description}" if q.options[j].description else "")
                  for j in order]
        lines.append("Answer with the level's number.")
    return "\n".join(lines)
