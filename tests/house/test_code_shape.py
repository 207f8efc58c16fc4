"""The house rule a reader relies on: no function in src/ (or the Triton models) over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_over_sixty_lines():
    files = sorted(ROOT.glob("src/**/*.py")) + sorted(ROOT.glob("model_repository/*/1/model.py"))
    assert len(files) > 50, files  # the walk found the package
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in files for name, line, n in _functions(p) if n > MAX_LINES]
    assert not long, "split these (a helper per step, named for what it does):\n" + "\n".join(long)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n")
    assert [n for _, _, n in _functions(tmp_path / "m.py")] == [MAX_LINES + 1]
