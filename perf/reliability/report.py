"""The "## Reliability" section of perf/RESULTS.md and the soak's files, from the phases' JSON."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from clients.transport import MODEL, STYLES
from perf import benchutil as bu
from perf.reliability.matrix import MATRIX_TIMEOUT_S, MESSAGE_CHARS
from perf.reliability.soak import mib
from prefillonly.serving.host.server_tree import TRITON_SERVER_VERSION

SECTION = "## Reliability"
STYLE_TITLES = {"http_generate": "HTTP generate", "grpc_stream": "gRPC streaming",
                "http_infer": "HTTP /infer (sync)", "grpc_unary": "gRPC unary (sync)"}


def md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("`", "'")


def render_matrix(data: dict) -> str:
    header = ["case", "expected"] + [STYLE_TITLES[s] for s in STYLES]
    table = []
    for row in data["rows"]:
        cells = []
        for style in STYLES:
            c = row["cells"].get(style)
            if c is None:
                cells.append("n/a")
            else:
                cells.append(("" if c["as_expected"] else "**⚠** ") + md_cell(f"{c['status']} {c['message']}"))
        table.append([md_cell(row["case"]), row["expect"]] + cells)
    flagged = [(row["case"], s) for row in data["rows"] for s, c in row["cells"].items() if not c["as_expected"]]
    notes = [f"- {row['case']}: {row['note']}." for row in data["rows"]
             if row.get("note") and not all(c["as_expected"] for c in row["cells"].values())]
    h = data["health"]
    alive = h["tritonserver_running"] and h["stubs_alive"] and h["envoy_running"] and h["good_request_ok"]
    lines = [
        f"Each case sent once in each call style, through Envoy; a cell is the status (HTTP code; gRPC status name; "
        f"`error`/`ok` on a stream, where an error response carries no status) and the first {MESSAGE_CHARS} characters "
        f"of the message (for an answer: how many results and the first chosen token). **⚠** = not what the case "
        f"expects (an answer to bad input, an error to good input, a 5xx/INTERNAL/UNAVAILABLE status for bad input, "
        f"no answer within {MATRIX_TIMEOUT_S:.0f} s, a broken connection); `any` = either answer is defensible.",
        "",
        bu.markdown_table(header, table),
        "",
        f"Flagged cells: {len(flagged)}" + (": " + "; ".join(f"{md_cell(c)} / {STYLE_TITLES[s]}" for c, s in flagged) if flagged else "") + ".",
        *notes,
        "",
        f"After the matrix: server {'alive' if alive else '**NOT alive**'} (tritonserver running: {h['tritonserver_running']}, "
        f"engine stubs alive: {h['stubs_alive']}, Envoy running: {h['envoy_running']}, a good request: {md_cell(h['good_request'])}), "
        f"restarts = {h['restarts']}" + (" (expected 0)" if h["restarts"] else "") + ".  ",
        "Crash lines in the tritonserver log: " + ("; ".join(md_cell(x) for x in h["log_problems"]) if h["log_problems"] else "none") + ".",
    ]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot_soak(path: Path, soak: dict, summary: dict) -> bool:
    plt = bu.pyplot()
    if plt is None:
        return False
    samples, t_traffic = soak["samples"], soak["t_traffic_s"]
    t = [s["t_s"] - t_traffic for s in samples]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    for role, r in summary["rss"].items():
        label = f"RSS {role}" + (f" ({r['processes']}, summed)" if r.get("processes", 1) > 1 else "")
        ax.plot(t, [(s.get(f"rss {role}") or float("nan")) / 2**20 for s in samples], label=label)
    ax.plot(t, [(s.get("cache_tier1_bytes") or float("nan")) / 2**20 for s in samples], "--", label="prefix cache in use (tier 1)")
    ax.axhline(summary["bound_baseline_bytes"] / 2**20, color="red", linestyle=":",
               label="engine baseline + cache budget + activation peak")
    ax.axhline(summary["bound_budget_bytes"] / 2**20, color="purple", linestyle="-.",
               label="weights + cache budget + activation peak")
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.axvline(soak["t_end_s"] - t_traffic, color="grey", linewidth=0.5)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("MiB")
    ax.set_title(f"Soak: {summary['requests']:,} requests, {summary['users']} users, concurrency {summary['concurrency']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return bu.save_figure(plt, fig, path)


def plateau_line(s: dict) -> str:
    p, fill = s["plateau"], s["cache_fill"]
    if p["rss_growth"] is None:
        return "Plateau: not enough samples.  "
    text = (f"Plateau: the engine stub's max RSS over the last 30% of the run is {p['rss_growth'] / 2**20:+,.0f} MiB "
            f"from its max over the first 70%, while the prefix cache in use grew {p['cache_growth'] / 2**20:+,.0f} MiB: "
            f"**{p['unexplained_growth'] / 2**20:+,.0f} MiB** not explained by the cache. ")
    if fill is not None:
        text += f"The cache filled to {fill:.0%} of its budget"
        text += "." if fill >= 0.95 else " (never full: the bound below is not tested at its limit; more users fill it)."
    return text + "  "


def render_soak(s: dict, plot_link: str | None) -> str:
    b = s["budgets"]
    outcome_rows = [[name, s["outcomes"].get(name, 0)] for name in
                    ("ok", "expected_error", "unexpected_error", "unexpected_ok", "wrong_answer", "lost", "transport")]
    kind_rows = [[k, sum(v.values()), v.get("ok", 0), v.get("expected_error", 0),
                  sum(n for o, n in v.items() if o not in ("ok", "expected_error"))] for k, v in sorted(s["by_kind"].items())]
    lat_rows = [[k, f"{v['p50_s']:.2f}", f"{v['p99_s']:.2f}", f"{v['max_s']:.2f}"] for k, v in s["latency"].items()]
    rss_rows = [[role + (f" ({r['processes']} processes, summed)" if r.get("processes", 1) > 1 else ""), mib(r["baseline"]), mib(r["max_first_30"]), mib(r["max_last_30"]), mib(r["max"]), mib(r["final"]),
                 "-" if not (r["max_last_30"] and r["max_first_70"]) else f"{(r['max_last_30'] - r['max_first_70']) / 2**20:+,.0f}"]
                for role, r in s["rss"].items()]
    engine = s["rss"].get(f"stub {MODEL}", {})
    h = s["health"]
    lines = [
        f"{s['requests']:,} requests in {s['duration_s']:.0f} s ({s['requests_per_s']:.2f} req/s) from {s['users']} users "
        f"(cache namespaces, profiles of {'-'.join(map(str, s.get('profile_tokens', (300, 900))))} tokens), {s['concurrency']} client threads (one request in flight each), "
        f"split between HTTP generate and gRPC streaming; mix: 70% one prompt (profile + a 30-60-token post, "
        f"`cache_prefix_len` = the profile's tokens), 10% multi-item (4 posts), 10% three prompts, 10% bad input "
        f"(5 variants in turn). Engine cache budget: the default ({mib(b.get('cache_tier1'))} MiB tier 1, "
        f"{mib(b.get('cache_tier2'))} MiB tier 2). Prefix hit rate {s['hit_rate']:.0%} "
        f"({s['tokens_cached']:,.0f} of {s['tokens_computed'] + s['tokens_cached']:,.0f} prompt tokens); "
        f"{s['computed_tokens_per_s']:,.0f} computed tokens/s.",
        "",
        bu.markdown_table(["outcome", "requests"], outcome_rows),
        "",
        f"Sent {s['requests']:,}; answered OK {s['answered_ok']:,}; answered with an error {s['answered_error']:,} "
        f"(the bad-input share expects one); **lost {s['lost']}** (no final response within {s['timeout_s']:.0f} s); "
        f"broken connections {s['transport_failures']}.",
        "",
    ]
    if s["unexpected"]:
        lines += ["Unexpected answers:", ""] + [f"- {n} x {md_cell(m)}" for m, n in sorted(s["unexpected"].items(), key=lambda x: -x[1])] + [""]
    lines += [
        bu.markdown_table(["kind / call", "sent", "ok", "expected error", "other"], kind_rows),
        "",
        bu.markdown_table(["kind", "p50 s", "p99 s", "max s"], lat_rows),
        "",
        "RSS (VmRSS, MiB; sampled every second; baseline = median before the first request, right after ready; "
        "growth = max over the last 30% of the run - max over the first 70%):",
        "",
        bu.markdown_table(["process", "baseline", "max first 30%", "max last 30%", "max", "final", "growth"], rss_rows),
        "",
        f"Engine budgets (metrics): weights {mib(b.get('weights'))} MiB, activation budget {mib(b.get('activation'))} MiB, "
        f"cache {mib(b.get('cache_tier1'))} + {mib(b.get('cache_tier2'))} MiB; measured activation peak (max ScoreResult "
        f"`peak_bytes`) {mib(s['activation_peak_bytes'])} MiB; max prefix cache in use {mib(s['max_cache_bytes'])} MiB.  ",
        plateau_line(s),
        f"Bound: engine baseline + cache budget + activation peak = {mib(s['bound_baseline_bytes'])} MiB; the engine stub's "
        f"RSS peaked at {mib(engine.get('max'))} MiB: **{'within' if s['within_bound'] else 'OVER'}** the bound.  ",
        f"Weights + cache budget + activation peak = {mib(s['bound_budget_bytes'])} MiB (no Python/torch runtime): the "
        f"engine stub's peak RSS is {'within' if s['within_budget_bound'] else 'over'} it.  ",
        f"After the soak: tritonserver running {h['tritonserver_running']}, stubs alive {h['stubs_alive']}, Envoy running "
        f"{h['envoy_running']}, restarts = {h['restarts']}; crash lines in the log: "
        + ("; ".join(md_cell(x) for x in h["log_problems"]) if h["log_problems"] else "none") + ".",
    ]
    if plot_link:
        lines += ["", f"![RSS over the soak]({plot_link})"]
    return "\n".join(lines)


def render_faults(f: dict) -> str:
    k, s = f["kill"], f["stop"]
    fmt = lambda counts: ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))  # noqa: E731
    sec = lambda v: "never" if v is None else f"{v:.1f} s"  # noqa: E731
    return "\n".join([
        "| fault | what every request got | recovery |", "|---|---|---|",
        f"| `kill -9` of the engine's process, {k['in_flight']} requests in flight (3 HTTP generate, 3 gRPC streams) | "
        f"{fmt(k['answers'])} | not ready after {sec(k['not_ready_after_s'])}, serving again after "
        f"{sec(k['serving_again_after_s'])} (restarts: {k['restarts']}); next request: {md_cell(k['request_after'])} |",
        f"| stop (SIGTERM to the serve command) with {s['requests']} requests of 3,000 tokens queued, exit timeout "
        f"{s['exit_timeout_secs']} s | {fmt(s['answers'])}; lost: {s['lost']} | stopped in {s['stopped_in_s']:.1f} s |",
    ])


DTYPE_WHY = {"float32": " (not the config's bfloat16: on AVX2-only hosts bf16 matmuls are ~8x slower than fp32, "
                        "which would stretch the soak to many hours)"}


def run_line(phase: dict) -> str:
    """When, how and with what dtype one phase ran (phases may come from different runs)."""
    command = f", command `{phase['command']}`" if phase.get("command") else ""
    return f"Run {phase.get('date', '')}, dtype {phase.get('dtype')}{command}."


def render(out_dir: Path, results_md: Path, meta: dict) -> str:
    matrix, soak = bu.load_json(out_dir / "matrix.json"), bu.load_json(out_dir / "soak.json")
    faults = bu.load_json(out_dir / "faults.json")
    lines = ["Written by `python -m perf.reliability [matrix|faults|soak|all]` (each phase's own command below)  ",
             f"Date: {meta['date']}  ", f"Machine: {bu.machine_line(meta['machine'])}  ",
             f"Stack: Envoy (front door: body limit max_request_bytes = {meta['max_request_bytes']:,} bytes, header stripping) -> tritonserver {TRITON_SERVER_VERSION} (nvidia-pytriton wheel) "
             f"under the serve supervisor (prefillonly.serving.host.supervisor, watchdog on), model_repository/ with the default "
             f"model (SmolLM2-135M), dtype {meta['dtype']}" + DTYPE_WHY.get(meta["dtype"], "") + ", other engine settings as "
             f"in config.pbtxt (default cache budget, default thread count). Raw data: `{meta['out_rel']}/`.", ""]
    if matrix:
        lines += ["### Bad-input matrix", "", run_line(matrix), "",
                  render_matrix(matrix), ""]
    if faults:
        lines += ["### Faults survived", "", run_line(faults), "",
                  render_faults(faults), ""]
    if soak:
        link = os.path.relpath(out_dir / "soak_rss.png", results_md.parent) if (out_dir / "soak_rss.png").is_file() else None
        lines += ["### Soak", "", run_line(soak), "", render_soak(soak["summary"], link), ""]
    return "\n".join(lines)


def print_soak(summary: dict) -> None:
    keys = ("requests", "duration_s", "requests_per_s", "outcomes", "lost", "transport_failures", "hit_rate",
            "computed_tokens_per_s", "activation_peak_bytes", "engine_max_rss", "bound_baseline_bytes", "within_bound",
            "within_budget_bound", "cache_fill", "plateau")
    print(json.dumps({k: summary[k] for k in keys}, indent=1, default=str), flush=True)
    for role, r in summary["rss"].items():
        print(f"  RSS {role} ({r['processes']} process(es)): "
              + ", ".join(f"{k} {mib(v)} MiB" for k, v in r.items() if k != "processes"), flush=True)
