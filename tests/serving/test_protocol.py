"""The Triton model's wire format (prefillonly.serving.model.protocol), without a server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefillonly import InvalidRequestError
from prefillonly.contract.wire import ScoreResult, TokenScore
from prefillonly.serving.model.protocol import ScoreCall, parse_request, results_to_outputs


def b(*texts):
    return np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=np.object_)


def test_text_prompts_allowed_strings_and_ids_and_options():
    call = parse_request({"text_input": b("a", "b"), "allowed_tokens": b(" Yes"), "allowed_token_ids": np.array([7]),
                          "top_k": np.array([3]), "cache_prefix_len": np.array([1]), "priority": np.array([2]),
                          "apply_chat_template": np.array([False]), "user": b("u1")})
    assert call.prompts == ["a", "b"] and call.allowed == [" Yes", 7] and call.items is None
    assert call.options == {"top_k": 3, "cache_prefix_len": 1, "priority": 2, "apply_chat_template": False, "user": "u1"}


def test_ids_and_items():
    call = parse_request({"input_ids": np.array([1, 2, 3]), "allowed_token_ids": np.array([4, 5]),
                          "items": b("x", "y"), "item_template": b("\nPost: {item}")})
    assert call.prompts == [[1, 2, 3]] and call.items == ["x", "y"] and call.options["item_template"] == "\nPost: {item}"


def test_items_as_token_ids():
    call = parse_request({"input_ids": np.array([1, 2]), "allowed_token_ids": np.array([4]),
                          "item_ids": np.array([7, 8, 9, 10, 11, 12]), "item_lengths": np.array([1, 3, 2])})
    assert call.items == [[7], [8, 9, 10], [11, 12]] and "item_template" not in call.options


ONE = {"input_ids": np.array([1]), "allowed_token_ids": np.array([4])}


@pytest.mark.parametrize("tensors,match", [
    (dict(ONE, item_ids=np.array([7, 8])), "item_ids and item_lengths go together"),
    (dict(ONE, item_lengths=np.array([2])), "item_ids and item_lengths go together"),
    (dict(ONE, item_ids=np.array([7, 8]), item_lengths=np.array([1])), "add up to 1 but item_ids has 2"),
    (dict(ONE, item_ids=np.array([7]), item_lengths=np.array([1, 0])), "item 1 is not"),
    (dict(ONE, item_ids=np.array([7.5]), item_lengths=np.array([1])), "item_ids must be integers"),
    (dict(ONE, item_ids=np.array([7]), item_lengths=np.array([1]), items=b("x")), "not both"),
    (dict(ONE, item_ids=np.array([7]), item_lengths=np.array([1]), item_template=b("{item}")), "applies to text items"),
])
def test_bad_item_ids_name_the_problem(tensors, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_request(tensors)


def test_item_ids_count_against_max_items():
    from prefillonly.contract.limits import RequestLimits

    limits = RequestLimits(max_prompt_bytes=100, max_prompts_per_request=4, max_items=2, max_allowed_tokens=4, max_token_bytes=8)
    with pytest.raises(InvalidRequestError, match="max_items"):
        parse_request(dict(ONE, item_ids=np.array([1, 2, 3]), item_lengths=np.array([1, 1, 1])), limits)


@pytest.mark.parametrize("tensors,match", [
    ({"allowed_tokens": b(" Yes")}, "missing prompt"),
    ({"text_input": b("a"), "input_ids": np.array([1]), "allowed_tokens": b(" Yes")}, "exactly one of text_input"),
    ({"text_input": b("a")}, "missing allowed tokens"),
    ({"text_input": b(b"caf\xe9"), "allowed_tokens": b(" Yes")}, "text_input is not valid UTF-8: byte 0xe9 at offset 3"),
    ({"input_ids": np.array([1.5]), "allowed_tokens": b(" Yes")}, "input_ids must be integers"),
    ({"text_input": b("a"), "allowed_tokens": b(" Yes"), "top_k": np.array([1, 2])}, "top_k must hold exactly one value"),
    ({"text_input": b("a", "b"), "allowed_tokens": b(" Yes"), "items": b("x")}, "items need exactly one shared prompt"),
    ({"text_input": b("a"), "allowed_tokens": b(" Yes"), "item_template": b("{item}")}, "item_template given without items"),
    ({"text_input": b("a"), "allowed_tokens": b(" Yes"), "temperature": np.array([1.0])}, "unknown input"),
])
def test_bad_requests_name_the_problem(tensors, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_request(tensors)


def test_outputs_one_element_per_result_row_major_allowed():
    def result(p_yes):
        toks = [TokenScore(9, " Yes", -1.0, p_yes), TokenScore(8, " No", -2.0, 1 - p_yes)]
        return ScoreResult(tokens=toks, chosen=max(toks, key=lambda t: t.prob), prompt_tokens=5, cached_tokens=2)

    out = results_to_outputs(ScoreCall(["q"], [" Yes", " No"]), [result(0.7), result(0.2)])
    assert list(out["chosen_token"]) == [b" Yes", b" No"] and list(out["chosen_token_id"]) == [9, 8]
    assert out["allowed_probs"].tolist() == pytest.approx([0.7, 0.3, 0.2, 0.8])
    assert json.loads(out["result_json"][1])["chosen"]["text"] == " No"
    assert out["prompt_tokens"].tolist() == [5, 5] and out["cached_tokens"].tolist() == [2, 2]


def test_the_loglikelihood_and_prompt_logprobs_tasks():
    call = parse_request({"text_input": b("Question: ok?\nAnswer:"), "items": b(" yes", " no"), "task": b("loglikelihood"),
                          "priority": np.array([1])})
    assert call.kind == "loglikelihood" and call.items == [" yes", " no"] and call.allowed == [] and call.options == {"priority": 1}
    call = parse_request({"input_ids": np.array([1, 2, 3]), "task": b("prompt_logprobs"), "logprobs_start": np.array([2]),
                          "top_k": np.array([5])})
    assert call.kind == "prompt_logprobs" and call.options == {"start": 2, "top_k": 5}
    assert parse_request({"text_input": b("a"), "allowed_tokens": b(" Yes")}).kind == "score"
    assert parse_request({"text_input": b("a"), "allowed_tokens": b(" Yes"), "items": b("x", "y")}).kind == "items"


def test_the_pooled_tasks_and_their_options():
    call = parse_request({"text_input": b("a", "b"), "task": b("embed"), "dimensions": np.array([8]),
                          "normalize": np.array([False]), "prompt_name": b("query"), "truncate": b("left")})
    assert call.kind == "embed" and call.prompts == ["a", "b"] and call.allowed == []
    assert call.options == {"dimensions": 8, "normalize": False, "prompt_name": "query", "truncate": "left"}
    call = parse_request({"text_input": b("a"), "task": b("classify"), "truncate": b("right")})
    assert call.kind == "classify" and call.options == {"truncate": "right"}
    call = parse_request({"text_input": b("prompt"), "items": b("r1", "r2"), "task": b("classify"), "priority": np.array([1])})
    assert call.kind == "classify_items" and call.items == ["r1", "r2"] and call.options == {"priority": 1}


@pytest.mark.parametrize("tensors,match", [
    ({"text_input": b("a"), "task": b("generate")}, "unknown task 'generate'; choose one of score, loglikelihood, prompt_logprobs"),
    ({"text_input": b("a"), "task": b("loglikelihood")}, "needs the continuations as items"),
    ({"text_input": b("a"), "items": b("x"), "task": b("loglikelihood"), "allowed_tokens": b(" Yes")}, "allowed tokens apply to task 'score'"),
    ({"text_input": b("a"), "items": b("x"), "task": b("loglikelihood"), "top_k": np.array([2])}, "top_k does not apply to task 'loglikelihood'"),
    ({"text_input": b("a"), "items": b("x"), "task": b("prompt_logprobs")}, "takes prompts, not items"),
    ({"text_input": b("a"), "allowed_tokens": b(" Yes"), "logprobs_start": np.array([2])}, "logprobs_start does not apply to task 'score'"),
    ({"text_input": b("a"), "items": b("x"), "task": b("loglikelihood"), "item_template": b("Q {item}")},
     "item_template does not apply to task 'loglikelihood'"),
    ({"text_input": b("a"), "allowed_tokens": b(" Yes"), "normalize": np.array([True])}, "normalize does not apply to task 'score'"),
    ({"text_input": b("a"), "task": b("classify"), "dimensions": np.array([4])}, "dimensions does not apply to task 'classify'"),
    ({"text_input": b("a"), "items": b("x"), "task": b("classify"), "truncate": b("right")},
     "truncate does not apply to task 'classify'"),
    ({"text_input": b("a"), "task": b("embed"), "normalize": np.array([1])}, "normalize must be true or false"),
    ({"text_input": b("a"), "task": b("embed"), "dimensions": b("8")}, "dimensions must be an integer"),
])
def test_bad_task_requests_name_the_problem(tensors, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_request(tensors)


def test_task_outputs_are_result_json_and_token_counts():
    from prefillonly.contract.wire import ContinuationScore, PromptLogprobs
    from prefillonly.contract.wire import decode_answers

    scores = [ContinuationScore(-1.5, True, 2, [-1.0, -0.5], context_tokens=7, cached_tokens=4),
              ContinuationScore(-3.0, False, 1, [-3.0], context_tokens=7, cached_tokens=4)]
    out = results_to_outputs(ScoreCall(["q"], [], kind="loglikelihood"), scores)
    assert set(out) == {"result_json", "prompt_tokens", "cached_tokens"}
    assert out["prompt_tokens"].tolist() == [9, 8] and out["cached_tokens"].tolist() == [4, 4]
    assert decode_answers(list(out["result_json"])) == scores
    span = PromptLogprobs([5, 6, 7], 1, [-0.25, -2.0], [True, False], [[TokenScore(6, "x", -0.25, 0.78)], [TokenScore(1, "y", -0.1, 0.9)]])
    assert decode_answers(list(results_to_outputs(ScoreCall(["q"], [], kind="prompt_logprobs"), [span])["result_json"])) == [span]


@pytest.mark.parametrize("head,kind", [("lm", "score"), ("embedding", "embed"), ("classifier", "classify")])
def test_the_liveness_probe_runs_as_a_task_the_checkpoint_answers(head, kind):
    """The probe (and the model's warm-up) is a 1-token score; on an embedding model or a classifier
    the engine would refuse that before its worker, proving nothing: it runs as embed or classify."""
    from types import SimpleNamespace

    from prefillonly.contract.wire import LIVENESS_USER
    from prefillonly.serving.model.protocol import submit_call

    submitted = []
    engine = SimpleNamespace(spec=SimpleNamespace(head=head), progressing_step=lambda: None,
                             submit_task=lambda name, prompt, **kw: submitted.append((name, prompt, kw)))
    call = parse_request({"input_ids": np.array([0]), "allowed_token_ids": np.array([0]), "cache_prefix_len": np.array([0]),
                          "priority": np.array([9]), "user": b(LIVENESS_USER)})
    submit_call(engine, call)
    options = {"cache_prefix_len": 0, "priority": 9, "user": LIVENESS_USER, "limits_checked": False}
    assert submitted == [(kind, [0], dict(options, allowed=[0]) if kind == "score" else options)]
    assert call.kind == kind  # its answer is built as that kind's
    client = parse_request({"input_ids": np.array([0]), "allowed_token_ids": np.array([0])})
    submit_call(engine, client)
    assert client.kind == "score" and submitted[-1][0] == "score"  # a client's request is never changed
