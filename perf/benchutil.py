"""Small helpers shared by the perf/ benchmark scripts: machine facts, peak RSS, result files.

Benchmarks write one section of perf/RESULTS.md each ("## <title>") and keep the other
sections as they are, plus raw JSON under perf/results/ (docs/design.md §10).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent


def log(msg: str) -> None:
    """Progress line, flushed at once (runs take minutes; the lead watches them)."""
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (tables only) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: tables only (it is in requirements.txt; run scripts/setup.sh)")
        return None
    return plt


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line() -> str:
    """The command as typed from the repository root, for the results file: `python -m perf.<name> ...`
    for a perf script (sys.argv[0] is then the module's file), else the script's path."""
    script = Path(os.path.abspath(sys.argv[0]))
    if script.parent == PERF_DIR and script.suffix == ".py":
        return shlex.join(["python", "-m", f"perf.{script.stem}", *sys.argv[1:]])
    return shlex.join(["python", os.path.relpath(script, REPO_ROOT), *sys.argv[1:]])


def module_command(python: str, module: str, *args: str) -> list[str]:
    """argv that runs perf script `module` (e.g. "eval") with `python`; run it with cwd=REPO_ROOT,
    which `-m` puts on the child's sys.path so that `perf` imports there as it does here."""
    return [str(python), "-m", f"perf.{module}", *args]


# The CPU flags that decide which kernels and dtype run (named beside every figure: the same code's
# speed differs 2-3x between hosts, and its kernel ranking can flip).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_info(threads: int) -> dict:
    import torch

    from prefillonly.hardware import cpu_flags

    return {
        "cpu": _lscpu_field("Model name") or platform.processor() or "unknown",
        "isa_flags": [f for f in ISA_FLAGS if f in cpu_flags()],
        "cores": os.cpu_count(),
        "memory_gib": round(_meminfo_bytes("MemTotal") / 2**30, 1),
        "torch": torch.__version__,
        "threads": threads,
        "python": platform.python_version(),
    }


def machine_line(m: dict) -> str:
    flags = f" (flags: {', '.join(m['isa_flags'])})" if m.get("isa_flags") else ""  # runs before the flags were recorded: none
    return (f"{m['cpu']}{flags}, {m['cores']} cores, {m['memory_gib']} GiB RAM; torch {m['torch']}, {m['threads']} threads, "
            f"Python {m['python']}")


def _lscpu_field(name: str) -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# -- peak RSS, measured as docs/design.md §7 says ----------------------------------------
def status_bytes(key: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def reset_rss_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# -- small maths ------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values)


def max_logprob_gap(a, b) -> float | None:
    """Largest |a - b| between two systems' logprobs, a sanity check that both computed the same
    thing (a fast wrong path shows here). Lists pair by position, dicts by key, nested to any depth
    ({request: [logprob, ...]}, {request: {token: logprob}}); a None or missing value on either side
    is skipped. None when nothing pairs; NaN if any pair gives NaN (max() would hide it)."""
    gaps = list(_abs_gaps(a, b))
    if any(math.isnan(g) for g in gaps):
        return math.nan
    return max(gaps) if gaps else None


def _abs_gaps(a, b):
    if a is None or b is None:
        return
    if isinstance(a, dict):
        for key, value in a.items():
            if key in b:
                yield from _abs_gaps(value, b[key])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            yield from _abs_gaps(x, y)
    else:
        yield abs(a - b)


# -- result files -----------------------------------------------------------------------
def load_json(path: Path) -> dict:
    if path.is_file():
        with open(path) as f:
            return json.load(f)
    return {}


def save_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def write_atomic(path, text: str) -> None:
    """Write through a temporary file and a rename: a reader, or a run killed mid-write, never
    sees half a file (the results are rewritten after every measurement)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def replace_section(path: Path, heading: str, body: str) -> None:
    """Write `heading` + `body` into the markdown file, replacing only that section.

    A section runs from its "## " heading to the next "## " heading (or the end).
    """
    text = path.read_text() if path.is_file() else "# Performance results\n\nWritten by the scripts under perf/.\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
