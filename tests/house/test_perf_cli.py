"""The perf/ command lines: every runnable module (`python -m perf.<name>`, found by scanning perf/,
so a new benchmark is covered without a change here) answers --help, and every command the stored
results record (perf/RESULTS.md, the "command" fields of perf/results/**.json) still parses with
its module's current argument parser (`build_parser()`), so a renamed or removed flag fails here
instead of in the next person's rerun.

In process and without running anything: the modules' imports are the suite's own (torch is loaded
already), and a parser only parses.
"""

from __future__ import annotations

import importlib
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"
# `python -m perf.x ARGS`, `python perf/x.py ARGS` (how older results recorded it) or `perf/x.py ARGS`
COMMAND_RE = re.compile(r"(?:python\s+-m\s+perf\.(\w+)|(?:python\s+)?perf/(\w+)\.py)(?=\s|$)(.*)", re.S)


def runnable_modules() -> list[str]:
    """perf.<name> of every module with a `__main__` block and every package with a __main__.py."""
    modules = [f"perf.{p.stem}" for p in sorted(PERF.glob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]
    return modules + [f"perf.{p.parent.name}" for p in sorted(PERF.glob("*/__main__.py"))]


def build_parser(module: str):
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):  # a package: `python -m` runs its __main__
        mod = importlib.import_module(f"{module}.__main__")
    return mod.build_parser()


def expand(args: str) -> list[str]:
    """A synopsis `[a|b]` stands for each of its alternatives."""
    m = re.search(r"\[([^\]]+)\]", args)
    if m is None:
        return [args]
    return [a for choice in m.group(1).split("|") for a in expand(args[:m.start()] + choice + args[m.end():])]


def command_fields(data) -> list[str]:
    if isinstance(data, dict):
        return [v for k, v in data.items() if k == "command" and isinstance(v, str)] + command_fields(list(data.values()))
    if isinstance(data, list):
        return [c for item in data for c in command_fields(item)]
    return []


def recorded_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, arguments) of each distinct recorded command. In RESULTS.md a command is a
    `code span` that starts with `python` (or names a perf file and gives it arguments)."""
    found = [("perf/RESULTS.md", " ".join(span.split()))
             for span in re.findall(r"`([^`]+)`", (PERF / "RESULTS.md").read_text())]
    found = [(where, text) for where, text in found if text.startswith("python") or re.match(r"perf/\w+\.py\s", text)]
    for path in sorted((PERF / "results").rglob("*.json")):
        found += [(str(path.relative_to(ROOT)), c) for c in command_fields(json.loads(path.read_text()))]
    commands, seen = [], set()
    for where, text in found:
        m = COMMAND_RE.fullmatch(text)
        if m is None:
            continue
        for args in expand(m.group(3)):
            key = (f"perf.{m.group(1) or m.group(2)}", tuple(shlex.split(args)))
            if key not in seen:
                seen.add(key)
                commands.append((where, key[0], list(key[1])))
    return commands


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: the module was imported before
@pytest.mark.parametrize("module", runnable_modules())
def test_help_exits_0(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    build_parser(module)  # what the recorded commands are checked with


@pytest.mark.parametrize("where,module,args", recorded_commands(), ids=lambda x: x if isinstance(x, str) else shlex.join(x))
def test_recorded_command_still_parses(where, module, args, capsys):
    try:
        build_parser(module).parse_args(args)
    except SystemExit:
        pytest.fail(f"{where} records `python -m {module} {shlex.join(args)}`, which no longer parses: "
                    f"{capsys.readouterr().err.strip()}")


def test_the_check_can_fail():
    """Enough commands are found (the patterns above still match the records), and a flag the
    parser does not know is refused."""
    commands = recorded_commands()
    assert len(commands) >= 30 and {m for _, m, _ in commands} >= {"perf.eval", "perf.simulate", "perf.reliability"}
    _, module, args = commands[0]
    with pytest.raises(SystemExit):
        build_parser(module).parse_args(args + ["--no-such-flag"])


def test_stored_results_name_only_files_of_the_repository():
    """The results stand alone: every .md file they name is one of the repository's."""
    for path in [PERF / "RESULTS.md", *sorted((PERF / "results").rglob("*.md")), *sorted((PERF / "results").rglob("*.json"))]:
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            assert (ROOT / name).exists() or (PERF / name).exists(), f"{path.relative_to(ROOT)} names {name}"
