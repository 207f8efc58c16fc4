"""Scores at full precision (issue 46): the float32 score head against the bf16 head it replaced,
side by side in fresh processes, interleaved, bfloat16 models on the default SmolLM2.

Precision (one process per head, the float32 engine as the reference): D documents reranked as one
multi-item request: exact ties among the D relevance scores, Kendall tau of their order against the
float32 engine's, the allowed tokens' logprob error against the float32 engine's. A third variant
answers item 2 of the issue: the final norm kept in float32 as well (its rows are not rounded to
bf16 before the head; exact float32 sums of float32 rows and the bf16 weight), to see whether it
closes more of the gap than the float32 head alone.

Speed (head_dtype "model" vs "float32": both engines in one process, run in turn, in --reps fresh processes): a warm
post-recommendation request (a ~2,000-token profile cached, a ~150-token post: one scored row), a
D-document rerank (D scored rows), and a prompt's per-position logprobs (what lm-eval's
loglikelihood_rolling reads: every row through the head).

    .venv/bin/python -m perf.bench_score_head               # 100 documents, 4 processes
    .venv/bin/python -m perf.bench_score_head --worker ...  # one process's measurement (used by the above)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from perf import benchutil as bu

RESULTS_JSON = bu.PERF_DIR / "results" / "bench_score_head.json"
HEADING = "## Scores at full precision: the float32 score head vs bf16 logits (issue 46)"
PLOT = bu.PERF_DIR / "results" / "score_head_scatter.png"
WORDS = ("apple river mountain quantum ledger violet engine harbor silent copper garden thunder orbit pencil marble "
         "lantern whisper canyon falcon velvet meadow anchor cedar ember glacier hollow ivory jasper kettle lagoon").split()
QUERY = "Query: which document talks about a garden near a river at night?\n"
TEMPLATE = "Document: {item}\nIs the document relevant to the query? Answer:"
LABELS = [" Yes", " No"]
VARIANTS = ("float32", "model", "float32_norm")
REPEATS = 4  # runs of each speed workload per head in a process
HEADS = ("model", "float32")  # head_dtype settings compared for speed  # the bf16 engine's heads (float32_norm: item 2's what-if)


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 120)))) for _ in range(n)]


# -- one process's measurement ----------------------------------------------------------------
def _engine(dtype: str, head_dtype: str, threads: int, norm32: bool = False):
    from prefillonly import Engine, EngineConfig

    engine = Engine(EngineConfig(dtype=dtype, head_dtype=head_dtype, threads=threads))
    if norm32:
        _keep_final_norm_in_float32(engine.executor)
    return engine


def _keep_final_norm_in_float32(executor) -> None:
    """Item 2's what-if: the final norm's rows stay float32 into the head (float32 rows times the
    bf16 weight, exact float32 sums through the upcast head) instead of being rounded to bf16."""
    import torch

    from prefillonly.kernels.score_head import logits

    spec, weights = executor.spec, executor.weights

    def head(ws, rows):
        h = rows.float()
        normed = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + spec.rms_norm_eps) * weights.final_norm
        out = logits("upcast", normed, weights.lm_head)
        if spec.final_softcap is not None:
            out = torch.tanh(out / spec.final_softcap) * spec.final_softcap
        return out

    executor._lm_head = head


def precision_worker(variant: str, n_docs: int, threads: int) -> dict:
    dtype, head = ("float32", "float32") if variant == "reference" else ("bfloat16", "float32" if variant != "model" else "model")
    with _engine(dtype, head, threads, norm32=variant == "float32_norm") as engine:
        results = engine.score_items(QUERY, documents(n_docs), LABELS, item_template=TEMPLATE)
        return {"variant": variant, "score_head": engine.stats().score_head, "probs": [r.tokens[0].prob for r in results],
                "logprobs": [[t.logprob for t in r.tokens] for r in results]}


def _time_the_head(executor) -> list[float]:
    """Seconds spent in the executor's LM head (final norm, head GEMM, soft cap), call by call: the
    part the two heads differ in, measured beside the end-to-end time of the same run."""
    spent, inner = [], executor._lm_head

    def timed(ws, rows):
        t0 = time.perf_counter()
        out = inner(ws, rows)
        spent.append(time.perf_counter() - t0)
        return out

    executor._lm_head = timed
    return spent


def speed_worker(first: str, n_docs: int, threads: int) -> dict:
    """Both heads' engines in this process (`first` built first: the order alone moved a rerank by up
    to 10% in a trial), each workload run on them in turn, `REPEATS` rounds (the order flipped every
    round; the fastest run of each kept: this host's speed drifts by 10% between seconds), with the
    time the runs' LM-head calls took."""
    from perf.workloads import random_ids

    rng = np.random.default_rng(7)
    engines = {h: _engine("bfloat16", h, threads) for h in sorted(HEADS, key=lambda h: h != first)}
    try:
        spent = {h: _time_the_head(e.executor) for h, e in engines.items()}
        vocab = engines["model"].spec.vocab_size
        profile = random_ids(rng, 2000, 100, vocab)
        posts = [random_ids(rng, 150, 100, vocab) for _ in range(REPEATS + 1)]
        spans = [random_ids(rng, 512, 100, vocab) for _ in range(REPEATS)]
        for e in engines.values():  # the profile cached in each
            e.score(profile + posts[-1], LABELS, cache_prefix_len=len(profile))
        cases = {"warm_post": lambda e, i: e.score(profile + posts[i], LABELS, cache_prefix_len=len(profile)),
                 "rerank": lambda e, i: e.score_items(QUERY, documents(n_docs, seed=i + 1), LABELS, item_template=TEMPLATE),
                 "prompt_logprobs_512": lambda e, i: e.prompt_logprobs(spans[i], cache_prefix_len=0)}
        out = {"score_head": engines["float32"].stats().score_head, "built_first": first}
        for name, run in cases.items():
            best = {}
            for i in range(REPEATS):
                for h in (HEADS if i % 2 == 0 else HEADS[::-1]):
                    spent[h].clear()
                    t0 = time.perf_counter()
                    run(engines[h], i)
                    total = time.perf_counter() - t0
                    if h not in best or total < best[h][0]:
                        best[h] = (total, sum(spent[h]))
            for h in HEADS:
                out[f"{h}_{name}_s"], out[f"{h}_{name}_head_s"] = best[h]
        return out
    finally:
        for e in engines.values():
            e.close()


# -- the driver ---------------------------------------------------------------------------------
def _run_worker(kind: str, name: str, args) -> dict:
    cmd = bu.module_command(sys.executable, "bench_score_head", "--worker", kind, name, "--docs", str(args.docs),
                            "--threads", str(args.threads))
    out = subprocess.run(cmd, cwd=bu.REPO_ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"worker {kind} {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Tau-a: (concordant - discordant) / all pairs; a pair tied in either list counts as neither."""
    a, b = np.asarray(a), np.asarray(b)
    s = np.sign(a[:, None] - a[None, :]) * np.sign(b[:, None] - b[None, :])
    n = len(a)
    return float(s[np.triu_indices(n, 1)].sum() / (n * (n - 1) / 2))


def precision_rows(runs: dict) -> list[dict]:
    ref = runs["reference"]
    out = []
    for variant in VARIANTS:
        r = runs[variant]
        err = np.abs(np.asarray(r["logprobs"]) - np.asarray(ref["logprobs"]))
        probs = r["probs"]
        tied_pairs = sum(1 for i in range(len(probs)) for j in range(i + 1, len(probs)) if probs[i] == probs[j])
        out.append({"variant": variant, "score_head": r["score_head"], "distinct": len(set(probs)), "tied_pairs": tied_pairs,
                    "tau": kendall_tau(probs, ref["probs"]), "lp_err_mean": float(err.mean()), "lp_err_max": float(err.max())})
    return out


def measure(args) -> dict:
    bu.log(f"precision: {args.docs} documents, float32 reference and the bf16 variants, a fresh process each")
    runs = {}
    for variant in ("reference", *VARIANTS):
        runs[variant] = _run_worker("precision", variant, args)
        bu.log(f"  {variant}: {runs[variant]['score_head']}")
    speed = []
    for rep in range(args.reps):
        r = _run_worker("speed", HEADS[rep % 2], args)
        bu.log(f"  process {rep + 1}: " + ", ".join(f"{k} {r[f'model_{k}_s'] * 1e3:.1f} / {r[f'float32_{k}_s'] * 1e3:.1f} ms"
                                                  for k, _ in SPEED_CASES) + " (model / float32)")
        speed.append(r)
    return {**bu.run_info(args.threads), "docs": args.docs, "precision": precision_rows(runs), "speed": speed,
            "scatter": {v: runs[v]["probs"] for v in ("reference", "model", "float32")}}


SPEED_CASES = (("warm_post", "warm post-rec request (1 scored row)"), ("rerank", "rerank (one scored row per document)"),
               ("prompt_logprobs_512", "512-token prompt logprobs (511 rows)"))


def speed_table(speed: list[dict]) -> str:
    """Per workload: each process's fastest run on each head and their ratio, and the LM head's own
    time in those runs: its difference over the model-dtype run's total is the cost of float32
    scores with none of the host's drift in it."""
    rows = []
    for key, label in SPEED_CASES:
        ratios = [r[f"float32_{key}_s"] / r[f"model_{key}_s"] for r in speed]
        head_ms = {h: bu.median([r[f"{h}_{key}_head_s"] * 1e3 for r in speed]) for h in HEADS}
        total_ms = bu.median([r[f"model_{key}_s"] * 1e3 for r in speed])
        rows.append([label, " / ".join(f"{r[f'model_{key}_s'] * 1e3:.1f}" for r in speed),
                     " / ".join(f"{r[f'float32_{key}_s'] * 1e3:.1f}" for r in speed),
                     f"{bu.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                     f"{head_ms['model']:.1f} / {head_ms['float32']:.1f}",
                     f"{(head_ms['float32'] - head_ms['model']) / total_ms * 100:+.1f}%"])
    return bu.markdown_table(["", "bf16 logits (model), ms per process", "float32 head, ms per process",
                              "float32 / model (median, range)", "LM head's own ms, model / float32 (median)",
                              "head difference / model total"], rows)


def report(data: dict) -> str:
    m = data["machine"]
    prec = bu.markdown_table(
        ["bf16 engine", "score head", "distinct scores", "tied pairs", "Kendall tau vs float32 engine",
         "allowed logprob error vs float32, mean", "max"],
        [[r["variant"], r["score_head"], f"{r['distinct']} of {data['docs']}", r["tied_pairs"], f"{r['tau']:.4f}",
          f"{r['lp_err_mean']:.4f}", f"{r['lp_err_max']:.4f}"] for r in data["precision"]])
    head = data["speed"][0]["score_head"]
    lines = [f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Machine: {bu.machine_line(m)}", "",
             f"Precision: {data['docs']} distinct documents reranked by the default model (SmolLM2-135M) as one multi-item "
             "request, bf16 engine against the float32 engine on the same prompts. `model` = the bf16 LM head GEMM then a cast "
             "(the code before issue 46); `float32` = the score head (default); `float32_norm` = also the final norm's rows kept "
             "in float32 (a what-if, not shipped).", "", prec, "",
             f"Speed: bf16, `head_dtype` model vs float32 (the float32 head here: `{head}`): {len(data['speed'])} fresh "
             f"processes, each holding both engines (built in alternating order) and running every workload on them in turn, "
             f"{REPEATS} rounds, the order flipped each round; per process the fastest run of each:", "", speed_table(data["speed"]), ""]
    if PLOT.exists():
        lines += [f"![bf16 relevance vs float32 relevance]({PLOT.relative_to(bu.PERF_DIR).as_posix()})", ""]
    return "\n".join(lines)


def plot(data: dict) -> bool:
    plt = bu.pyplot()
    if plt is None:
        return False
    ref = data["scatter"]["reference"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, variant, title in zip(axes, ("model", "float32"), ("bf16 logits (before)", "float32 score head")):
        ax.scatter(ref, data["scatter"][variant], s=10)
        ax.set_title(f"{title}: {len(set(data['scatter'][variant]))} distinct")
        ax.set_xlabel("relevance, float32 engine")
    axes[0].set_ylabel("relevance, bf16 engine")
    return bu.save_figure(plt, fig, PLOT)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_score_head", description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=100, help="documents reranked (default 100)")
    p.add_argument("--reps", type=int, default=4, help="fresh speed processes, each running both heads in turn (default 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", nargs=2, metavar=("KIND", "NAME"), help="internal: one measurement (precision VARIANT | speed HEAD_BUILT_FIRST)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        kind, name = args.worker
        result = precision_worker(name, args.docs, args.threads) if kind == "precision" else speed_worker(name, args.docs, args.threads)
        print(json.dumps(result))
        return 0
    data = measure(args)
    bu.save_json(RESULTS_JSON, data)
    plot(data)
    bu.replace_section(bu.PERF_DIR / "RESULTS.md", HEADING, report(data))
    bu.log(f"wrote {RESULTS_JSON} and the section '{HEADING[3:]}' of perf/RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
