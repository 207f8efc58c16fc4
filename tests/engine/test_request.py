"""A request as data: the engine's Request record and the argument checks that build it, without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefillonly import InvalidRequestError, PromptTooLongError
from prefillonly.contract.limits import RequestLimits
from prefillonly.prompts import PromptEncoder
from prefillonly.tasks import SubmitContext, kind_named
from prefillonly.request import (Request, check_cache_prefix_len, check_deadline, check_item_template, check_length,
                                 check_namespace, check_priority, check_top_k)


LIMITS = RequestLimits(max_prompt_bytes=100, max_prompts_per_request=4, max_items=2, max_allowed_tokens=4, max_token_bytes=10)
# a model-free context: token ids only, a 50-token vocabulary, one RoPE regime
CONTEXT = SubmitContext(PromptEncoder(None, vocab_size=50, limits=LIMITS),
                        SimpleNamespace(vocab_size=50, rope_long=lambda n: False, rope_switch_length=0), max_input_len=64)


def test_request_counts_items_and_runs_multi_item_alone():
    """The kind declares the step shape: a multi-item request runs alone, a plain one shares steps."""
    plain = kind_named("score").build(CONTEXT, [1, 2, 3], allowed=[5])
    items = kind_named("items").build(CONTEXT, [1, 2, 3], items=[[7], [8, 9]], allowed=[5])
    assert plain.prompt_tokens == 3 and plain.cache_tokens == 3 and plain.item_tokens is None and not plain.runs_alone
    assert items.prompt_tokens == 6 and items.cache_tokens == 3 and items.item_tokens == [1, 2] and items.runs_alone


def test_request_starts_once_unless_cancelled():
    """start() is the scheduler's pick: the Future runs (with its start time), or the request was
    cancelled while it waited and is dropped."""
    r = Request(kind_named("score"), [1], [5])
    assert r.future.started_at is None and r.start() and r.future.running() and r.future.started_at is not None
    cancelled = Request(kind_named("score"), [1], [5])
    assert cancelled.future.cancel() and not cancelled.start()


@pytest.mark.parametrize("value,ok", [(0, True), (7, True), (100, True), (101, False), (-1, False), (True, False), (2.0, False), ("3", False)])
def test_check_top_k(value, ok):
    if ok:
        assert check_top_k(value, 100) == value
    else:
        with pytest.raises(InvalidRequestError, match="top_k"):
            check_top_k(value, 100)


def test_check_cache_prefix_len():
    assert check_cache_prefix_len(None, 40) == 40  # default: the whole prompt
    assert check_cache_prefix_len(0, 40) == 0 and check_cache_prefix_len(40, 40) == 40
    for bad in (41, -1, 1.5, True, "10"):
        with pytest.raises(InvalidRequestError, match="cache_prefix_len"):
            check_cache_prefix_len(bad, 40)


def test_check_namespace_user_and_explicit():
    assert check_namespace(None, None) is None
    assert check_namespace(None, "alice") == "alice"
    assert check_namespace("tenant", "alice") == "tenant"
    for ns, user, name in ((3, None, "cache_namespace"), (None, b"bob", "user")):
        with pytest.raises(InvalidRequestError, match=name):
            check_namespace(ns, user)


def test_check_length_priority_deadline():
    check_length(10, 10)
    with pytest.raises(PromptTooLongError, match="11 tokens, over the max input length 10"):
        check_length(11, 10)
    assert check_priority(-3) == -3
    for bad in (1.0, True, "1", None):
        with pytest.raises(InvalidRequestError, match="priority"):
            check_priority(bad)
    assert check_deadline(None) is None and check_deadline(2) == 2.0
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(InvalidRequestError, match="deadline_s"):
            check_deadline(bad)


def test_check_item_template_is_literal():
    check_item_template("Post: {item}\nAnswer:")
    with pytest.raises(InvalidRequestError, match="has no {item}"):
        check_item_template("Post: {x}")
    with pytest.raises(InvalidRequestError, match="must be a string"):
        check_item_template(7)


def test_items_encoded_without_a_model():
    limits = RequestLimits(max_prompt_bytes=100, max_prompts_per_request=4, max_items=2, max_allowed_tokens=4, max_token_bytes=10)
    encoder = PromptEncoder(None, vocab_size=50, limits=limits)  # no tokenizer: token ids only
    assert encoder.encode_items([[1, 2], [3]], None) == [[1, 2], [3]]
    with pytest.raises(InvalidRequestError, match="too many items: 3"):
        encoder.encode_items([[1], [2], [3]], None)
    with pytest.raises(InvalidRequestError, match="items is empty"):
        encoder.encode_items([], None)
    with pytest.raises(InvalidRequestError, match="items must be a list"):
        encoder.encode_items("one item", None)
    with pytest.raises(InvalidRequestError):
        encoder.encode_items([[1], [99]], None)  # outside the vocabulary
