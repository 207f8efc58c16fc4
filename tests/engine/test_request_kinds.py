"""Request kinds (tasks/): a kind of a test's own, registered in one call, served end to end through
the engine and the Triton model's protocol, against transformers' forward in float64; and the
registry's rules (one kind per wire task and items-or-not, clear errors)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import torch

from prefillonly import InvalidRequestError
from prefillonly import tasks
from prefillonly.request import Request, check_length
from prefillonly.serving.model.protocol import parse_request, results_to_outputs, submit_call
from prefillonly.tasks.base import RequestKind, RowOutput, SubmitContext
from tests.reference import hf_logprobs, load_hf


@dataclass(frozen=True)
class NextTokenEntropy:
    """The answer of the test's kind: the entropy (nats) of the next-token distribution."""

    entropy: float
    prompt_tokens: int
    cached_tokens: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class EntropyKind(RequestKind):
    """Not a kind the engine ships: how uncertain the model is after a prompt (no allowed tokens)."""

    name = "entropy_test"
    wire_task = "entropy"
    options = ("cache_prefix_len", "priority")

    def build(self, ctx: SubmitContext, prompt) -> Request:
        ids = ctx.encoder.encode_prompt(prompt)
        check_length(len(ids), ctx.max_input_len)
        return Request(self, ids, [])

    def result(self, request: Request, row: RowOutput, token_text) -> NextTokenEntropy:
        logprobs = torch.log_softmax(row.logits.double(), dim=-1)
        entropy = float(-(logprobs.exp() * logprobs).sum())
        return NextTokenEntropy(entropy, len(request.token_ids), row.cached_tokens)


@pytest.fixture
def entropy_kind():
    kind = tasks.register(EntropyKind())
    yield kind
    tasks.unregister(kind.name)


def _entropy(logprobs: torch.Tensor) -> float:
    return float(-(logprobs.exp() * logprobs).sum())


def test_a_registered_kind_is_served_end_to_end(entropy_kind, default_engine, default_model_path):
    rng = random.Random()
    vocab = default_engine.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 33, 130)]  # odd lengths, fresh ids
    ref64 = load_hf(default_model_path, torch.float64)
    # straight through the engine, several requests sharing steps
    futures = [default_engine.submit_task("entropy_test", ids, cache_prefix_len=0) for ids in prompts]
    for ids, future in zip(prompts, futures):
        got = future.result(timeout=120)
        assert got.prompt_tokens == len(ids)
        assert abs(got.entropy - _entropy(hf_logprobs(ref64, ids))) <= 1e-3, ids
    # through the Triton model's protocol: the wire's task name finds the kind, its outputs go back
    call = parse_request({"input_ids": np.array(prompts[2]), "task": np.array([b"entropy"], dtype=object),
                          "priority": np.array([2])})
    assert call.kind == "entropy_test" and call.options == {"priority": 2}
    results = [f.result(timeout=120) for f in submit_call(default_engine, call)]
    out = results_to_outputs(call, results)
    assert set(out) == {"result_json", "prompt_tokens", "cached_tokens"} and out["prompt_tokens"].tolist() == [33]
    assert json.loads(out["result_json"][0])["entropy"] == pytest.approx(_entropy(hf_logprobs(ref64, prompts[2])), abs=1e-3)
    with pytest.raises(InvalidRequestError, match="top_k does not apply to task 'entropy'"):
        parse_request({"input_ids": np.array([1, 2]), "task": np.array([b"entropy"], dtype=object), "top_k": np.array([3])})


def test_the_registry_refuses_clashes_and_names_unknown_kinds(entropy_kind):
    with pytest.raises(ValueError, match="registered already"):
        tasks.register(EntropyKind())

    class Twin(EntropyKind):
        name = "entropy_twin"

    with pytest.raises(ValueError, match="answers task 'entropy' like 'entropy_test'"):
        tasks.register(Twin())
    assert "entropy" in tasks.wire_tasks() and tasks.kind_for("entropy", False) is entropy_kind
    with pytest.raises(InvalidRequestError, match="task 'entropy' takes prompts, not items"):
        tasks.kind_for("entropy", True)
    with pytest.raises(InvalidRequestError, match="unknown request kind 'nope'"):
        tasks.kind_named("nope")


def test_the_built_in_kinds_answer_the_wire_tasks():
    assert tasks.wire_tasks()[:3] == ["score", "loglikelihood", "prompt_logprobs"]
    assert [tasks.kind_for(t, i).name for t, i in (("score", False), ("score", True), ("loglikelihood", True),
                                                   ("prompt_logprobs", False))] == \
        ["score", "items", "loglikelihood", "prompt_logprobs"]
    with pytest.raises(InvalidRequestError, match="unknown task .generate.; choose one of score, loglikelihood, prompt_logprobs, decide"):
        tasks.kind_for("generate", False)
