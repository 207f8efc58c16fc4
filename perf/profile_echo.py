"""The engine alone on lm-eval's multiple-choice echo requests: where their time goes.

    .venv/bin/python -m perf.profile_echo [--questions 150] [--batch-size 16] [--profile]

Builds the requests lm-eval's `local-completions` sends for the po_mc task of
perf/eval_harness_tasks.py (context + continuation token ids by lm-eval's rule, sorted longest
first, in batches of --batch-size), submits each batch to one Engine as prompt-logprob requests
(start 1, top 1: what `echo` with `logprobs: 1` asks) and waits for the batch, as the frontend
does. Prints the wall time, tokens computed and cached, and with --profile the torch
profiler's top ops by self time. No server, no lm-eval: the engine's share of the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf import eval_harness_tasks as tasks
from prefillonly import Engine, EngineConfig


def echo_prompts(engine: Engine, questions: int, passage_sentences: int) -> list[list[int]]:
    """lm-eval's po_mc requests as token ids, in lm-eval's order (longest first, then by tokens)."""
    with tempfile.TemporaryDirectory() as folder:
        tasks.write_tasks(Path(folder), questions=questions, passage_sentences=passage_sentences, ppl_docs=1, seed=0)
        docs = [json.loads(line) for line in (Path(folder) / "mc.jsonl").read_text().splitlines()]
    prompts = []
    for d in docs:
        context = f"{d['passage']}\nQuestion: {d['question']}\nAnswer:"
        shared, continuations = engine.encoder.encode_continuations(context, d["choices"])
        prompts += [shared + c for c in continuations]
    return sorted(prompts, key=lambda p: (-len(p), tuple(p)))


def run(engine: Engine, prompts: list[list[int]], batch_size: int) -> float:
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        futures = [engine.submit_prompt_logprobs(p, start=1, top_k=1) for p in prompts[b : b + batch_size]]
        for f in futures:
            f.result()
    return time.perf_counter() - t0


class profile_worker:
    """The torch profiler in the engine's worker thread (it records the thread it is started in):
    started by the first step, stopped by one more request after the run."""

    def __init__(self, engine: Engine):
        from torch.profiler import ProfilerActivity, profile

        self.prof, self.state, execute = profile(activities=[ProfilerActivity.CPU]), "idle", engine.runner.execute

        def profiled(plan):
            if self.state == "idle":
                self.prof.__enter__()
                self.state = "on"
            out = execute(plan)
            if self.state == "stopping":
                self.prof.__exit__(None, None, None)
                self.state = "off"
            return out

        engine.runner.execute = profiled

    def stop(self, engine: Engine) -> None:
        self.state = "stopping"
        engine.score([1, 2, 3], [4])

    def table(self) -> str:
        return self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.profile_echo", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=150)
    p.add_argument("--passage-sentences", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=None, help="the prefix cache's block size (default: EngineConfig's)")
    p.add_argument("--profile", action="store_true", help="run under the torch profiler, print its top ops")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    blocks = {} if args.block_size is None else {"cache_block_size": args.block_size}
    with Engine(EngineConfig(dtype=args.dtype, threads=args.threads, **blocks)) as engine:
        prompts = echo_prompts(engine, args.questions, args.passage_sentences)
        before = engine.stats()
        prof = profile_worker(engine) if args.profile else None
        wall = run(engine, prompts, args.batch_size)
        after = engine.stats()
        if prof is not None:
            prof.stop(engine)
        total = sum(map(len, prompts))
        computed = after.tokens_computed - before.tokens_computed
        print(f"{len(prompts)} prompts, {total:,} tokens: {wall:.2f} s; {computed:,} computed, {after.steps - before.steps} steps")
        if args.profile:
            print(prof.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
