"""`python -m perf.reliability [matrix|faults|soak|all]`: see the package's docstring."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import perf.reliability
from clients.transport import STYLES
from perf import benchutil as bu
from perf.reliability.faults import run_faults
from perf.reliability.matrix import matrix_cases, run_matrix
from perf.reliability.report import SECTION, plot_soak, print_soak, render, render_matrix, write_csv
from perf.reliability.soak import make_jobs, make_users, run_soak, summarise_soak, token_counter
from perf.reliability.stack import Stack


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.reliability", description=perf.reliability.__doc__.split("\n\n")[0])
    p.add_argument("phase", nargs="?", default="all", choices=("matrix", "faults", "soak", "all"))
    p.add_argument("--quick", action="store_true", help="200 requests, 20 users; results under --out only")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=None, help="soak requests (default 3000, quick 200)")
    p.add_argument("--users", type=int, default=None, help="soak users = cache namespaces (default 400, quick 20)")
    p.add_argument("--concurrency", type=int, default=8, help="soak client threads")
    p.add_argument("--profile-tokens", type=int, nargs=2, default=(300, 900), metavar=("LO", "HI"),
                   help="length range of the users' profiles in tokens (default 300 900)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without a final response = lost")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default perf/results/reliability (quick: perf/out/reliability_quick)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.requests = args.requests or (200 if args.quick else 3000)
    args.users = args.users or (20 if args.quick else 400)
    out_dir = Path(args.out) if args.out else bu.PERF_DIR / ("out/reliability_quick" if args.quick else "results/reliability")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results_md = out_dir / "RESULTS.md" if args.quick else bu.PERF_DIR / "RESULTS.md"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks: stacks stop

    import torch

    from prefillonly.serving.host.envoy_config import DEFAULT_MAX_REQUEST_BYTES

    meta = {"command": bu.command_line(), "date": bu.now_iso(), "dtype": args.dtype, "max_request_bytes": DEFAULT_MAX_REQUEST_BYTES,
            "machine": bu.machine_info(torch.get_num_threads()),
            "out_rel": os.path.relpath(out_dir, bu.REPO_ROOT) if out_dir.is_relative_to(bu.REPO_ROOT) else str(out_dir)}
    problems = 0
    t_start = time.perf_counter()
    if args.phase in ("matrix", "all"):
        bu.log(f"[matrix] {len(matrix_cases())} cases x {len(STYLES)} call styles")
        with Stack(out_dir, "matrix", dtype=args.dtype) as stack:
            matrix = run_matrix(stack)
        matrix.update(date=bu.now_iso(), dtype=args.dtype, command=meta["command"])
        bu.save_json(out_dir / "matrix.json", matrix)
        print(render_matrix(matrix), flush=True)
        h = matrix["health"]
        problems += sum(not c["as_expected"] for row in matrix["rows"] for c in row["cells"].values())
        problems += h["restarts"] + (not (h["tritonserver_running"] and h["stubs_alive"] and h["good_request_ok"]))
    if args.phase in ("faults", "all"):
        faults = run_faults(out_dir, args.dtype, args.timeout)
        faults["command"] = meta["command"]
        bu.save_json(out_dir / "faults.json", faults)
        problems += faults["kill"]["restarts"] != 1 or faults["kill"]["answers"].get("lost", 0) or faults["stop"]["lost"]
    if args.phase in ("soak", "all"):
        count = token_counter()
        users = make_users(args.users, args.seed, count, tuple(args.profile_tokens))
        jobs = make_jobs(args.requests, users, args.seed, count)
        bu.log(f"[soak] {len(jobs)} requests, {len(users)} users (profiles {min(u.profile_tokens for u in users)}-"
               f"{max(u.profile_tokens for u in users)} tokens), concurrency {args.concurrency}")
        with Stack(out_dir, "soak", dtype=args.dtype) as stack:
            soak = run_soak(stack, jobs, args.concurrency, args.timeout, args.interval)
        summary = summarise_soak(soak, args)
        write_csv(out_dir / "soak_samples.csv", soak["samples"])
        write_csv(out_dir / "soak_requests.csv", soak["records"])
        plot_soak(out_dir / "soak_rss.png", soak, summary)
        bu.save_json(out_dir / "soak.json", {"date": bu.now_iso(), "dtype": args.dtype, "command": meta["command"], "summary": summary})
        print_soak(summary)
        problems += summary["lost"] + summary["transport_failures"] + summary["health"]["restarts"]
        problems += sum(n for o, n in summary["outcomes"].items() if o not in ("ok", "expected_error"))
    bu.replace_section(results_md, SECTION, render(out_dir, results_md, meta))
    bu.log(f"done in {time.perf_counter() - t_start:.0f} s; wrote {out_dir} and the '{SECTION}' section of {results_md}; "
           f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
