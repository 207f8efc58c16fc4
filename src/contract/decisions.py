"""Decisions: the one question form both decision routes map to (OpenAI's /v1/decisions, System
One's /v1/systemone), its limits and checks, and what an answer is made of.

Standard library only: the scoring frontend (which turns each route's body into a DecisionCall)
and the engine (which renders and scores it: prefillonly.decisions) both read it.

    call = DecisionCall(input=(Message("user", "..."),), questions=(Question(...), ...))
    call.check()                          # DecisionError naming the field (`questions[2].choices`)
    DecisionCall.from_json(call.to_json()) == call
    result = DecisionResult.from_json(...)  # per question its options' probabilities, the usage
    summarize(question, probabilities)   # the winner, the expected level, the confidence

Question types: a predicate (P(true)), a choice over 2-255 typed values (True and "true" are
different values), a score over 2-10 ordered levels (lowest first; a level's number is its 0-based
position). A predicate's options are (True, False), in that order.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .errors import InvalidRequestError

PREDICATE, CHOICE, SCORE = "predicate", "choice", "score"
QUESTION_TYPES = (PREDICATE, CHOICE, SCORE)
MAX_QUESTIONS = 400  # OpenAI's limit per call
MIN_CHOICES, MAX_CHOICES = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10
MAX_PERMUTATIONS = 8  # debias: the most option orderings a question is scored under
ROLES = ("system", "developer", "user", "assistant")
# the rendering's version (prefillonly.decisions.render): a change of wording or token layout
# changes the numbers, so it gets a new name, reported with every answer
TEMPLATE_VERSION = "decisions-v1"


class DecisionError(InvalidRequestError):
    """A decision call's field is wrong: `param` names it as the caller wrote it (questions[2].choices)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


@dataclass(frozen=True)
class Message:
    role: str  # system, developer, user or assistant
    text: str


@dataclass(frozen=True)
class Option:
    value: str | bool  # a choice's typed value; a score level's label; a predicate's True / False
    description: str | None = None


@dataclass(frozen=True)
class Question:
    type: str  # PREDICATE, CHOICE or SCORE
    instructions: str
    options: tuple[Option, ...]
    name: str | None = None


@dataclass(frozen=True)
class DecisionCall:
    input: tuple[Message, ...]
    questions: tuple[Question, ...]
    permutations: int = 1  # debias: each choice and score question under up to this many option orders (render.orders)
    return_token_ids: bool = False

    def check(self, max_questions: int = MAX_QUESTIONS) -> None:
        """DecisionError naming the first bad field."""
        if not self.input or not any(m.text.strip() for m in self.input):
            raise DecisionError("the input is empty", "input")
        for i, m in enumerate(self.input):
            if m.role not in ROLES:
                raise DecisionError(f"unknown role {m.role!r}; use one of {', '.join(ROLES)}", f"input[{i}].role")
        if not self.questions:
            raise DecisionError("give at least one question", "questions")
        if len(self.questions) > max_questions:
            raise DecisionError(f"{len(self.questions)} questions, over the limit of {max_questions}", "questions")
        if not isinstance(self.permutations, int) or not 1 <= self.permutations <= MAX_PERMUTATIONS:
            raise DecisionError(f"must be a whole number from 1 to {MAX_PERMUTATIONS}, got {self.permutations!r}",
                                "debias.permutations")
        for i, q in enumerate(self.questions):
            _check_question(q, f"questions[{i}]")

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "DecisionCall":
        """The call a to_json wrote; DecisionError for a document that is not one."""
        try:
            raw = json.loads(text)
            call = cls(input=tuple(Message(**m) for m in raw["input"]),
                       questions=tuple(Question(q["type"], q["instructions"], tuple(Option(**o) for o in q["options"]),
                                                q.get("name")) for q in raw["questions"]),
                       permutations=raw.get("permutations", 1), return_token_ids=bool(raw.get("return_token_ids", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise DecisionError(f"not a decision call document ({type(e).__name__}: {e})", "text_input") from None
        return call


def _check_question(q: Question, where: str) -> None:
    if q.type not in QUESTION_TYPES:
        raise DecisionError(f"unknown question type {q.type!r}; use one of {', '.join(QUESTION_TYPES)}", f"{where}.type")
    if not isinstance(q.instructions, str) or not q.instructions.strip():
        raise DecisionError("every question needs instructions", f"{where}.instructions")
    if q.name is not None and not isinstance(q.name, str):
        raise DecisionError("must be a string", f"{where}.name")
    if q.type == PREDICATE:
        if tuple(o.value for o in q.options) != (True, False):
            raise DecisionError("a predicate's options are true and false, in that order", f"{where}.options")
        return
    what, low, high = (("choices", MIN_CHOICES, MAX_CHOICES) if q.type == CHOICE else ("levels", MIN_LEVELS, MAX_LEVELS))
    if not low <= len(q.options) <= high:
        raise DecisionError(f"{len(q.options)} {what}: a {q.type} question takes {low} to {high}", f"{where}.{what}")
    seen: dict = {}
    for j, o in enumerate(q.options):
        if not isinstance(o.value, (str, bool)) or (isinstance(o.value, str) and not o.value.strip()):
            raise DecisionError("must be a non-empty string" + (" or a boolean" if q.type == CHOICE else ""),
                                f"{where}.{what}[{j}]")
        if o.description is not None and not isinstance(o.description, str):
            raise DecisionError("must be a string", f"{where}.{what}[{j}].description")
        key = (type(o.value), o.value)  # typed: True and "true" are two values
        if key in seen:
            raise DecisionError(f"{o.value!r} is listed twice (also {what}[{seen[key]}])", f"{where}.{what}[{j}]")
        seen[key] = j


@dataclass(frozen=True)
class Answer:
    """One question's answer: its options' probabilities in the question's option order (summing to
    1; a predicate's are P(true), P(false)); with return_token_ids, the rendered prompt up to the
    answer position (of the first option order) and each option's answer tokens."""

    type: str
    name: str | None
    probabilities: tuple[float, ...]
    prompt_token_ids: tuple[int, ...] | None = None
    option_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class DecisionResult:
    answers: tuple[Answer, ...]
    input_tokens: int  # every prompt token of the call, the shared input counted once
    cached_tokens: int  # of which read from the prefix cache
    computed_tokens: int  # tokens the forwards computed (input + questions + options, less the cached)
    template: str = TEMPLATE_VERSION
    kind: str = field(default="decision", repr=False)  # the result_json's type tag

    @property
    def prompt_tokens(self) -> int:  # the wire's prompt_tokens / cached_tokens columns
        return self.input_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "DecisionResult":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: dict) -> "DecisionResult":
        answers = tuple(Answer(a["type"], a["name"], tuple(a["probabilities"]),
                               tuple(a["prompt_token_ids"]) if a.get("prompt_token_ids") is not None else None,
                               tuple(map(tuple, a["option_token_ids"])) if a.get("option_token_ids") is not None else None)
                        for a in raw["answers"])
        return cls(answers, raw["input_tokens"], raw["cached_tokens"], raw["computed_tokens"], raw.get("template", TEMPLATE_VERSION))


@dataclass(frozen=True)
class Summary:
    best: int  # the most probable option's index (the first of equals)
    expected_level: float  # sum(i * p_i): a score question's score (levels numbered from 0)
    confidence: float  # (max p - 1/k) / (1 - 1/k), clipped to [0, 1]: uniform -> 0, certain -> 1


def summarize(probabilities) -> Summary:
    """The winner, the expected level and the confidence of one question's distribution.

    Confidence is the winner's margin over a uniform guess, scaled so that a uniform distribution
    gives 0 and a certain one 1 (the formula TypeSafe's published numbers follow); it is not the
    winner's probability, which a 255-way choice can win with at 0.01."""
    p = list(probabilities)
    k = len(p)
    best = max(range(k), key=lambda i: (p[i], -i))
    confidence = min(1.0, max(0.0, (p[best] - 1 / k) / (1 - 1 / k)))
    return Summary(best, sum(i * x for i, x in enumerate(p)), confidence)
