"""The README and every page under docs/ name only what exists, and the README's code map names every module.

- every repository path they write (`src/engine.py`, `perf/bench_core.py`, `deploy/kubernetes/`)
  exists; every Python module among them, and every dotted `prefillonly.x.y[.name]`, imports
  (and has the named attribute);
- every relative Markdown link (`[serving](serving.md)`, `(../README.md)`) resolves from its page;
- in the code map (README "Where the code is"), each file named on a folder's lines exists under
  that folder (or under src/), and every module of src/ is named there;
- the README is a front door: at most README_MAX_LINES lines, linking every docs/*.md page, and
  the docs pages it links exist.
Links to other repositories (`https://...`) are not paths of ours and are skipped.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_PAGES = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
DOCS = ("README.md", *DOC_PAGES)
README_MAX_LINES = 150
TOP_FOLDERS = ("src", "perf", "tests", "clients", "deploy", "model_repository", "scripts", "docs")
PATH_RE = re.compile(r"(?<![\w./-])(?:%s)/[\w./-]*" % "|".join(TOP_FOLDERS))
DOTTED_RE = re.compile(r"\bprefillonly(?:\.\w+)+")
URL_RE = re.compile(r"https?://\S+")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
CODE_MAP_TITLE = "## Where the code is"


def doc_text(name: str) -> str:
    return URL_RE.sub(" ", (ROOT / name).read_text())


def ignored_by_git(path: str) -> bool:
    # asked as a file and as a folder: a pattern like `.venv-*/` matches only the latter
    return any(subprocess.run(["git", "check-ignore", "-q", p], cwd=ROOT).returncode == 0 for p in (path, path + "/"))


def named_paths() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for match in PATH_RE.findall(doc_text(doc)):
            path = match.rstrip(".,:;")
            if not ignored_by_git(path):  # a built venv or a result folder a run writes
                found.add((doc, path))
    return sorted(found)


def module_of(path: str) -> str | None:
    """The import name of a repository .py path (None for scripts and files outside packages)."""
    p = Path(path)
    if p.suffix != ".py" or p.parts[0] not in ("src", "perf"):
        return None
    parts = list(p.with_suffix("").parts)
    parts[0] = "prefillonly" if parts[0] == "src" else "perf"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("doc,path", named_paths())
def test_named_path_exists(doc, path):
    assert (ROOT / path).exists(), f"{doc} names {path}, which is not in the repository"
    module = module_of(path)
    if module is not None:
        importlib.import_module(module)


def named_dotted() -> list[tuple[str, str]]:
    return sorted({(doc, name) for doc in DOCS for name in DOTTED_RE.findall(doc_text(doc))
                   if not name.endswith(".svc.cluster.local") and "prefillonly.svc" not in name})


@pytest.mark.parametrize("doc,name", named_dotted())
def test_named_module_imports(doc, name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{doc} names {name}: {'.'.join(parts[:cut])} has no {attr!r}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{doc} names {name}, which does not import")


def code_map() -> list[tuple[str, list[str]]]:
    """(folder, the file names on its lines) for each entry of the README's code map block."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(CODE_MAP_TITLE):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    entries: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        head = line.split()[0] if line and not line[0].isspace() else None
        if head is not None and "/" not in head:  # a heading line ("around the hot path:")
            head = None
            entries.append(("./", []))
        if head is not None:
            folder = head if head.endswith("/") else str(Path(head).parent) + "/"
            entries.append((folder, [] if head.endswith("/") else [Path(head).name]))
        names = re.findall(r"(?<![\w./-])([\w/]+\.(?:py|cpp|h))\b", line)
        if entries:
            entries[-1][1].extend(n for n in names if n != head)
    return entries


def test_code_map_names_files_that_exist():
    entries = code_map()
    assert len(entries) > 10, "the code map block was found and read"
    missing = []
    for folder, names in entries:
        for name in names:
            candidates = [ROOT / folder / name, ROOT / "src" / name]
            if not any(c.exists() for c in candidates) and not list((ROOT / folder).rglob(name)):
                missing.append(f"{name} (under {folder})")
    assert not missing, "the README's code map names files that do not exist: " + ", ".join(missing)


def test_code_map_names_every_module_of_the_package():
    named = {(Path(folder) / name).as_posix() for folder, names in code_map() for name in names}
    named |= {("src/" + name) for _, names in code_map() for name in names}
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "src").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    unnamed = sorted(m for m in modules if m not in named)
    assert not unnamed, "modules the README's code map does not name: " + ", ".join(unnamed)


def relative_links(doc: str) -> list[str]:
    """The targets of the Markdown links of `doc` that point into this repository (no scheme, no
    mailto, no bare #anchor), without their #anchor."""
    targets = []
    for target in LINK_RE.findall((ROOT / doc).read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_docs_pages_exist():
    assert "docs/design.md" in DOC_PAGES and len(DOC_PAGES) > 1, f"the docs pages were found: {DOC_PAGES}"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    broken = sorted({t for t in relative_links(doc) if not ((ROOT / doc).parent / t).exists()})
    assert not broken, f"{doc} links to what is not in the repository: {', '.join(broken)}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: "
                                            "move the detail into a page under docs/ and link it")


def test_readme_links_every_docs_page_and_only_pages_that_exist():
    linked = {os.path.normpath(t) for t in relative_links("README.md")}
    linked_pages = {t for t in linked if t.startswith("docs/") and t.endswith(".md")}
    missing = sorted(t for t in linked_pages if not (ROOT / t).is_file())
    assert not missing, "README.md links docs pages that do not exist: " + ", ".join(missing)
    unlinked = sorted(set(DOC_PAGES) - linked_pages)
    assert not unlinked, "docs pages the README does not link: " + ", ".join(unlinked)
