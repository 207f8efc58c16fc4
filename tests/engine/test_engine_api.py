"""Engine.score on the embedded default model: results, options, and every bad input."""

from __future__ import annotations

import gc
import math
import time

import pytest
import torch

from prefillonly import Engine, EngineConfig, InvalidRequestError, OverBudgetError, PromptTooLongError
from prefillonly.contract.errors import EngineClosedError
from prefillonly.worker.memory_probe import release_free_heap

PROMPT = "Is the sky blue on a clear day? Answer:"


def test_score_text_and_ids_agree_and_are_normalised(default_engine):
    e = default_engine
    r = e.score(PROMPT, [" Yes", " No"])
    ids = e.encoder.tokenizer.encode(PROMPT)
    r2 = e.score(ids, [" Yes", e.encoder.tokenizer.encode(" No", add_special_tokens=False)[0]])
    assert [t.text for t in r.tokens] == [" Yes", " No"]
    assert [t.id for t in r.tokens] == [t.id for t in r2.tokens]
    assert all(abs(a.logprob - b.logprob) < 1e-6 for a, b in zip(r.tokens, r2.tokens))
    assert math.isclose(sum(t.prob for t in r.tokens), 1.0, rel_tol=1e-6)
    assert r.chosen == max(r.tokens, key=lambda t: t.prob)
    assert r.prompt_tokens == len(ids) and r.cached_tokens == 0
    # prob is the softmax of the allowed logprobs
    lp = torch.tensor([t.logprob for t in r.tokens])
    assert torch.allclose(lp.softmax(0), torch.tensor([t.prob for t in r.tokens]), atol=1e-6)


def test_logprobs_are_full_vocabulary_and_order_is_kept(default_engine):
    e = default_engine
    ids = e.encoder.tokenizer.encode(PROMPT)
    full = e.executor.forward(torch.tensor(ids), None).logits.log_softmax(-1)
    r = e.score(ids, [2838, 9230, 17])  # " No", " Yes", another id: order as asked
    assert [t.id for t in r.tokens] == [2838, 9230, 17]
    for t in r.tokens:
        assert abs(t.logprob - float(full[t.id])) < 1e-5


def test_top_k(default_engine):
    r = default_engine.score(PROMPT, [" Yes", " No"], top_k=5)
    assert len(r.top_k) == 5
    lps = [t.logprob for t in r.top_k]
    assert lps == sorted(lps, reverse=True)
    assert all(abs(t.prob - math.exp(t.logprob)) < 1e-6 for t in r.top_k)
    assert default_engine.score(PROMPT, [" Yes"]).top_k == []


def test_chat_template_changes_the_prompt(default_engine):
    plain = default_engine.score("Is water wet?", ["Yes", "No"])
    chat = default_engine.score("Is water wet?", ["Yes", "No"], apply_chat_template=True)
    assert chat.prompt_tokens > plain.prompt_tokens


def test_the_engine_predicts_with_its_executors_kernels(default_engine):
    kernels = default_engine.executor.kernels
    assert default_engine.memory.kernels is kernels
    stats = default_engine.stats()
    assert (stats.attention_backend, stats.linear_backend) == (kernels.attention, kernels.linear)


def test_peak_bytes_measured(default_engine):
    # Earlier tests in this process left freed heap that is still resident; a forward that reuses
    # it grows no RSS and measures 0. Trimming first (as the memory probe does) makes its buffers
    # fault in fresh pages; where the allocator has no malloc_trim only the field is checked.
    gc.collect()
    trimmed = release_free_heap()
    r = default_engine.score(list(range(1000, 1600)), [" Yes"])
    assert r.peak_bytes is not None
    if trimmed:
        assert r.peak_bytes > 0


BAD_INPUTS = [
    (dict(prompt="", allowed_tokens=[" Yes"]), InvalidRequestError, "prompt is empty"),
    (dict(prompt=[], allowed_tokens=[" Yes"]), InvalidRequestError, "prompt is empty"),
    (dict(prompt=[1, 2, 49152], allowed_tokens=[" Yes"]), InvalidRequestError, "prompt token id 49152 is outside the vocabulary"),
    (dict(prompt=[1, -3], allowed_tokens=[" Yes"]), InvalidRequestError, "prompt token id -3 is outside the vocabulary"),
    (dict(prompt=[1, 2.5], allowed_tokens=[" Yes"]), InvalidRequestError, "2.5 is not an integer"),
    (dict(prompt=PROMPT, allowed_tokens=[]), InvalidRequestError, "allowed_tokens is empty"),
    (dict(prompt=PROMPT, allowed_tokens=" Yes"), InvalidRequestError, "must be a list"),
    (dict(prompt=PROMPT, allowed_tokens=[70000]), InvalidRequestError, "allowed token id 70000 is outside the vocabulary"),
    (dict(prompt=PROMPT, allowed_tokens=[" Yes", " No", " Yes"]), InvalidRequestError, "same token"),
    (dict(prompt=PROMPT, allowed_tokens=[9230, " Yes"]), InvalidRequestError, "same token"),
    (dict(prompt=PROMPT, allowed_tokens=["Yes please"]), InvalidRequestError, "'Yes please' encodes to 2 tokens"),
    (dict(prompt=PROMPT, allowed_tokens=[""]), InvalidRequestError, "empty"),
    (dict(prompt=b"caf\xe9 ok", allowed_tokens=[" Yes"]), InvalidRequestError, "not valid UTF-8: byte 0xe9 at offset 3"),
    (dict(prompt="bad \udcff surrogate", allowed_tokens=[" Yes"]), InvalidRequestError, "not valid Unicode"),
    (dict(prompt=PROMPT, allowed_tokens=[b"\xff"]), InvalidRequestError, "not valid UTF-8"),
    (dict(prompt=PROMPT, allowed_tokens=[" Yes"], top_k=-1), InvalidRequestError, "top_k -1"),
    (dict(prompt=PROMPT, allowed_tokens=[" Yes"], top_k="3"), InvalidRequestError, "top_k must be an integer"),
    (dict(prompt=[1, 2, 3], allowed_tokens=[" Yes"], apply_chat_template=True), InvalidRequestError, "needs a text prompt"),
    (dict(prompt=list(range(8193)), allowed_tokens=[" Yes"]), PromptTooLongError, "8193 tokens, over the max input length 8192"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_a_clear_error_and_the_next_request_is_served(default_engine, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        default_engine.score(kwargs.pop("prompt"), kwargs.pop("allowed_tokens"), **kwargs)
    assert default_engine.score(PROMPT, [" Yes", " No"]).chosen.text in (" Yes", " No")


def test_multi_token_string_hints_at_leading_space(default_engine):
    with pytest.raises(InvalidRequestError, match="with a leading space"):
        default_engine.score(PROMPT, ["Absolutely"])  # two tokens; " Absolutely" is one


def test_over_memory_budget_is_rejected_before_running(default_model_path):
    with Engine(EngineConfig(model=default_model_path, activation_budget_bytes=8 << 20, threads=2)) as e:
        # cache_prefix_len=0: both calls compute all 40 tokens, so they must agree to the bit; were the
        # first call's blocks kept, the second would read 32 of them from the cache and, in bfloat16 on
        # an AMX host (whose GEMM blocking depends on the row count), differ by rounding (0.03 seen)
        small = e.score(list(range(100, 140)), [" Yes"], cache_prefix_len=0)  # fits
        with pytest.raises(OverBudgetError, match="over the budget of 8.0 MiB"):
            e.score(list(range(100, 2100)), [" Yes"])
        again = e.score(list(range(100, 140)), [" Yes"], cache_prefix_len=0)
        assert again.tokens[0].logprob == pytest.approx(small.tokens[0].logprob, abs=1e-6)


def test_max_input_len_override(default_model_path):
    with Engine(EngineConfig(model=default_model_path, max_input_len=16, threads=2)) as e:
        with pytest.raises(PromptTooLongError, match="17 tokens, over the max input length 16"):
            e.score(list(range(17)), [" Yes"])
        assert e.score(list(range(16)), [" Yes"]).prompt_tokens == 16


def test_closed_engine_refuses(default_model_path):
    e = Engine(EngineConfig(model=default_model_path, threads=2))
    e.close()
    with pytest.raises(EngineClosedError, match="closed"):
        e.score(PROMPT, [" Yes"])


def test_prompt_over_budget_runs_with_inplace_attention(tmp_path):
    """On SDPA, a budget between the two predictions: the engine writes attention in place instead
    of refusing. (The compiled CPU kernel always writes over Q, so it needs no such fallback: its
    prediction is below SDPA's in-place one.)"""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=512, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=16384)
    cfg.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    n = 12000  # long enough that one query block's temporaries cost less than a second [S, q_width]
    common = dict(model=str(tmp_path), dtype="float32", threads=2, cache_budget_bytes=0, attention_backend="sdpa")
    prompt = [i % 300 for i in range(n)]
    with Engine(EngineConfig(**dict(common, attention_backend="cpu_flash"))) as kernel:
        kernel_peak = kernel.predict_peak_bytes(n)
        assert kernel_peak == kernel.predict_peak_bytes(n, inplace_attention=True)
    with Engine(EngineConfig(**common)) as ref:
        normal = ref.predict_peak_bytes(n)
        inplace = ref.predict_peak_bytes(n, inplace_attention=True)
        assert kernel_peak < inplace < normal
        want = ref.score(prompt, [5, 17])
        assert ref.stats().counters.inplace_attention == 0
    with Engine(EngineConfig(**common, activation_budget_bytes=(normal + inplace) // 2)) as e:
        got = e.score(prompt, [5, 17])
        assert e.stats().counters.inplace_attention == 1
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.tokens, want.tokens)) <= 1e-4
    with Engine(EngineConfig(**common, activation_budget_bytes=inplace // 2)) as e:
        with pytest.raises(OverBudgetError):
            e.score(prompt, [5, 17])


def test_queued_work_counts_the_running_step_until_it_ends(default_engine):
    # what the fleet picker reads: a replica computing a long forward with nothing waiting is busy
    e = default_engine
    assert e.stats().queued_work_s == 0.0
    ids = torch.randint(100, 40000, (3000,), generator=torch.Generator().manual_seed(11)).tolist()
    predicted = e.jct.predict(3000, 0)
    future = e.submit(ids, [" Yes"])
    seen = []
    while not future.done():
        stats = e.stats()
        if stats.waiting == 0:
            seen.append(stats.queued_work_s)
        time.sleep(0.002)
    future.result()
    assert seen and max(seen) > 0.0  # the running step's rest, with nothing waiting
    assert max(seen) <= predicted + 1e-6  # never more than the step's own prediction
    assert e.stats().queued_work_s == 0.0  # and none once it has ended


def test_a_running_step_shows_its_progress_until_a_forward_stalls(default_engine, monkeypatch):
    """progressing_step (what a liveness probe takes as proof of life while one long step runs):
    None when idle; while a multi-item step's forwards finish, how long it has run; None again once
    no forward finished within the window (a stalled worker), and after the step."""
    e = default_engine
    assert e.progressing_step() is None
    forward = e.executor.forward_batch
    stall = {"s": 0.0}

    def slow_forward(*args, **kwargs):  # every forward 0.1 s longer, one of them `stall` longer
        time.sleep(0.1 + stall.pop("s", 0.0))
        return forward(*args, **kwargs)

    monkeypatch.setattr(e.executor, "forward_batch", slow_forward)
    gen = torch.Generator().manual_seed(12)
    items = [torch.randint(100, 40000, (40,), generator=gen).tolist() for _ in range(8)]
    prompt = torch.randint(100, 40000, (300,), generator=gen).tolist()
    seen = []
    stall["s"] = 1.2  # the shared prompt's forward: nothing finishes for 1.3 s
    future = e.submit_items(prompt, items, [" Yes"])
    while not future.done():
        seen.append((time.monotonic(), e.progressing_step(window_s=0.5)))
        time.sleep(0.01)
    future.result()
    states = [p is not None for _, p in seen]
    changes = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    # idle, then progressing (the step began), stalled (its first forward), progressing (the items' forward)
    assert changes[-3:] == [True, False, True] or changes[-4:-1] == [True, False, True], changes
    assert next(p for _, p in seen if p is not None).startswith("a step running for ")
    assert e.progressing_step() is None
