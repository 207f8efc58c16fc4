"""The wire contract (prefillonly.contract.wire) without a server: the models' configs declare exactly its
tensors, results survive result_json, requests and the affinity header follow one rule, error
codes map to one status each, and clients/ runs on it without prefillonly installed."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefillonly.contract import wire
from prefillonly.contract.wire import ScoreResult, TokenScore

ROOT = Path(__file__).resolve().parents[2]
POOLED_OUTPUTS = {"embedding", "class_logits", "class_probs"}  # embed's and classify's columns
_TENSOR = re.compile(r'\{\s*name:\s*"(\w+)"\s*data_type:\s*(\w+)\s*dims:\s*\[([^\]]*)\]')


def declared(config: Path, section: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, data_type, dims) of a config.pbtxt's `input [...]` or `output [...]` list."""
    block = re.search(rf"^{section} \[(.*?)^\]", config.read_text(), re.S | re.M).group(1)
    return [(n, t, tuple(int(d) for d in dims.split(","))) for n, t, dims in _TENSOR.findall(block)]


@pytest.mark.parametrize("model", [wire.MODEL, wire.SYNC_MODEL])
def test_each_model_config_declares_the_contracts_tensors(model):
    config = ROOT / "model_repository" / model / "config.pbtxt"
    assert declared(config, "input") == [(t.name, t.config_type, t.dims) for t in wire.INPUT_TENSORS]
    assert declared(config, "output") == [(t.name, t.config_type, t.dims) for t in wire.OUTPUT_TENSORS]


def result(p_yes: float = 0.75, **extra) -> ScoreResult:
    toks = [TokenScore(9, " Yes", -0.1, p_yes), TokenScore(8, " Noé", -2.5, 1 - p_yes)]
    return ScoreResult(tokens=toks, chosen=max(toks, key=lambda t: t.prob), **extra)


def test_results_come_back_as_the_same_frozen_result():
    from prefillonly.contract.wire import ScoreResult as EngineResult
    from prefillonly.serving.model.protocol import ScoreCall, results_to_outputs

    assert EngineResult is ScoreResult  # the engine's result is the wire's
    sent = [result(top_k=[TokenScore(3, "x", -0.01, 0.99)], prompt_tokens=7, cached_tokens=4, peak_bytes=1 << 20),
            result(0.1)]
    outputs = results_to_outputs(ScoreCall(["q"], [" Yes"]), sent)
    assert set(outputs) == set(wire.OUTPUTS) - POOLED_OUTPUTS  # a score has every output but the pooled tasks' own
    assert all(str(outputs[name].dtype) in ("object", "int64", "float32") for name in outputs)
    assert wire.decode_results(outputs[wire.RESULT_JSON]) == sent
    assert " Noé" in outputs[wire.RESULT_JSON][0].decode()  # UTF-8, not \u escapes
    assert wire.decode_results(sent[0].to_json()) == sent[:1]  # HTTP generate's scalar form
    with pytest.raises(AttributeError):
        sent[0].prompt_tokens = 1


@pytest.mark.parametrize("kind,results,column", [
    ("embed", [wire.EmbeddingResult([0.6, 0.8], normalized=True, prompt_tokens=3),
               wire.EmbeddingResult([1.0, 0.0], pooling="mean", prompt_tokens=2, cached_tokens=1)], "embedding"),
    ("classify", [wire.ClassificationResult([2.0, -1.0, 0.5], [0.79, 0.04, 0.17], ["a", "b", "c"], "a", prompt_tokens=4)],
     "class_probs"),
])
def test_pooled_results_fill_their_own_columns_as_declared(kind, results, column):
    """embed and classify answers: result_json decodes to the same results, and their columns are
    [results, values] float32, as the configs declare them (dims -1, -1)."""
    from prefillonly.serving.model.protocol import ScoreCall, results_to_outputs

    outputs = results_to_outputs(ScoreCall(["q"] * len(results), [], kind=kind), results)
    assert column in outputs and set(outputs) <= set(wire.OUTPUTS)
    assert not {"chosen_token", "allowed_probs"} & set(outputs)
    dims = {t.name: t.dims for t in wire.OUTPUT_TENSORS}
    for name, array in outputs.items():
        assert array.ndim == len(dims[name]) and array.shape[0] == len(results), (name, array.shape)
    values = [r.embedding if kind == "embed" else r.probs for r in results]
    assert outputs[column].dtype == np.float32 and np.allclose(outputs[column], values)
    assert wire.decode_answers(outputs[wire.RESULT_JSON]) == results


def test_one_status_per_code():
    from concurrent.futures import CancelledError

    from prefillonly.contract.errors import EngineClosedError, InvalidRequestError, OverloadedError, PromptTooLongError
    from prefillonly.serving.model.protocol import error_reply

    assert wire.code_of("overloaded: 3 waiting") == "overloaded" and wire.code_of(" internal : x") == "internal"
    assert wire.code_of("no code here") is None and wire.code_of("Traceback: x") is None and wire.code_of("a b: c") is None
    for error, status, http in [(OverloadedError("x"), "UNAVAILABLE", 503), (EngineClosedError("x"), "UNAVAILABLE", 503),
                                (InvalidRequestError("x"), "INVALID_ARG", 400), (PromptTooLongError("x"), "INVALID_ARG", 400),
                                (CancelledError(), "CANCELLED", 400), (RuntimeError("x"), "INTERNAL", 500)]:
        got_status, message = error_reply(error)
        assert got_status == status == wire.triton_status(wire.code_of(message)), (error, message)
        assert wire.http_status(wire.code_of(message)) == http
    assert wire.retry_later(wire.UNAVAILABLE) and wire.http_status(wire.UNAVAILABLE) == 503
    assert not wire.retry_later("invalid_request") and not wire.retry_later(None)
    import grpc

    assert all(hasattr(grpc.StatusCode, name) for _, name in wire.STATUSES.values())


def _digest(user: str) -> str:
    return "sha256-" + hashlib.sha256(user.encode()).hexdigest()


@pytest.mark.parametrize("user,value", [("alice", "alice"), ("user 42/x", "user 42/x"), ("élodie", _digest("élodie")),
                                        ("tab\there", _digest("tab\there")), ("", None), (None, None), (7, None)])
def test_the_user_header_rule(user, value):
    """Printable ASCII goes as it is; anything else (not a valid header value) as a stable digest."""
    from clients.transport import routing_headers

    assert wire.routing_headers(user) == ({wire.USER_HEADER: value} if value else {})
    assert routing_headers({"user": user}) == wire.routing_headers(user)  # the clients' header is the same rule's


def test_request_fields_and_their_tensors():
    import tritonclient.grpc as grpcclient

    text = wire.request_fields("Q?", [" Yes", 7], items=["a", "b"], item_template="{item}", top_k=2, user="u")
    assert text["text_input"] == "Q?" and text["allowed_tokens"] == [" Yes"] and text["items"] == ["a", "b"]
    assert text["allowed_token_ids"].tolist() == [7] and text["top_k"].tolist() == [2] and "priority" not in text
    ids = wire.request_fields([1, 2], [4], items=[[5], [6, 7]], priority=3, apply_chat_template=False)
    assert ids["input_ids"].tolist() == [1, 2] and "items" not in ids
    assert ids["item_ids"].tolist() == [5, 6, 7] and ids["item_lengths"].tolist() == [1, 2]
    assert ids["priority"].tolist() == [3] and ids["apply_chat_template"].tolist() == [False]
    assert wire.request_fields(["a", "b"], [1])["text_input"] == ["a", "b"]
    tensors = {t.name(): t for t in wire.infer_inputs(grpcclient, text)}
    for name, tensor in tensors.items():
        assert tensor.datatype() == wire.INPUTS[name], name
    assert tensors["user"].shape() == [1] and tensors["top_k"].shape() == [1]
    assert wire.as_array([]).dtype == np.object_  # an empty list is BYTES [0]


_BLOCK_PREFILLONLY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prefillonly":
            raise ModuleNotFoundError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
"""


def test_clients_run_with_only_numpy_and_tritonclient():
    """Without the prefillonly package (it needs torch), clients/ loads the checkout's src/contract/wire.py:
    imported as a package (tests, benchmarks) and run as a script."""
    package = _BLOCK_PREFILLONLY + (
        "import clients.prefillonly_client, clients.transport as t, json\n"
        "assert not any(m.split('.')[0] in ('prefillonly', 'torch') for m in sys.modules), sorted(sys.modules)\n"
        "print(json.dumps([t.wire.__name__, t.routing_headers({'user': 'élodie'}), t.wire.request_fields('q', [1])['text_input']]))\n")
    done = subprocess.run([sys.executable, "-c", package], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    name, headers, prompt = json.loads(done.stdout)
    assert name == "prefillonly_wire" and headers == wire.routing_headers("élodie") and prompt == "q"
    script = _BLOCK_PREFILLONLY + "import runpy\nsys.argv = ['prefillonly_client.py', '--help']\nsys.path.insert(0, 'clients')\n" \
                                  "runpy.run_path('clients/prefillonly_client.py', run_name='__main__')\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--allowed-ids" in done.stdout, done.stderr[-2000:]
