"""Local lm-evaluation-harness tasks (multiple choice, perplexity) written as files, so that the
eval-harness test and benchmark run with nothing fetched: lm-eval reads them with
`dataset_path: json` through `TaskManager(include_path=folder)`.

    write_tasks(folder, questions=150, passage_sentences=25, ppl_docs=8, seed=0)  -> ["po_mc", "po_ppl"]

po_mc: a passage, a question, 4 choices (the 4 requests of a question share the passage, which is
what a prefix cache can reuse); po_ppl: texts scored with loglikelihood_rolling (perplexity).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("river stone light garden window paper music winter market forest bridge cloud letter island engine silver "
         "morning harbor lantern meadow valley kitchen station mirror orchard tunnel castle painter village thunder "
         "compass blanket ribbon candle meadowlark granite velvet").split()
TASKS = ("po_mc", "po_ppl")


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_tasks(folder: Path, questions: int = 8, passage_sentences: int = 6, ppl_docs: int = 4, ppl_sentences=(4, 12),
                seed: int = 7) -> list[str]:
    """Write both tasks' data and YAML into `folder`; returns their names. A passage sentence is
    12 words (~16 tokens with SmolLM2's tokenizer): 25 sentences make a ~400-token passage."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    mc = [{"passage": " ".join(_sentence(rng, 12) for _ in range(passage_sentences)), "question": _sentence(rng, 6)[:-1] + "?",
           "choices": [" " + _sentence(rng, rng.randint(1, 5)) for _ in range(4)], "label": rng.randrange(4)}
          for _ in range(questions)]
    ppl = [{"text": " ".join(_sentence(rng, 15) for _ in range(rng.randint(*ppl_sentences)))} for _ in range(ppl_docs)]
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
    return list(TASKS)


def evaluate(folder: Path, model: str, model_args: dict, tasks=TASKS) -> dict:
    """lm_eval.simple_evaluate on the local tasks, every sample logged, seeds fixed."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                   task_manager=TaskManager(include_path=str(folder)), random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def request_results(results: dict, task: str) -> list[tuple[float, bool | None]]:
    """Every request's (log-likelihood, is_greedy) of `task`, in document and request order
    (is_greedy None for a rolling log-likelihood)."""
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for resp in sample["resps"]:
            value = resp[0]
            out.append((float(value[0]), bool(value[1])) if isinstance(value, (list, tuple)) else (float(value), None))
    return out
