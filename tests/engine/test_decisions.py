"""Decisions (Engine.decide, the `decisions` kind): every option's probability equals transformers'
float32 log-likelihood of that option's whole answer after the rendered prompt, renormalised over
the question's options (1e-4), on the default model and on random-weight Llama, Qwen3, Gemma 3
and Phi-3 checkpoints; cached and cold calls, a question alone and among many, and debiased
orders, all against the same reference; the call's checks name the field."""

from __future__ import annotations

import math
import random
import shutil
import zlib

import pytest
import torch

from prefillonly.contract.decisions import (CHOICE, PREDICATE, SCORE, DecisionCall, DecisionError, Message, Option,
                                            Question, summarize)
from prefillonly.decisions.render import DecisionRenderer, orders
from tests.conftest import FAMILY_CONFIGS, make_random_model
from tests.reference import load_hf

TOL = 1e-4
WORDS = ("the parcel came late and the box was torn but the blender inside works well and the support team "
         "answered within an hour offering a partial refund for the delay which I accepted").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def questions(rng: random.Random) -> list[Question]:
    """One of each type, with multi-token values, a boolean beside its string, options that begin
    one another, and descriptions."""
    return [
        Question(PREDICATE, "Was the delivery on time?", (Option(True, "it came on the promised day"), Option(False)), "on_time"),
        Question(CHOICE, "Which department should handle this?",
                 (Option("customer support", "complaints"), Option("logistics and shipping"), Option("billing"),
                  Option(True), Option("true")), "dept"),
        Question(SCORE, "How satisfied is the customer?",
                 tuple(Option(x) for x in ("very unhappy", "unhappy", "neutral", "happy", "very happy")), None),
        Question(CHOICE, "Would they buy again?", (Option("Yes"), Option("Yes, definitely"), Option("No")), "again"),
        Question(CHOICE, _text(rng, rng.randint(3, 9)) + "?", tuple(Option(t) for t in _distinct_texts(rng, 3)), "random"),
    ]


def _distinct_texts(rng: random.Random, n: int) -> list[str]:
    """n different texts of 1-3 words (a choice lists each value once: the call refuses a repeat)."""
    texts: list[str] = []
    while len(texts) < n:
        text = _text(rng, rng.randint(1, 3))
        if text not in texts:
            texts.append(text)
    return texts


def reference_probabilities(model, prompt_ids: list[int], option_ids: list[list[int]]) -> list[float]:
    """transformers' float32 forward over prompt + each option: the options' summed token
    log-probabilities (in float64 from the float32 logits), renormalised."""
    lls = []
    for option in option_ids:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + option]), use_cache=False).logits[0].double()
        logprobs = logits.log_softmax(-1)
        start = len(prompt_ids) - 1
        lls.append(sum(float(logprobs[start + i, t]) for i, t in enumerate(option)))
    top = max(lls)
    e = [math.exp(x - top) for x in lls]
    return [x / sum(e) for x in e]


def check_against_reference(model, result, n_questions: int) -> None:
    assert len(result.answers) == n_questions
    for a in result.answers:
        want = reference_probabilities(model, list(a.prompt_token_ids), [list(o) for o in a.option_token_ids])
        assert abs(sum(a.probabilities) - 1) < 1e-9
        assert max(abs(x - y) for x, y in zip(a.probabilities, want)) < TOL, (a.name, a.probabilities, want)


@pytest.fixture(scope="module")
def default_hf(default_model_path):
    return load_hf(default_model_path, torch.float32)


def test_default_model_against_transformers_cold_and_cached(default_engine, default_hf):
    rng = random.Random(11)
    qs = questions(rng)
    text = _text(rng, 57)
    cold = default_engine.decide(text, qs, return_token_ids=True, user="decisions-cold-warm")
    check_against_reference(default_hf, cold, len(qs))
    warm = default_engine.decide(text, qs, return_token_ids=True, user="decisions-cold-warm")
    assert warm.cached_tokens > 0 and cold.cached_tokens == 0
    assert warm.computed_tokens == warm.input_tokens - warm.cached_tokens
    for a, b in zip(cold.answers, warm.answers):
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities)) < 1e-5
    # answers keep type, name and order; "Yes" and "Yes, definitely" are told apart by the end token
    assert [a.name for a in cold.answers] == [q.name for q in qs] and [a.type for a in cold.answers] == [q.type for q in qs]
    again = cold.answers[3].option_token_ids
    assert again[0][-1] == again[1][-1] and again[1][: len(again[0]) - 1] == again[0][:-1]


def test_numbers_do_not_depend_on_return_token_ids_or_the_other_questions(default_engine):
    rng = random.Random(5)
    qs = questions(rng)
    many = qs + [Question(PREDICATE, _text(rng, rng.randint(2, 12)) + "?", (Option(True), Option(False))) for _ in range(395)]
    text = _text(rng, 41)
    alone = [default_engine.decide(text, [q], user="alone").answers[0] for q in qs]
    among = default_engine.decide(text, many, return_token_ids=True, user="among").answers
    assert len(among) == len(many)
    for a, b in zip(alone, among):
        assert a.prompt_token_ids is None
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities)) < 1e-5


def test_debias_averages_the_option_orders(default_engine, default_hf):
    """permutations=k: each choice and score question scored under its orders (render.orders), the
    distributions averaged: equal to the average of transformers' answers to each order's prompt."""
    rng = random.Random(3)
    qs = questions(rng)[1:3]
    call = DecisionCall((Message("user", _text(rng, 30)),), tuple(qs), permutations=4)
    rendered = DecisionRenderer(default_engine.encoder.tokenizer).render(call)
    got = default_engine.decide(call.input, qs, permutations=4).answers
    for i, q in enumerate(qs):
        parts = [p for p in rendered.parts if p.question == i]
        assert len(parts) == len(orders(q, 4)) >= 2 and len({p.order for p in parts}) == len(parts)
        dists = [reference_probabilities(default_hf, rendered.shared_ids + p.token_ids, p.option_ids) for p in parts]
        want = [sum(d[j] for d in dists) / len(dists) for j in range(len(q.options))]
        assert max(abs(x - y) for x, y in zip(got[i].probabilities, want)) < TOL


def _reversed(q: Question) -> Question:
    return Question(q.type, q.instructions, q.options[::-1], q.name)


@pytest.mark.parametrize("n", range(2, 11))
def test_the_debias_orders_are_the_same_set_for_the_options_reversed(n):
    """Rotations and their reverses, shifts closed under negation: listing the options backwards
    gives the same orders of the same values; at most k of them, and every order once."""
    q = Question(CHOICE, "Which?", tuple(Option(f"v{i}") for i in range(n)))
    for k in range(2, 2 * n + 2):
        got = orders(q, k)
        listed = {tuple(q.options[j].value for j in o) for o in got}
        backwards = _reversed(q)
        assert listed == {tuple(backwards.options[j].value for j in o) for o in orders(backwards, k)}, k
        assert 2 <= len(got) <= k and len(set(got)) == len(got), (k, got)
    assert len(orders(q, 2 * n)) == (2 * n if n > 2 else 2)  # every rotation and its reverse


def test_debiased_answers_do_not_move_when_the_options_are_reversed(default_engine):
    """The flip the bench measures, here exactly: the averaged probabilities of each value equal
    whether the options come as given or reversed (float32 rounding apart), on every choice question
    of a call (a score's levels reversed are another question: its numbers name other levels)."""
    rng = random.Random(4)
    qs = [q for q in questions(rng) + questions(rng) if q.type == CHOICE]
    text = _text(rng, 40)
    given = default_engine.decide(text, qs, permutations=4).answers
    backwards = default_engine.decide(text, [_reversed(q) for q in qs], permutations=4).answers
    for a, b, q in zip(given, backwards, qs):
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities[::-1])) < 1e-5, q


FAMILIES = ("llama_gqa_llama3rope_untied", "qwen3_qknorm_untied", "gemma3_window_two_ropes", "phi3_fused_window")


@pytest.mark.heavy
@pytest.mark.parametrize("family", FAMILIES)
def test_families_against_transformers(family, tmp_path, default_model_path):
    """Random weights with the default model's tokenizer (its vocabulary), so the same rendering
    runs on every family's layers."""
    from prefillonly import Engine, EngineConfig

    cls, kwargs = FAMILY_CONFIGS[family]
    make_random_model(cls, dict(kwargs, vocab_size=49152)).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src := default_model_path + "/" + name) and __import__("os").path.exists(src):
            shutil.copy(src, tmp_path)
    rng = random.Random(zlib.crc32(family.encode()))  # str hash() changes with every interpreter: not a seed
    qs = questions(rng)
    with Engine(EngineConfig(model=str(tmp_path), dtype="float32", threads=2)) as engine:
        result = engine.decide(_text(rng, 23), qs, return_token_ids=True)
    check_against_reference(load_hf(str(tmp_path), torch.float32), result, len(qs))


def test_summary_confidence_and_expected_level():
    s = summarize([0.25, 0.25, 0.25, 0.25])
    assert s.confidence == 0 and s.expected_level == 1.5 and s.best == 0
    s = summarize([0.0, 0.0, 1.0])
    assert s.confidence == 1 and s.expected_level == 2 and s.best == 2
    assert summarize([0.1, 0.6, 0.3]).confidence == pytest.approx((0.6 - 1 / 3) / (2 / 3))


def _call(questions, **kw) -> DecisionCall:
    return DecisionCall((Message("user", "some input"),), tuple(questions), **kw)


_YES_NO = (Option(True), Option(False))


@pytest.mark.parametrize("call,param", [
    (_call([]), "questions"),
    (_call([Question(PREDICATE, "q?", _YES_NO)] * 401), "questions"),
    (_call([Question("ranking", "q?", _YES_NO)]), "questions[0].type"),
    (_call([Question(PREDICATE, "  ", _YES_NO)]), "questions[0].instructions"),
    (_call([Question(PREDICATE, "q?", _YES_NO), Question(CHOICE, "q?", (Option("a"),))]), "questions[1].choices"),
    (_call([Question(CHOICE, "q?", tuple(Option(str(i)) for i in range(256)))]), "questions[0].choices"),
    (_call([Question(CHOICE, "q?", (Option("a"), Option("b"), Option("a")))]), "questions[0].choices[2]"),
    (_call([Question(SCORE, "q?", (Option("low"),))]), "questions[0].levels"),
    (_call([Question(SCORE, "q?", tuple(Option(str(i)) for i in range(11)))]), "questions[0].levels"),
    (_call([Question(PREDICATE, "q?", _YES_NO)], permutations=0), "debias.permutations"),
    (DecisionCall((), (Question(PREDICATE, "q?", _YES_NO),)), "input"),
    (DecisionCall((Message("robot", "x"),), (Question(PREDICATE, "q?", _YES_NO),)), "input[0].role"),
])
def test_bad_calls_name_the_field(call, param):
    with pytest.raises(DecisionError) as e:
        call.check()
    assert e.value.param == param and str(e.value).startswith(param)


def test_typed_values_are_distinct_and_the_json_round_trips():
    call = _call([Question(CHOICE, "q?", (Option(True), Option("true"), Option("x", "an x")), "n")], permutations=2)
    call.check()  # True and "true" are two values
    assert DecisionCall.from_json(call.to_json()) == call
    with pytest.raises(DecisionError, match="text_input"):
        DecisionCall.from_json(b"{not json")


def test_engine_refuses_a_call_over_its_token_limit(default_engine):
    from prefillonly import tasks

    ctx = tasks.SubmitContext(default_engine.encoder, default_engine.spec, default_engine.max_input_len, max_decision_tokens=40)
    call = _call([Question(PREDICATE, "Is this a long enough question to count?", _YES_NO)] * 3)
    with pytest.raises(DecisionError, match="max_decision_tokens") as e:
        tasks.kind_named("decisions").build(ctx, call)
    assert e.value.param == "questions"


def test_engine_refuses_an_input_too_long(default_engine):
    from prefillonly import PromptTooLongError

    limit = default_engine.max_input_len
    with pytest.raises(PromptTooLongError, match=str(limit)):
        default_engine.decide("word " * (limit + 10), [Question(PREDICATE, "q?", _YES_NO)])


def test_the_triton_protocol_carries_a_decision_call(default_engine):
    """The wire: task `decide`, text_input one call's JSON, result_json its DecisionResult."""
    import json

    import numpy as np

    from prefillonly.contract.decisions import DecisionResult
    from prefillonly.serving.model.protocol import parse_request, results_to_outputs, submit_call

    rng = random.Random(2)
    qs = questions(rng)[:3]
    call = DecisionCall((Message("system", "You judge orders."), Message("user", _text(rng, 20))), tuple(qs))
    wire = parse_request({"text_input": np.array([call.to_json().encode()], dtype=object),
                          "task": np.array([b"decide"], dtype=object)})
    assert wire.kind == "decisions"
    out = results_to_outputs(wire, [f.result(timeout=120) for f in submit_call(default_engine, wire)])
    got = DecisionResult.from_json(out["result_json"][0])
    want = default_engine.decide(call.input, qs)
    assert out["prompt_tokens"].tolist() == [got.input_tokens] and json.loads(out["result_json"][0])["template"] == "decisions-v1"
    for a, b in zip(got.answers, want.answers):
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities)) < 1e-5
    with pytest.raises(DecisionError, match="questions"):
        submit_call(default_engine, parse_request({"text_input": np.array([DecisionCall(call.input, ()).to_json().encode()],
                                                                          dtype=object), "task": np.array([b"decide"], dtype=object)}))
