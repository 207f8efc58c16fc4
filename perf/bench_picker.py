"""The endpoint picker on real replicas: what it adds to a request's latency, one command:

    .venv/bin/python -m perf.bench_picker            # ~2 min on 2 cores

3 real tritonserver replicas (the default model, float32, one thread each) behind a real Envoy
with the picker (LocalFleet(picker=True)). Low load: one request at a time, each a user's short
post over its cached 256-token profile (the profiles sent once first). Three phases on the same
fleet, the same requests: the picker routing; the picker SIGKILLed (Envoy fails open to Maglev:
what a request costs without it, plus a refused connection to the picker); the picker back. The
added latency is the median of the picker phases minus the median of the Maglev one; the
picker's own decision time is read from its decisions log (`decide_us`). Writes the "## Fleet
picker on real replicas" section of perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from clients.transport import json_body, post
from perf import benchutil as bu
from prefillonly.serving.host.fleet import LocalFleet
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.contract.wire import USER_HEADER

SECTION = "## Fleet picker on real replicas"
PROFILE, ALLOWED = 256, [9230, 2838]


def _request(fleet, ids, user) -> float:
    started = time.perf_counter()
    status, raw, _ = post(f"{fleet.http_url}/v2/models/prefillonly/generate",
                          json_body({"input_ids": ids, "allowed_token_ids": ALLOWED}), {USER_HEADER: user}, 120)
    if status != 200:
        raise RuntimeError(f"status {status}: {raw[:200]!r}")
    return time.perf_counter() - started


def _phase(fleet, profiles: dict, rounds: int) -> list[float]:
    return [_request(fleet, ids + [11 + r, 12], user) for r in range(rounds) for user, ids in profiles.items()]


def run(users: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    profiles = {f"bench-{i}": torch.randint(10, 40000, (PROFILE,), generator=gen).tolist() for i in range(users)}
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        repo = copy_model_repository(bu.PERF_DIR.parent / "model_repository", Path(tmp) / "repo", dtype="float32", threads="1")
        log = Path(tmp) / "decisions.jsonl"
        with LocalFleet(repo, replicas=3, picker=True, picker_options={"decisions_log": log}).start() as fleet:
            _phase(fleet, profiles, 1)  # the profiles cached on their replicas
            phases = {"picker": _phase(fleet, profiles, rounds)}
            fleet.stop_picker(kill=True)
            phases["maglev (picker killed)"] = _phase(fleet, profiles, rounds)
            fleet.start_picker()
            _phase(fleet, profiles, 1)  # Envoy back on the picker
            phases["picker (back)"] = _phase(fleet, profiles, rounds)
            decisions = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {"users": users, "rounds": rounds, "phases": {k: sorted(v) for k, v in phases.items()},
            "decide_us": sorted(d["decide_us"] for d in decisions if "decide_us" in d)}


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def render(data: dict) -> str:
    m = data["phases"]
    base = statistics.median(m["maglev (picker killed)"])
    lines = [f"Command: `{data['command']}` ({data['date']}; {bu.machine_line(data['machine'])}). 3 replicas (default model, "
             f"float32, one thread each) behind Envoy with the picker; one request at a time, {data['users']} users x "
             f"{data['rounds']} short posts over their cached {PROFILE}-token profiles per phase.", "",
             "| phase | requests | median ms | P90 ms | vs Maglev (median) |", "|---|---|---|---|---|"]
    for name, xs in m.items():
        med = statistics.median(xs)
        lines.append(f"| {name} | {len(xs)} | {med * 1e3:.2f} | {_pct(xs, 0.9) * 1e3:.2f} | {(med - base) * 1e3:+.2f} ms |")
    d = data["decide_us"]
    lines += ["", f"The picker's own decision (`decide_us` of its log, {len(d)} decisions): median {statistics.median(d):.0f} µs, "
              f"P90 {_pct(d, 0.9):.0f} µs."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_picker", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print the table, leave perf/RESULTS.md alone")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    data = run(a.users, a.rounds)
    data.update(command=bu.command_line(), date=bu.now_iso(), machine=bu.machine_info(threads=1))
    text = render(data)
    print(text)
    if not a.no_write:
        bu.save_json(bu.PERF_DIR / "results" / "picker.json", data)
        bu.replace_section(bu.PERF_DIR / "RESULTS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
