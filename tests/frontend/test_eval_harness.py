"""lm-evaluation-harness, unchanged, against the real serve command (Envoy, the scoring frontend,
Triton): its `local-completions` model on a multiple-choice task and a perplexity task that this
test writes as local files, and the same tasks with lm-eval's own `hf` model on the same weights
(fp32, the small random-weight model): accuracies equal, every request's log-likelihood within
1e-4 per token, is_greedy equal. lm-eval probes the server for a remote tokenizer first (/tokenizer_info,
/tokenize): the answer is "not supported", and it falls back to the model's Hugging Face tokenizer."""

from __future__ import annotations

import pytest

from perf.eval_harness_tasks import evaluate, request_results, write_tasks


@pytest.fixture(scope="module")
def both(tmp_path_factory, small_served_model, stack, monkeypatch_module):
    """(ours, hf) results of both tasks. The perplexity task runs with a 96-token window, so that its
    texts (~100-250 tokens) are scored in several rolling windows, the same ones for both models
    (lm-eval's API model windows at its max_length - 2, its hf model at max_length: 98 there is 96 here)."""
    folder = tmp_path_factory.mktemp("eval_tasks")
    write_tasks(folder)
    api = {"model": "prefillonly", "tokenizer": small_served_model, "batch_size": 8, "num_concurrent": 1, "max_retries": 1,
           "timeout": 300}
    hf = {"pretrained": small_served_model, "dtype": "float32", "device": "cpu", "batch_size": 8}
    api["base_url"] = f"{stack.http_url}/v1/completions"  # the layer's serve stack (conftest.py)
    ours = (evaluate(folder, "local-completions", api, ["po_mc"]),
            evaluate(folder, "local-completions", dict(api, max_length=98), ["po_ppl"]))
    theirs = (evaluate(folder, "hf", hf, ["po_mc"]), evaluate(folder, "hf", dict(hf, max_length=96), ["po_ppl"]))
    return ours, theirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")  # local files only: nothing is fetched
    mp.setenv("OPENAI_API_KEY", "unused")
    yield mp
    mp.undo()


def _continuation_tokens(results: dict, task: str, tokenizer) -> list[int]:
    """Every request's continuation length in tokens, in request_results' order (lm-eval's own
    split: the tokens of context + continuation past those of the context)."""
    lengths = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for context, continuation in sample["arguments"]:
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            lengths.append(max(1, len(whole) - len(tokenizer(context, add_special_tokens=False)["input_ids"])))
    return lengths


def test_multiple_choice_equals_the_hf_model(both, small_served_model):
    """A continuation's log-likelihood is a float32 sum over its tokens on both sides (a -91.47 sum
    has last place 8e-6, and the two forwards' GEMMs differ in shape): within 1e-4 per token."""
    from transformers import AutoTokenizer

    (ours, _), (hf, _) = both
    assert ours["results"]["po_mc"]["acc,none"] == hf["results"]["po_mc"]["acc,none"]
    got, want = request_results(ours, "po_mc"), request_results(hf, "po_mc")
    assert len(got) == len(want) == 8 * 4
    lengths = _continuation_tokens(hf, "po_mc", AutoTokenizer.from_pretrained(small_served_model))
    for (lg, gg), (lw, gw), tokens in zip(got, want, lengths):
        assert abs(lg - lw) <= 1e-4 * tokens and gg == gw, (lg, lw, tokens, gg, gw)


def test_perplexity_equals_the_hf_model(both, small_served_model):
    """A rolling log-likelihood sums a whole text's tokens, and the hf model's sum is a float32 one
    (-903.6195068359375 for ~180 tokens: its last place is 6e-5): each text within 1e-4 per token."""
    from transformers import AutoTokenizer

    (_, ours), (_, hf) = both
    got, want = request_results(ours, "po_ppl"), request_results(hf, "po_ppl")
    assert len(got) == len(want) == 4  # one request per text (lm-eval sums its windows)
    tokenizer = AutoTokenizer.from_pretrained(small_served_model)
    docs = sorted(ours["samples"]["po_ppl"], key=lambda d: d["doc_id"])
    for (lg, _), (lw, _), doc in zip(got, want, docs):
        tokens = len(tokenizer(doc["doc"]["text"], add_special_tokens=False)["input_ids"])
        assert abs(lg - lw) <= 1e-4 * tokens, (lg, lw, tokens)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        assert ours["results"]["po_ppl"][metric] == pytest.approx(hf["results"]["po_ppl"][metric], rel=1e-5)
