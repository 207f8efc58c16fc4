"""Before and after a change that must not move any answer, on this host in one run: the offline
traces and one load level, served by two revisions of this repository, interleaved (before, after,
before, after), each run a fresh process, and every answer compared bit for bit.

    python -m perf.compare_trees --before 4986e50 [--after HEAD] [--reps 2] [--qps 1.5]

Each revision is checked out into a worktree under --work (never this checkout, whose
perf/results the runs would overwrite) and runs with its own package: a thin virtual environment
per revision whose .pth puts that worktree's src/ ahead of this environment's site-packages, so
that tritonserver's Python stub (which ignores PYTHONPATH) imports that revision's code too. Each
tree compiles the CPU kernels into its own torch extensions directory. The commands each tree
runs are perf/eval.py's: `offline --reps 1 --skip vllm,transformers` and `load --skip vllm --qps Q
--factors 1` (one level at the same rate for both), with --dtype. Writes --out (JSON: every run's wall time and
the answer comparison) and prints a Markdown table for perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from perf import benchutil as bu

ROOT = bu.REPO_ROOT


def checkout(rev: str, work: Path, name: str) -> Path:
    """A detached worktree of `rev` at work/name (made afresh)."""
    tree = work / name
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
    return tree


def thin_venv(tree: Path, work: Path, name: str) -> Path:
    """A venv whose python imports prefillonly from `tree` and everything else from this one's."""
    venv = work / f"venv-{name}"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)], check=True)
    pkg = work / f"pkg-{name}"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir(parents=True)
    (pkg / "prefillonly").symlink_to(tree / "src")
    here = sysconfig.get_paths()["purelib"]
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "compare_trees.pth").write_text(f"{pkg}\nimport site; site.addsitedir({here!r})\n")
    return venv / "bin" / "python"


def prepare_trees(before: str, after: str, work: Path) -> tuple[dict, dict]:
    """({"before": tree, "after": tree}, their pythons): each revision's worktree and thin venv under `work`."""
    work.mkdir(parents=True, exist_ok=True)
    trees = {name: checkout(rev, work, name) for name, rev in (("before", before), ("after", after))}
    return trees, {name: thin_venv(tree, work, name) for name, tree in trees.items()}


def run_eval(python: Path, tree: Path, args: list[str], ext_dir: Path, timeout_s: float) -> dict:
    """`python -m perf.eval ARGS` in `tree`; the JSON it wrote (perf/results/eval/<what>.json)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    t0 = time.perf_counter()
    subprocess.run([str(python), "-m", "perf.eval", *args], cwd=tree, env=env, check=True, timeout=timeout_s)
    bu.log(f"  {tree.name}: perf.eval {' '.join(args)}: {time.perf_counter() - t0:.0f} s")
    dtype = args[args.index("--dtype") + 1]
    folder = "eval" if dtype == "bfloat16" else f"eval-{dtype}"  # perf/eval.py's results_dir
    written = tree / "perf" / "results" / folder / f"{args[0]}.json"
    kept = tree.parent / "runs" / f"{tree.name}_{args[0]}_{int(time.time())}.json"  # the next run overwrites `written`
    kept.parent.mkdir(exist_ok=True)
    shutil.copy(written, kept)
    return json.loads(written.read_text())


def offline_answers(data: dict) -> dict:
    """(workload, request id) -> (prompt tokens, cached tokens, chosen id, allowed logprobs)."""
    return {(r["workload"], p["request_id"]): (p["prompt_tokens"], p["cached_tokens"], p["chosen"], p["allowed_logprobs"])
            for r in data["runs"] if "error" not in r for p in r["per_request"]}


def load_answers(data: dict) -> dict:
    """request id -> (cached tokens, logprobs) of every answered request of the load run."""
    levels = [lv for lv in data["levels"] if lv.get("system") == "ours"]
    return {o["request_id"]: (o["cached_tokens"], o["logprobs"]) for lv in levels for o in lv["outcomes"] if o["ok"]}


def compare(a: dict, b: dict) -> dict:
    """Requests in both, those whose answer (every field) differs at all, and the largest logprob gap."""
    common = sorted(set(a) & set(b))
    return {"requests": len(common), "only_one_side": len(set(a) ^ set(b)),
            "differ": sum(a[k] != b[k] for k in common),
            "max_logprob_gap": bu.max_logprob_gap({k: a[k][-1] for k in common}, {k: b[k][-1] for k in common})}


def add_tree_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The two revisions a before/after script builds with prepare_trees, where their worktrees and
    venvs go (/tmp/prefillonly-<name>) and its results (perf/results/<name>.json)."""
    p.add_argument("--before", required=True, help="the revision before the change")
    p.add_argument("--after", default="HEAD", help="the revision after it (default HEAD)")
    p.add_argument("--work", default=f"/tmp/prefillonly-{name.replace('_', '-')}", help="where the worktrees and venvs go")
    p.add_argument("--out", default=str(bu.PERF_DIR / "results" / f"{name}.json"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.compare_trees", description=__doc__.split("\n\n")[0])
    add_tree_arguments(p, "compare_trees")
    p.add_argument("--reps", type=int, default=2, help="offline runs per tree, interleaved (default 2)")
    p.add_argument("--qps", type=float, default=1.5, help="the load level both trees are offered (req/s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both trees' dtype (default float32: what an AVX2-only host computes natively)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per perf.eval command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(args.work)
    trees, pythons = prepare_trees(args.before, args.after, work)
    ext = {name: work / f"ext-{name}" for name in trees}
    runs = {"before": {"offline": [], "load": []}, "after": {"offline": [], "load": []}}
    for rep in range(args.reps):
        for name in ("before", "after"):
            bu.log(f"offline rep {rep + 1}/{args.reps}, {name}")
            runs[name]["offline"].append(run_eval(pythons[name], trees[name], ["offline", "--reps", "1", "--skip", "vllm,transformers",
                                                                                   "--dtype", args.dtype],
                                                  ext[name], args.timeout))
    for name in ("before", "after"):
        bu.log(f"load at {args.qps} req/s, {name}")
        runs[name]["load"].append(run_eval(pythons[name], trees[name], ["load", "--skip", "vllm", "--qps", str(args.qps),
                                                                          "--factors", "1", "--dtype", args.dtype], ext[name], args.timeout))
    result = summarize(args, trees, runs)
    bu.save_json(Path(args.out), result)
    print(table(result))
    return 0


def summarize(args, trees: dict, runs: dict) -> dict:
    revs = {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
            for name, tree in trees.items()}
    walls = {name: {w: [r["wall_s"] for d in runs[name]["offline"] for r in d["runs"] if r.get("workload") == w and "wall_s" in r]
                    for w in ("post_rec", "credit")} for name in runs}
    loads = {name: [lv["summary"] for d in runs[name]["load"] for lv in d["levels"] if lv.get("system") == "ours"]
             for name in runs}
    before_offline = offline_answers(runs["before"]["offline"][0])
    offline = [compare(before_offline, offline_answers(d)) for name in ("before", "after") for d in runs[name]["offline"]]
    load = compare(load_answers(runs["before"]["load"][0]), load_answers(runs["after"]["load"][0]))
    return {"what": "compare_trees", "command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(2),
            "revisions": revs, "qps": args.qps, "dtype": args.dtype, "offline_wall_s": walls, "load_summaries": loads,
            "offline_answers_vs_first_before_run": offline, "load_answers_after_vs_before": load}


def table(r: dict) -> str:
    lines = [f"before {r['revisions']['before']}, after {r['revisions']['after']}; {bu.machine_line(r['machine'])}", "",
             "| run | before | after | after / before |", "|---|---|---|---|"]
    for w in ("post_rec", "credit"):
        b, a = r["offline_wall_s"]["before"][w], r["offline_wall_s"]["after"][w]
        lines.append(f"| offline {w} wall (s) | {' / '.join(f'{x:.2f}' for x in b)} | {' / '.join(f'{x:.2f}' for x in a)} | "
                     f"{bu.median(a) / bu.median(b):.3f} (median) |")
    (lb,), (la,) = r["load_summaries"]["before"], r["load_summaries"]["after"]
    lines.append(f"| load at {r['qps']} req/s: ok, mean / P99 (s) | {lb['ok']}/{lb['requests']}, {lb['mean_latency_s']:.2f} / "
                 f"{lb['p99_latency_s']:.2f} | {la['ok']}/{la['requests']}, {la['mean_latency_s']:.2f} / {la['p99_latency_s']:.2f} | "
                 f"{la['mean_latency_s'] / lb['mean_latency_s']:.2f} / {la['p99_latency_s'] / lb['p99_latency_s']:.2f} |")
    worst = max(c["max_logprob_gap"] for c in r["offline_answers_vs_first_before_run"])
    differ = sum(c["differ"] + c["only_one_side"] for c in r["offline_answers_vs_first_before_run"])
    lines.append(f"| offline answers, every run vs the first 'before' run | | | {differ} differ, max logprob gap {worst} |")
    ld = r["load_answers_after_vs_before"]
    lines.append(f"| load answers, after vs before ({ld['requests']} requests in both) | | | {ld['differ']} differ, "
                 f"max logprob gap {ld['max_logprob_gap']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
