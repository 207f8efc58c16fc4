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
import threading
from pathlib import Path

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent


def log(msg: str) -> None:
    """Progress line, flushed at once (runs take minutes; the lead watches them)."""
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def save_figure(plt, fig, path: Path, dpi: int = 110) -> bool:
    """Lay out, write and close a figure; True (so `plot()` can return it)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


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
    for a perf script (sys.argv[0] is then the module's file, or a package's __main__.py), else the
    script's path."""
    script = Path(os.path.abspath(sys.argv[0]))
    if script.suffix == ".py" and script.is_relative_to(PERF_DIR):
        parts = script.relative_to(REPO_ROOT).with_suffix("").parts
        return shlex.join(["python", "-m", ".".join(parts[:-1] if parts[-1] == "__main__" else parts), *sys.argv[1:]])
    return shlex.join(["python", os.path.relpath(script, REPO_ROOT), *sys.argv[1:]])


def run_info(threads: int) -> dict:
    """What every result file records of its run: the command, the date and the machine."""
    return {"command": command_line(), "date": now_iso(), "machine": machine_info(threads)}


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
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),  # MemTotal
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


def default_model_dir() -> str:
    """The default model's converted safetensors folder (made on first use)."""
    from prefillonly.model.default_model import ensure_default_model
    from prefillonly.contract.paths import default_cache_dir

    return ensure_default_model(default_cache_dir())


def rss_bytes(pid: int | str = "self") -> int | None:
    """A process's resident bytes now (VmRSS, from /proc/PID/statm), None once it is gone. Where
    prefillonly imports, prefillonly.worker.memory reads the peak (VmHWM)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


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


def run_threads(fns: list) -> None:
    """Run each callable in its own thread, wait for all; the first error is raised after the join."""
    errors = []

    def wrap(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
