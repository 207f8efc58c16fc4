"""Request size limits (prefillonly.contract.limits): checked before any expensive work, each refused as
invalid_request naming the limit; the derived byte bound never refuses a prompt that would fit."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from prefillonly import EngineConfig
from prefillonly.contract.errors import ConfigError, InvalidRequestError, PromptTooLongError
from prefillonly.contract.limits import max_token_bytes
from prefillonly.serving.model.protocol import ScoreCall, parse_request, submit_call


def _random_texts(seed: int):
    rng = random.Random(seed)
    alphabets = ["abcdefghij ", " ", "\n\t ", "0123456789", "éàü中文日本語🙂", "{}()[];=<>/*-+", "ab"]
    for _ in range(40):
        chars = rng.choice(alphabets)
        yield "".join(rng.choice(chars) for _ in range(rng.randint(1, 3000)))
    yield " " * 5000  # runs of spaces are where single tokens are longest
    yield "a" * 5000
    yield "".join(chr(rng.randint(32, 0x2FFFF)) for _ in range(2000)).encode("utf-8", "ignore").decode("utf-8", "ignore")


def test_byte_bound_holds_for_every_text(default_engine):
    """The derived max_prompt_bytes is max_input_len x max_token_bytes: right only if no text
    takes more than max_token_bytes bytes per token. Checked on varied random texts (fresh seed)."""
    tok = default_engine.encoder.tokenizer
    bound = max_token_bytes(tok)
    assert bound == default_engine.limits.max_token_bytes > 0
    assert default_engine.limits.max_prompt_bytes == default_engine.max_input_len * bound
    for text in _random_texts(random.randrange(1 << 30)):
        n_tokens = len(tok.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= n_tokens * bound, (text[:50], n_tokens)


def test_oversized_text_is_refused_before_tokenizing(default_engine):
    limit = default_engine.limits.max_prompt_bytes
    huge = "hello world " * (limit // 12 * 20)  # ~20x the bound: tokenizing it would take seconds
    for prompt in (huge, huge.encode()):
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequestError, match=rf"over the limit of {limit:,} bytes \(max_prompt_bytes\)"):
            default_engine.submit(prompt, [" Yes"])
        assert time.perf_counter() - t0 < 0.5
    with pytest.raises(InvalidRequestError, match=r"item 1 is .* \(max_prompt_bytes\)"):
        default_engine.submit_items("Profile", ["ok", huge], [" Yes"], item_template="Post: {item}")
    with pytest.raises(InvalidRequestError, match="longer than any token"):
        default_engine.submit("Hi", ["x" * 10_000_000])
    # under the byte bound but over the token limit: tokenized, then refused by its length
    with pytest.raises(PromptTooLongError):
        default_engine.submit("hello world " * (limit // 24), [" Yes"])


def test_allowed_tokens_and_items_are_counted(default_engine):
    with pytest.raises(InvalidRequestError, match=r"too many allowed tokens: 257, the limit is 256 per request \(max_allowed_tokens\)"):
        default_engine.submit("Hi", list(range(257)))
    n = default_engine.config.max_items + 1
    with pytest.raises(InvalidRequestError, match=rf"too many items: {n}.*\(max_items\)"):
        default_engine.submit_items("Hi", ["x"] * n, [" Yes"])


def test_item_template_is_literal_text(default_engine):
    """Only {item} is replaced: no format specs, fields or escapes (str.format ran them)."""
    tok = default_engine.encoder.tokenizer
    template = " {item.__class__} {0} {{item}} {item:>40} :{item}"
    (r,) = default_engine.score_items("P", ["x"], [" Yes", " No"], item_template=template, cache_prefix_len=0)
    literal = " {item.__class__} {0} {x} {item:>40} :x"
    ids = tok.encode("P") + tok.encode(literal, add_special_tokens=False)
    plain = default_engine.score(ids, [" Yes", " No"], cache_prefix_len=0)
    assert r.prompt_tokens == len(ids)
    assert [t.logprob for t in r.tokens] == pytest.approx([t.logprob for t in plain.tokens], abs=1e-4)
    for bad in ("{item:>4000000}", "no placeholder"):
        with pytest.raises(InvalidRequestError, match="has no {item}"):
            default_engine.submit_items("P", ["x"], [" Yes"], item_template=bad)


def test_protocol_checks_counts_and_bytes_before_decoding(default_engine):
    limits = default_engine.limits
    many = {"text_input": np.array([b"x"] * (limits.max_prompts_per_request + 1), dtype=object),
            "allowed_token_ids": np.array([1])}
    with pytest.raises(InvalidRequestError, match=r"\(max_prompts_per_request\)"):
        parse_request(many, limits)
    # not UTF-8 and over the bound: the size is what is reported (nothing was decoded)
    big = {"text_input": np.array([b"\xff" * (limits.max_prompt_bytes + 1)], dtype=object), "allowed_token_ids": np.array([1])}
    with pytest.raises(InvalidRequestError, match=r"text_input is .* bytes.*\(max_prompt_bytes\)"):
        parse_request(big, limits)
    with pytest.raises(InvalidRequestError, match=r"\(max_allowed_tokens\)"):
        parse_request({"text_input": np.array([b"x"], dtype=object), "allowed_token_ids": np.arange(300)}, limits)
    assert parse_request({"text_input": np.array([b"x"] * limits.max_prompts_per_request, dtype=object),
                          "allowed_token_ids": np.array([1])}, limits).prompts == ["x"] * limits.max_prompts_per_request


def test_prompts_per_request_limit_follows_the_queue():
    assert EngineConfig().max_prompts_per_request == 64
    assert EngineConfig(max_waiting=8).max_prompts_per_request == 8  # never more than the queue can take
    with pytest.raises(ConfigError, match="max_prompts_per_request 100 is over max_waiting 50"):
        EngineConfig(max_waiting=50, max_prompts_per_request=100)


def test_each_limit_is_checked_once_in_the_triton_model(default_engine):
    """The Triton model checks a client's request against the engine's limits on the wire
    (protocol.parse_request); the engine then trusts it and does not check the same table again.
    A call nobody checked (limits_checked False) is checked by the engine."""
    too_many = list(range(default_engine.limits.max_allowed_tokens + 1))
    wire = {"text_input": np.array([b"Hi"], dtype=object), "allowed_token_ids": np.array(too_many)}
    with pytest.raises(InvalidRequestError, match=r"\(max_allowed_tokens\)"):
        parse_request(wire, default_engine.limits)  # refused on the wire, before the engine
    unchecked = parse_request(wire)  # no limits given: not checked there ...
    assert not unchecked.limits_checked
    with pytest.raises(InvalidRequestError, match=r"too many allowed tokens: 257.*\(max_allowed_tokens\)"):
        submit_call(default_engine, unchecked)  # ... so the engine checks
    # a call marked checked is taken as it is: the engine does not count again
    trusted = ScoreCall(["Hi"], too_many, options={"cache_prefix_len": 0}, limits_checked=True)
    (future,) = submit_call(default_engine, trusted)
    assert len(future.result(timeout=120).tokens) == len(too_many)
