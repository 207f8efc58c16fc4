"""lm-evaluation-harness, unchanged, against the real serve command (Envoy, the scoring frontend,
Triton): its `local-completions` model on a multiple-choice task and a perplexity task that this
test writes as local files, and the same tasks with lm-eval's own `hf` model on the same weights
(fp32, the small random-weight model): accuracies equal, every request's log-likelihood within
1e-4, is_greedy equal. lm-eval probes the server for a remote tokenizer first (/tokenizer_info,
/tokenize): the answer is "not supported", and it falls back to the model's Hugging Face tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from ..serving.test_faults import supervised

WORDS = ("river stone light garden window paper music winter market forest bridge cloud letter island "
         "engine silver morning harbor lantern meadow").split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _write_tasks(folder) -> None:
    rng = random.Random(7)
    mc = [{"passage": " ".join(_sentence(rng, 12) for _ in range(6)), "question": _sentence(rng, 6)[:-1] + "?",
           "choices": [" " + _sentence(rng, rng.randint(1, 5)) for _ in range(4)], "label": rng.randrange(4)} for _ in range(8)]
    ppl = [{"text": " ".join(_sentence(rng, 15) for _ in range(rng.randint(4, 12)))} for _ in range(4)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (folder / "ppl.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ppl))
    (folder / "po_mc.yaml").write_text(f"""task: po_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (folder / "po_ppl.yaml").write_text(f"""task: po_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "ppl.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
""")


def _evaluate(folder, model: str, model_args: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["po_mc", "po_ppl"], log_samples=True,
                                   task_manager=TaskManager(include_path=str(folder)), random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def _requests(results: dict, task: str) -> list[tuple[float, bool]]:
    """Every request's (log-likelihood, is_greedy) of `task`, in document and request order."""
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for resp in sample["resps"]:
            value = resp[0]
            out.append((float(value[0]), bool(value[1])) if isinstance(value, (list, tuple)) else (float(value), None))
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory, small_served_model, monkeypatch_module):
    folder = tmp_path_factory.mktemp("eval_tasks")
    _write_tasks(folder)
    with supervised(tmp_path_factory.mktemp("eval_stack"), small_served_model, probe_interval_s=3600) as sup:
        ours = _evaluate(folder, "local-completions", {
            "model": "prefillonly", "base_url": f"{sup.http_url}/v1/completions", "tokenizer": small_served_model,
            "batch_size": 8, "num_concurrent": 1, "max_retries": 1, "timeout": 300})
    hf = _evaluate(folder, "hf", {"pretrained": small_served_model, "dtype": "float32", "device": "cpu", "batch_size": 8})
    return ours, hf


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")  # local files only: nothing is fetched
    mp.setenv("OPENAI_API_KEY", "unused")
    yield mp
    mp.undo()


def test_multiple_choice_equals_the_hf_model(both):
    ours, hf = both
    assert ours["results"]["po_mc"]["acc,none"] == hf["results"]["po_mc"]["acc,none"]
    got, want = _requests(ours, "po_mc"), _requests(hf, "po_mc")
    assert len(got) == len(want) == 8 * 4
    for (lg, gg), (lw, gw) in zip(got, want):
        assert abs(lg - lw) <= 1e-4 and gg == gw, (lg, lw, gg, gw)


def test_perplexity_equals_the_hf_model(both, small_served_model):
    """A rolling log-likelihood sums a whole text's tokens, and the hf model's sum is a float32 one
    (-903.6195068359375 for ~180 tokens: its last place is 6e-5): each text within 1e-4 per token."""
    from transformers import AutoTokenizer

    ours, hf = both
    got, want = _requests(ours, "po_ppl"), _requests(hf, "po_ppl")
    assert len(got) == len(want) == 4
    tokenizer = AutoTokenizer.from_pretrained(small_served_model)
    docs = sorted(ours["samples"]["po_ppl"], key=lambda d: d["doc_id"])
    for (lg, _), (lw, _), doc in zip(got, want, docs):
        tokens = len(tokenizer(doc["doc"]["text"], add_special_tokens=False)["input_ids"])
        assert abs(lg - lw) <= 1e-4 * tokens, (lg, lw, tokens)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        assert ours["results"]["po_ppl"][metric] == pytest.approx(hf["results"]["po_ppl"][metric], rel=1e-5)
