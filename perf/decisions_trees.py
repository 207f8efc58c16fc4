"""One decision call per input, timed in process, under two revisions of this repository: fresh
processes, interleaved (before, after, before, after), and every answer compared.

    python -m perf.decisions_trees --before 0c4c00f [--after HEAD] [--reps 2] [--questions 16 64]
        [--input-tokens 1024 2048 4096] [--dtype float32]

What a change to the multi-item path (items over one shared prompt, a decision's options over its
questions) does to a decision call's wall time, with no server or client in the way: each process
builds the default model's Engine, warms it with a 4-question call, then per Q and input size times
one cold call (a cache namespace of its own) with the Q questions of perf/bench_decisions.py. The
worktrees and their thin virtual environments are perf/compare_trees.py's. Prints a Markdown table
for perf/RESULTS.md and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from perf import benchutil as bu
from perf.compare_trees import add_tree_arguments, prepare_trees

# Run inside each tree (its own perf.bench_decisions and prefillonly): only what both revisions have.
CHILD = r"""
import json, sys, time
import numpy as np, torch
from transformers import AutoTokenizer
from prefillonly import Engine, EngineConfig
from prefillonly.frontend.decisions import openai_call
from perf.bench_decisions import input_text, make_questions, vocabulary_words
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
engine = Engine(EngineConfig(dtype=args["dtype"], threads=args["threads"]))
tok = AutoTokenizer.from_pretrained(engine.model_path)
words = vocabulary_words(tok)
warm = openai_call({"model": "m", "input": "A short text to warm up.", "questions": make_questions(4, 0)})
engine.decide(warm.input, warm.questions)
out = []
for q in args["questions"]:
    rng = np.random.default_rng([args["seed"], q])
    questions = make_questions(q, args["seed"])
    for n in args["input_tokens"]:
        call = openai_call({"model": "m", "input": input_text(rng, words, tok, n), "questions": questions})
        t0 = time.perf_counter()
        result = engine.decide(call.input, call.questions, cache_namespace=f"cold-{q}-{n}")
        out.append({"questions": q, "input_tokens": n, "seconds": time.perf_counter() - t0,
                    "computed_tokens": result.computed_tokens,
                    "probabilities": [list(a.probabilities) for a in result.answers]})
print(json.dumps(out))
"""


def run_child(python: Path, tree: Path, args) -> list[dict]:
    spec = {"dtype": args.dtype, "threads": args.threads, "questions": args.questions,
            "input_tokens": args.input_tokens, "seed": args.seed}
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path(args.work) / f"ext-{tree.name}")}
    done = subprocess.run([str(python), "-c", CHILD, json.dumps(spec)], cwd=tree, env=env, check=True,
                          capture_output=True, text=True, timeout=args.timeout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_gap(a: list[dict], b: list[dict]) -> float:
    """The largest |p_before - p_after| over every option of every answer."""
    return max(abs(x - y) for ra, rb in zip(a, b) for pa, pb in zip(ra["probabilities"], rb["probabilities"])
               for x, y in zip(pa, pb))


def table(runs: dict) -> str:
    rows = ["| Q | input tokens | before s (per rep) | after s (per rep) | after / before (median) | computed tokens |",
            "|---|---|---|---|---|---|"]
    for i, r in enumerate(runs["before"][0]):
        before = [rep[i]["seconds"] for rep in runs["before"]]
        after = [rep[i]["seconds"] for rep in runs["after"]]
        ratio = bu.median(after) / bu.median(before)
        rows.append(f"| {r['questions']} | {r['input_tokens']} | {' / '.join(f'{s:.2f}' for s in before)} | "
                    f"{' / '.join(f'{s:.2f}' for s in after)} | {ratio:.2f}x | {r['computed_tokens']} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.decisions_trees", description=__doc__.split("\n\n")[0])
    add_tree_arguments(p, "decisions_trees")
    p.add_argument("--reps", type=int, default=2, help="processes per tree, interleaved (default 2)")
    p.add_argument("--questions", type=int, nargs="+", default=[16, 64], help="Q values (default 16 64)")
    p.add_argument("--input-tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trees, pythons = prepare_trees(args.before, args.after, Path(args.work))
    runs = {"before": [], "after": []}
    for rep in range(args.reps):
        for name in ("before", "after"):
            bu.log(f"rep {rep + 1}/{args.reps}, {name}")
            runs[name].append(run_child(pythons[name], trees[name], args))
    gap = max_gap(runs["before"][0], runs["after"][0])
    report = (f"Command: `python -m perf.decisions_trees {' '.join(sys.argv[1:])}`  \nDate: {bu.now_iso()}  \n"
              f"Machine: {bu.machine_line(bu.machine_info(args.threads))}  \nbefore = {args.before}, after = {args.after}; {args.dtype}, "
              f"{args.threads} threads, fresh process per rep, interleaved\n\n{table(runs)}\n\n"
              f"Largest |p_before - p_after| over every option of every answer: {gap:.1e}\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "max_probability_gap": gap}, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
