"""The package's import graph: no circle of modules, and the tensor-free parts load without torch.

Every import statement counts, also those inside functions (a lazy import that comes back is
still a circle a reader has to hold in their head). A circle is reported by its modules and the
edges that close it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "prefillonly"

# Modules that must not need torch: the scheduler, the cache's bookkeeping and everything in
# serving/ (the wire protocol and the model's bookkeeping are plain data; the host processes run
# where the engine does not) are read by the simulator, the Triton model's adapter and the serve
# supervisor without loading a model; contract/ (the rules every process shares: read by both Triton
# models, the front door, the frontend, the picker and the clients), the request kinds (tasks/: the
# protocol reads them; their result builders load torch only when they run), and the whole
# frontend: it reads the engine's settings without building EngineConfig, and its tokenizer is
# tokenizer.json without transformers (tests/frontend/test_tokenizer_file.py builds the whole
# frontend in a fresh interpreter).
TENSOR_FREE = ("prefillonly.scheduler", "prefillonly.cache.index", "prefillonly.hardware",
               *sorted(f"prefillonly.contract.{p.stem}" for p in SRC.glob("contract/*.py") if p.stem != "__init__"),
               *sorted(f"prefillonly.tasks.{p.stem}" for p in SRC.glob("tasks/*.py") if p.stem != "__init__"),
               *sorted(f"prefillonly.serving.{p.parent.name}.{p.stem}" for p in SRC.glob("serving/*/*.py")
                       if p.stem != "__init__"),
               *sorted(f"prefillonly.frontend.{p.stem}" for p in SRC.glob("frontend/*.py")
                       if p.stem not in ("__init__", "__main__")))


def module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py file below `root` (the package's folder)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `module`'s import statements name (anywhere in the file)."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from . import x` names module x; `from .m import name` names module m
            targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != module)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    known = module_files(root, package)
    return {module: imported_modules(module, path, known) for module, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(component)))}" for m in component)


def test_no_import_circle_in_the_package():
    graph = import_graph(SRC, PACKAGE)
    assert len(graph) > 50 and graph["prefillonly.engine"], "the walker found the package's modules and their imports"
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(describe(c, graph) for c in found)


def test_the_walker_finds_a_circle_through_a_lazy_import(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "sub" / "__init__.py").write_text("from .b import thing\n")
    (tmp_path / "a.py").write_text("import os\nfrom .sub import b\n")
    (tmp_path / "sub" / "b.py").write_text("def thing():\n    from ..a import x\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.sub"] == {"pkg.sub.b"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_tensor_free_modules_load_without_torch():
    assert "prefillonly.serving.model.protocol" in TENSOR_FREE and "prefillonly.serving.host.supervisor" in TENSOR_FREE
    assert "prefillonly.frontend.app" in TENSOR_FREE and "prefillonly.frontend.routes" in TENSOR_FREE
    # one fresh interpreter: the first module whose import pulls torch in is named
    script = ("import importlib, sys\n"
              f"for name in {TENSOR_FREE!r}:\n"
              "    importlib.import_module(name)\n"
              "    if 'torch' in sys.modules:\n"
              "        sys.exit(f'{name} imports torch')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_subpackage_is_installed():
    # a folder of src/ missing from pyproject's list imports in a checkout (editable install)
    # but is absent from the wheel the Docker image installs
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    listed = set(tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join([PACKAGE, *p.parent.relative_to(SRC).parts]) for p in SRC.rglob("__init__.py")}
    assert listed == folders, f"not listed: {sorted(folders - listed)}; listed, not packages: {sorted(listed - folders)}"


# what the frontend and the fleet's picker may import besides their own folder and contract/: the
# host's model settings (what the served model is configured with), the metrics reader the picker
# shares with the host, and the default model's conversion (run once by a frontend that starts
# before anything prepared the default model; `prefillonly prepare` does it at set-up)
OUTSIDE_CONTRACT = {"prefillonly.serving.host.model_settings", "prefillonly.serving.host.prometheus",
                    "prefillonly.model.default_model"}


def test_the_frontend_and_the_picker_import_only_the_contract():
    """Editing block hashing, the JCT rule or the limits is a change of contract/, visibly: the
    frontend and the picker never reach into the engine's own modules."""
    graph = import_graph(SRC, PACKAGE)
    outside = {}
    for module, imports in graph.items():
        if module.startswith(("prefillonly.frontend", "prefillonly.serving.picker")):
            bad = sorted(m for m in imports if not m.startswith(("prefillonly.contract", "prefillonly.frontend",
                                                                 "prefillonly.serving.picker"))
                         and m not in OUTSIDE_CONTRACT and m != PACKAGE)
            if bad:
                outside[module] = bad
    assert "prefillonly.frontend.app" in graph and not outside, outside
