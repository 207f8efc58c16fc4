"""Engine-core benchmark: matmul ceiling, cold prefill speed and peak memory vs transformers.

Run from the repository root with the project's venv:

    .venv/bin/python -m perf.bench_core             # full run: tens of minutes on 2 cores
    .venv/bin/python -m perf.bench_core --quick     # smoke test of this script (a few minutes)

Options: --threads N (default 2), --skip-speed, --skip-memory, --reps, --budget-gib,
--peak-timeout. A full run writes the "## Engine core" section of perf/RESULTS.md
(other sections are kept), perf/results/core.json and, if matplotlib is installed,
perf/results/core.png. A run with --skip-* keeps the stored results of the part it skipped.
--quick writes the same files under perf/out/quick/ (git-ignored) so it never overwrites
real results.

What is measured (docs/design.md §7, §10):
  1. torch matmul rate, fp32 and bf16, on shapes of the model and 2048^3; the max bf16 rate is
     "the machine's bf16 matmul rate" (the harder denominator).
  2. Cold prefill tokens/s at 512/2K/8K tokens, ours (executor.forward alone) and transformers
     (`model(ids, logits_to_keep=1, use_cache=False)`) side by side in one process, same
     threads, same fresh random token ids per repetition; median of the repetitions.
  3. Peak memory growth per prompt length, each (system, length) in a fresh subprocess:
     load, warm up, reset the RSS high-water mark, read VmRSS, forward, read VmHWM.
  4. Max input length at a memory budget from a linear fit of growth over the lengths measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from perf import benchutil as bu
from prefillonly.model.spec import ModelSpec

SECTION = "## Engine core"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# [M, K] x [K, N]: one chunk's MLP up projection at 512 and 2048 tokens, the down projection,
# and a big square one.
MATMUL_SHAPES = [(512, 576, 3072), (2048, 576, 3072), (2048, 1536, 576), (2048, 2048, 2048)]
SPEED_LENGTHS = [512, 2048, 8192]
MEMORY_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SPEED_LENGTHS = [512]
QUICK_MEMORY_LENGTHS = [1024, 2048]
MAX_REPS_AT_8K = 2  # an 8K forward takes tens of seconds per system on 2 cores
# memory systems -> chunk_size of our engine (0 = unchunked); None = transformers
MEMORY_SYSTEMS = {"hybrid": 2048, "hybrid-inplace": 2048, "unchunked": 0, "transformers": None}
INPLACE_SYSTEMS = {"hybrid-inplace"}  # attention written over Q block by block (the engine's low-memory mode)
MEMORY_DTYPE = "bfloat16"
# MIL fit over the longest measured lengths only: per-token buffers dominate there, while at
# 1-4K tokens allocator and kernel-workspace effects of a few MiB distort the slope.
FIT_POINTS = 3
SEED = 1234


# -- shared model plumbing ---------------------------------------------------------------
def random_ids(generator: torch.Generator, vocab_size: int, n: int) -> torch.Tensor:
    """Fresh random token ids: a cold prompt that no cache has seen."""
    return torch.randint(0, vocab_size, (n,), generator=generator, dtype=torch.long)


def load_transformers(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def transformers_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' best prefill-only call: no KV cache, logits of the last position only."""
    with torch.inference_mode():
        return model(ids[None], logits_to_keep=1, use_cache=False).logits[0, -1].float()


def ours_forward(engine, ids: torch.Tensor) -> torch.Tensor:
    return engine.executor.forward(ids, engine.config.chunk_size).logits


# -- 1. matmul rate ------------------------------------------------------------------------
def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, weight_transposed: bool, seconds: float, windows: int = 5) -> float:
    """Median FLOP/s over `windows` timing windows. Not the best window: this shared host has
    bursts of 2x (seen: 2.2 TFLOP/s for a minute, ~0.9 otherwise), and the prefill runs that
    this rate divides are medians too."""
    x = torch.randn(m, k).to(dtype)
    # x @ W.T with W [N, K] is how nn.Linear (and our executor) multiplies; x @ W with W [K, N] the plain one
    w = torch.randn(n, k).to(dtype).t() if weight_transposed else torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.matmul(x, w, out=out)  # warm-up: kernel selection, first-touch page faults
    rates = []
    for _ in range(windows):
        iters, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(x, w, out=out)
            iters += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / windows:
                break
        rates.append(2 * m * k * n * iters / elapsed)
    return sorted(rates)[len(rates) // 2]


def measure_matmul(seconds_per_shape: float) -> dict:
    rows = []
    for m, k, n in MATMUL_SHAPES:
        row = {"shape": f"[{m},{k}]x[{k},{n}]"}
        for name, dtype in DTYPES.items():
            row[name] = max(matmul_rate(m, k, n, dtype, t, seconds_per_shape / 2) for t in (False, True))
        rows.append(row)
        bu.log(f"matmul {row['shape']}: fp32 {row['float32'] / 1e9:.0f} GFLOP/s, bf16 {row['bfloat16'] / 1e9:.0f} GFLOP/s")
    peak = {name: max(r[name] for r in rows) for name in DTYPES}
    bu.log(f"machine matmul rate (max over shapes): fp32 {peak['float32'] / 1e9:.0f}, bf16 {peak['bfloat16'] / 1e9:.0f} GFLOP/s")
    return {"rows": rows, "peak": peak}


# -- 2. prefill speed ------------------------------------------------------------------------
def reps_for(length: int, reps: int) -> int:
    return min(reps, MAX_REPS_AT_8K) if length >= 8192 else reps


def timed(fn, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    logits = fn(ids)
    return time.perf_counter() - t0, logits


def measure_prefill(lengths: list[int], reps: int, threads: int, matmul_peak: dict) -> list[dict]:
    from prefillonly import Engine, EngineConfig

    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for dtype_name in DTYPES:
        engine = Engine(EngineConfig(dtype=dtype_name, threads=threads))
        model = load_transformers(engine.model_path, engine.dtype)
        systems = {"ours": lambda ids: ours_forward(engine, ids), "transformers": lambda ids: transformers_forward(model, ids)}
        vocab = engine.spec.vocab_size
        for fn in systems.values():
            fn(random_ids(generator, vocab, 512))  # warm-up: kernel selection, allocator
        bu.log(f"prefill {dtype_name}: engine and transformers loaded, warmed up")
        for s in lengths:
            times = {name: [] for name in systems}
            gap = None
            for rep in range(reps_for(s, reps)):
                ids = random_ids(generator, vocab, s)
                order = list(systems) if rep % 2 == 0 else list(systems)[::-1]  # alternate who runs first
                logits = {}
                for name in order:
                    seconds, logits[name] = timed(systems[name], ids)
                    times[name].append(seconds)
                # sanity check that both computed the same thing (not a test: a fast wrong path shows here)
                logprobs = {name: torch.log_softmax(out.float(), -1).tolist() for name, out in logits.items()}
                gap = bu.max_logprob_gap(logprobs["ours"], logprobs["transformers"])
            rows.append(prefill_row(dtype_name, s, times, gap, engine.spec.flops(s), matmul_peak[dtype_name]))
            r = rows[-1]
            bu.log(
                f"prefill {dtype_name} {s:>5} tokens: ours {r['ours_tok_s']:.0f} tok/s ({r['ours_fraction']:.0%} of matmul rate), "
                f"transformers {r['transformers_tok_s']:.0f} tok/s, ratio {r['ratio']:.2f}x, max |dlogprob| {gap:.3f}"
            )
        del engine, model, systems
        gc.collect()
    return rows


def prefill_row(dtype_name: str, s: int, times: dict, gap: float, flops: int, peak_rate: float) -> dict:
    ours, hf = bu.median(times["ours"]), bu.median(times["transformers"])
    return {
        "dtype": dtype_name,
        "tokens": s,
        "reps": len(times["ours"]),
        "ours_s": times["ours"],
        "transformers_s": times["transformers"],
        "ours_tok_s": s / ours,
        "transformers_tok_s": s / hf,
        "ratio": hf / ours,  # ours tok/s over transformers tok/s
        "flops": flops,
        "ours_fraction": flops / ours / peak_rate,
        "transformers_fraction": flops / hf / peak_rate,
        "max_logprob_gap": gap,
    }


# -- 3. peak memory, one fresh process per (system, length) ---------------------------------
def run_peak_subprocess(system: str, length: int, threads: int, timeout_s: int) -> dict:
    """One (system, length) measurement by `python -m prefillonly.worker.memory_probe` in a fresh process."""
    return run_memory_probe(system, length, threads, timeout_s, chunk=MEMORY_SYSTEMS[system] or 0,
                            dtype=MEMORY_DTYPE, inplace=system in INPLACE_SYSTEMS)


def run_memory_probe(system: str, tokens: int, threads: int, timeout_s: float, chunk: int, dtype: str = "bfloat16",
                     inplace: bool = False, random_config: dict | None = None) -> dict:
    """`python -m prefillonly.worker.memory_probe` in a fresh process (docs/design.md §7's peak-growth measure):
    {growth_bytes, seconds, predicted_bytes, process_s} or {error}. system "transformers" or ours."""
    cmd = [sys.executable, "-m", "prefillonly.worker.memory_probe", "--tokens", str(tokens), "--dtype", dtype,
           "--threads", str(threads), "--system", "transformers" if system == "transformers" else "prefillonly",
           "--chunk-size", str(chunk)]
    cmd += ["--random-config", json.dumps(random_config)] if random_config else []
    cmd += ["--inplace-attention"] if inplace else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=bu.REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    results = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not results:
        killed = " (killed by signal 9: likely out of memory)" if proc.returncode == -9 else ""
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"exit {proc.returncode}{killed}: {tail}"}
    r = json.loads(results[-1])
    return {"growth_bytes": r["measured_bytes"], "seconds": r["seconds"], "predicted_bytes": r.get("predicted_bytes"),
            "process_s": time.perf_counter() - t0}


def measure_memory(lengths: list[int], threads: int, timeout_s: int, systems: list[str]) -> list[dict]:
    points = []
    for system in systems:
        failed_at = None
        for s in lengths:
            point = {"system": system, "tokens": s}
            if failed_at is not None:
                point["error"] = f"skipped: failed at {failed_at} tokens"
            else:
                point.update(run_peak_subprocess(system, s, threads, timeout_s))
                failed_at = s if "error" in point else None
            points.append(point)
            bu.log(f"memory {system:>12} {s:>6} tokens: {describe_point(point)}")
    return points


def describe_point(point: dict) -> str:
    if "error" in point:
        return point["error"]
    text = f"growth {point['growth_bytes'] / 2**20:.1f} MiB in {point['seconds']:.1f} s"
    if point.get("predicted_bytes"):
        text += f" (engine predicts {point['predicted_bytes'] / 2**20:.1f} MiB)"
    return text


# -- 4. max input length at a budget ---------------------------------------------------------
def fit_growth(points: list[dict], budget_bytes: int) -> dict | None:
    """Least-squares growth = fixed + bytes/token · S over the FIT_POINTS longest points, and the
    largest S within the budget; None for fewer than 2 points or a growth that does not grow."""
    import numpy as np

    fitted = sorted(points, key=lambda p: p["tokens"])[-FIT_POINTS:]
    if len(fitted) < 2:
        return None
    per_token, fixed = np.polyfit([p["tokens"] for p in fitted], [p["growth_bytes"] for p in fitted], 1)
    if per_token <= 0:
        return None
    mil = int((budget_bytes - fixed) / per_token)
    return {"bytes_per_token": float(per_token), "fixed_bytes": float(fixed), "mil": mil,
            "fit_lengths": [p["tokens"] for p in fitted], "growth_at_mil_plus_1": float(fixed + per_token * (mil + 1))}


def max_input_lengths(points: list[dict], budget_bytes: int, spec) -> list[dict]:
    from prefillonly.worker.memory import predict_peak_bytes

    rows = []
    for system, chunk in MEMORY_SYSTEMS.items():
        ok = [p for p in points if p["system"] == system and "error" not in p]
        row = {"system": system, "budget_bytes": budget_bytes}
        fit = fit_growth(ok, budget_bytes)
        if fit:
            longest = fit["fit_lengths"][-1]
            fit_range = f"fit over {', '.join(f'{x // 1024}K' for x in fit['fit_lengths'])}"
            row.update(bytes_per_token=fit["bytes_per_token"], fixed_bytes=fit["fixed_bytes"], mil_fit=fit["mil"],
                       fit_lengths=fit["fit_lengths"], basis=f"measured range ({fit_range})" if fit["mil"] <= longest
                       else f"extrapolated from measured points up to {longest // 1024}K ({fit_range})")
        within = [p["tokens"] for p in ok if p["growth_bytes"] <= budget_bytes]
        row["longest_measured_within_budget"] = max(within, default=None)
        if chunk is not None:
            inplace = system in INPLACE_SYSTEMS
            row["mil_predicted"] = largest_length_within(
                lambda s: predict_peak_bytes(spec, s, chunk or None, DTYPES[MEMORY_DTYPE], inplace_attention=inplace), budget_bytes)
        rows.append(row)
        bu.log(f"MIL at {budget_bytes / 2**30:g} GiB, {system}: {row.get('mil_fit')} tokens ({row.get('basis', 'too few points')})")
    return rows


def largest_length_within(peak_of, budget_bytes: int, upper: int = 1 << 24) -> int:
    """Largest S with peak_of(S) <= budget (peak_of increasing in S), by bisection."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak_of(mid) <= budget_bytes else (lo, mid - 1)
    return lo


# -- 5. report -------------------------------------------------------------------------------
def mib(n) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f}"


def render_speed(part: dict, spec_info: dict) -> str:
    matmul, peak = part["matmul"], part["matmul"]["peak"]
    lines = [
        f"Command: `{part['command']}`  \nDate: {part['date']}  \nMachine: {bu.machine_line(part['machine'])}",
        "",
        "**Matmul rate** (torch, GFLOP/s; median of 5 timing windows, best of the `x @ W` and `x @ W.T` layouts). This host bursts: the same shape measured 0.65-0.9 TFLOP/s at some times and 2.0-2.4 at others within the hour, so compare only numbers from one run:",
        "",
        bu.markdown_table(["shape", "fp32", "bf16"], [[r["shape"], f"{r['float32'] / 1e9:.0f}", f"{r['bfloat16'] / 1e9:.0f}"] for r in matmul["rows"]]),
        "",
        f"The machine's bf16 matmul rate (max above): **{peak['bfloat16'] / 1e9:.0f} GFLOP/s**; fp32: {peak['float32'] / 1e9:.0f} GFLOP/s.",
        "",
        "**Cold prefill** (median of reps; fresh random token ids each rep, the same ids for both systems; ours = "
        "`engine.executor.forward` alone, transformers = `model(ids, logits_to_keep=1, use_cache=False)` under "
        "`torch.inference_mode()`; % = model FLOPs / time / the same dtype's matmul rate above):",
        "",
    ]
    header = ["dtype", "tokens", "reps", "ours tok/s", "transformers tok/s", "ours / transformers", "ours % of matmul rate", "transformers %", "max abs Δ logprob"]
    rows = [
        [r["dtype"], r["tokens"], r["reps"], f"{r['ours_tok_s']:.0f}", f"{r['transformers_tok_s']:.0f}", f"{r['ratio']:.2f}×",
         f"{r['ours_fraction']:.0%}", f"{r['transformers_fraction']:.0%}", f"{r['max_logprob_gap']:.3f}"]
        for r in part["prefill"]
    ]
    lines += [bu.markdown_table(header, rows), ""]
    lines.append(
        f"Model FLOPs per request (docs/design.md §7, no cached prefix): 2·N·S + 2·L·d·S² + 2·hidden·vocab, with "
        f"N = {spec_info['N']:,} non-embedding parameters, L = {spec_info['L']}, d = heads × head_dim = {spec_info['d']}, vocab = {spec_info['vocab']:,}. "
        "Δ logprob is the largest difference of the two systems' full-vocabulary log-probabilities (last rep): ~0 in fp32; in bf16 "
        "a few tenths is rounding (each system's bf16 differs from an fp32 reference by about as much)."
    )
    return "\n".join(lines)


def render_memory(part: dict) -> str:
    by = {(p["system"], p["tokens"]): p for p in part["points"]}
    lengths = sorted({p["tokens"] for p in part["points"]})

    def cell(system, s, key="growth_bytes"):
        p = by.get((system, s))
        if p is None:
            return "—"
        if "error" in p:
            return "failed" if key == "growth_bytes" else "—"
        return mib(p.get(key)) if key != "seconds" else f"{p['seconds']:.1f}"

    header = ["tokens", "hybrid (chunk 2048)", "hybrid predicted", "hybrid, in-place attention", "in-place predicted",
              "unchunked", "unchunked predicted", "transformers"]
    rows = [
        [s, cell("hybrid", s), cell("hybrid", s, "predicted_bytes"), cell("hybrid-inplace", s),
         cell("hybrid-inplace", s, "predicted_bytes"), cell("unchunked", s), cell("unchunked", s, "predicted_bytes"),
         cell("transformers", s)]
        for s in lengths
    ]
    time_rows = [[s] + [cell(system, s, "seconds") for system in MEMORY_SYSTEMS] for s in lengths]
    budget = part["budget_bytes"]
    mil_rows = [
        [m["system"], f"{m['bytes_per_token']:,.0f}" if "bytes_per_token" in m else "—", mib(m.get("fixed_bytes")),
         f"{m['mil_fit']:,}" if m.get("mil_fit") else "—", m.get("basis", "too few measured points"),
         m["longest_measured_within_budget"] or "—", f"{m['mil_predicted']:,}" if m.get("mil_predicted") else "—"]
        for m in part["mil"]
    ]
    failures = [f"- {p['system']} at {p['tokens']} tokens: {p['error']}" for p in part["points"] if "error" in p]
    lines = [
        f"Command: `{part['command']}`  \nDate: {part['date']}  \nMachine: {bu.machine_line(part['machine'])}",
        "",
        f"**Peak memory growth** ({MEMORY_DTYPE}, MiB). Each (system, length) in a fresh process: load the model, warm up on "
        "16 tokens (`python -m prefillonly.worker.memory_probe`), `echo 5 > /proc/self/clear_refs`, read VmRSS, run one forward, read VmHWM; growth = "
        "VmHWM − VmRSS before (docs/design.md §7). \"predicted\" is `prefillonly.worker.memory.predict_peak_bytes` for the same request.",
        "",
        bu.markdown_table(header, rows),
        "",
        "Forward time in those runs (s, one cold run each):",
        "",
        bu.markdown_table(["tokens", *MEMORY_SYSTEMS], time_rows),
        "",
        f"**Max input length at {budget / 2**30:g} GiB** of growth: least-squares fit growth = fixed + bytes/token · S over the "
        f"{FIT_POINTS} longest measured lengths, then the largest S with growth ≤ the budget. \"engine's prediction\" is the largest S "
        "whose `predict_peak_bytes` fits the budget (what the engine's admission would allow).",
        "",
        bu.markdown_table(["system", "bytes/token (fit)", "fixed MiB (fit)", "MIL (fit)", "basis", "longest measured within budget", "engine's prediction"], mil_rows),
    ]
    if failures:
        lines += ["", "Failed or skipped runs:", "", *failures]
    return "\n".join(lines)


def render_section(data: dict, plot_name: str | None) -> str:
    parts = [
        "SmolLM2-135M-Instruct (the default model), CPU, batch 1, cold prompts of random token ids. "
        "Written by `perf/bench_core.py`; raw data in `results/core.json`.",
    ]
    if "speed" in data:
        parts += ["### Matmul rate and cold prefill speed", render_speed(data["speed"], data["spec"])]
    if "memory" in data:
        parts += ["### Peak memory and max input length", render_memory(data["memory"])]
    if plot_name:
        parts.append(f"![engine core: peak memory and prefill speed](results/{plot_name})")
    return "\n\n".join(parts)


def plot(data: dict, path: Path) -> bool:
    """Memory growth and prefill speed vs prompt length; False (tables only) without matplotlib."""
    plt = bu.pyplot()
    if plt is None:
        return False
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    if "memory" in data:
        plot_memory(ax_mem, data["memory"])
    if "speed" in data:
        plot_speed(ax_speed, data["speed"])
    return bu.save_figure(plt, fig, path)


def plot_memory(ax, part: dict) -> None:
    for system in MEMORY_SYSTEMS:
        ok = [p for p in part["points"] if p["system"] == system and "error" not in p]
        if not ok:
            continue
        (line,) = ax.plot([p["tokens"] for p in ok], [p["growth_bytes"] / 2**20 for p in ok], "o-", label=system)
        if ok[0].get("predicted_bytes"):
            ax.plot([p["tokens"] for p in ok], [p["predicted_bytes"] / 2**20 for p in ok], "--", color=line.get_color(), alpha=0.6, label=f"{system} predicted")
    ax.axhline(part["budget_bytes"] / 2**20, color="grey", lw=0.8, ls=":", label=f"{part['budget_bytes'] / 2**30:g} GiB budget")
    ax.set(yscale="log", ylabel="peak RSS growth (MiB)", title=f"Peak memory growth ({MEMORY_DTYPE})")
    token_axis(ax, [p["tokens"] for p in part["points"]])
    ax.legend(fontsize=8)


def plot_speed(ax, part: dict) -> None:
    for dtype_name, style in zip(DTYPES, ("s--", "o-")):
        rows = [r for r in part["prefill"] if r["dtype"] == dtype_name]
        for system, color in (("ours", "tab:blue"), ("transformers", "tab:green")):
            ax.plot([r["tokens"] for r in rows], [r[f"{system}_tok_s"] for r in rows], style, color=color, label=f"{system} {dtype_name}")
    ax.set(ylabel="tokens/s", title="Cold prefill speed (median)")
    token_axis(ax, [r["tokens"] for r in part["prefill"]])
    ax.legend(fontsize=8)


def token_axis(ax, lengths: list[int]) -> None:
    """Log x axis with a tick at each measured length, labelled 512, 1K, 2K, ..."""
    ticks = sorted(set(lengths))
    ax.set(xscale="log", xlabel="prompt tokens")
    ax.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
    ax.minorticks_off()


def write_results(data: dict, out_root: Path) -> None:
    json_path = out_root / "results" / "core.json"
    bu.save_json(json_path, data)
    plot_name = "core.png" if plot(data, out_root / "results" / "core.png") else None
    md_path = out_root / "RESULTS.md"
    bu.replace_section(md_path, SECTION, render_section(data, plot_name))
    bu.log(f"wrote {md_path}, {json_path}" + (f", {out_root / 'results' / plot_name}" if plot_name else ""))


# -- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-systems", default=",".join(MEMORY_SYSTEMS),
                   help="systems of the memory part to (re)measure; the others keep their stored points")
    p.add_argument("--quick", action="store_true", help="tiny run to test the script: 512 tokens, one rep, memory at 1K/2K; writes under perf/out/quick/")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system (default 2)")
    p.add_argument("--skip-speed", action="store_true", help="skip the matmul rate and prefill speed part")
    p.add_argument("--skip-memory", action="store_true", help="skip the peak memory and max input length part")
    p.add_argument("--reps", type=int, default=3, help=f"repetitions per length (at most {MAX_REPS_AT_8K} at 8K); median reported")
    p.add_argument("--budget-gib", type=float, default=1.0, help="memory budget for the max input length (default 1 GiB)")
    p.add_argument("--peak-timeout", type=int, default=1800, help="seconds allowed per memory subprocess (default 1800)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    out_root = bu.PERF_DIR / "out" / "quick" if a.quick else bu.PERF_DIR
    data = bu.load_json(out_root / "results" / "core.json")  # keeps the part a --skip-* run skips
    spec = ModelSpec.from_folder(bu.default_model_dir())
    data["spec"] = {"N": spec.non_embedding_params(), "L": spec.num_layers, "d": spec.num_heads * spec.head_dim, "vocab": spec.vocab_size}
    run_info = {**bu.run_info(a.threads), "quick": a.quick}
    bu.log(f"machine: {bu.machine_line(run_info['machine'])}")

    if not a.skip_speed:
        matmul = measure_matmul(seconds_per_shape=0.4 if a.quick else 2.0)
        lengths, reps = (QUICK_SPEED_LENGTHS, 1) if a.quick else (SPEED_LENGTHS, a.reps)
        prefill = measure_prefill(lengths, reps, a.threads, matmul["peak"])
        data["speed"] = {**run_info, "matmul": matmul, "prefill": prefill}
    if not a.skip_memory:
        lengths = QUICK_MEMORY_LENGTHS if a.quick else MEMORY_LENGTHS
        systems = [x for x in a.memory_systems.split(",") if x]
        unknown = set(systems) - set(MEMORY_SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown memory systems {sorted(unknown)}; known: {', '.join(MEMORY_SYSTEMS)}")
        kept = [p for p in data.get("memory", {}).get("points", []) if p["system"] not in systems]
        points = kept + measure_memory(lengths, a.threads, a.peak_timeout, systems)
        budget = int(a.budget_gib * 2**30)
        data["memory"] = {**run_info, "budget_bytes": budget, "points": points, "mil": max_input_lengths(points, budget, spec)}
    write_results(data, out_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
