"""The Triton Inference Server tree, built from the `nvidia-pytriton==0.7.0` wheel (which ships
tritonserver TRITON_SERVER_VERSION). Nothing here imports pytriton or tritonclient: the wheel is
found on disk.

- `prepare_server_dir()`  builds (once, atomically) a server tree under the cache dir:
  `bin/tritonserver` (a symlink into site-packages), `backends/` (python backend + the stub for
  the running interpreter's version) and `caches/`.
- `server_binary()`       its bin/tritonserver.
- `server_env()`          PATH / LD_LIBRARY_PATH the server and its Python stubs need.
- `check_links()`         fail fast when a library of the server or its stub does not resolve.
- `atomic_build()`        the build-once-into-the-cache step (also used for perf_analyzer's tree).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping

from ...contract.paths import default_cache_dir

TRITON_SERVER_VERSION = "2.51.0"  # the server inside nvidia-pytriton==0.7.0


class ServerError(RuntimeError):
    """The Triton server could not be prepared, started, or did not become ready."""


# ---------------------------------------------------------------------------------------------
# locations


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, by default paths.default_cache_dir() (where the converted default model lives)."""
    return Path(cache_dir) if cache_dir is not None else Path(default_cache_dir())


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            "the Triton server binary comes from the nvidia-pytriton wheel, which is not installed in "
            f"{sys.prefix}: pip install nvidia-pytriton==0.7.0 (see requirements.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def _dist_dir() -> Path:
    dist = _pytriton_root() / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise ServerError(f"{dist}/bin/tritonserver is missing: is nvidia-pytriton installed from its wheel?")
    return dist


def pytriton_libs_dir() -> Path:
    """site-packages/nvidia_pytriton.libs: the wheel's bundled shared libraries (hashed file names)."""
    libs = _pytriton_root().parent / "nvidia_pytriton.libs"
    if not libs.is_dir():
        raise ServerError(f"{libs} is missing: is nvidia-pytriton installed from its wheel?")
    return libs


def _pyver() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _python_libdir() -> Path:
    return Path(sysconfig.get_config_var("LIBDIR") or Path(sys.base_prefix) / "lib")


def _venv_bin() -> Path:
    # not resolved: a venv's python is a symlink to the base interpreter, and resolving it would
    # leave the venv (and its site-packages) behind.
    return Path(sys.executable).parent


def short_hash(*parts: object) -> str:
    """10 hex digits keying a cached tree to what it was built from."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:10]


def atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Build `target` once: `build(tmp)` fills a fresh sibling folder which is renamed into place.
    A `.complete` marker tells a finished tree from anything else; concurrent builders race
    harmlessly (the loser discards its copy)."""
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        build(tmp)
        (tmp / ".complete").write_text(json.dumps({"built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        if target.exists() and not (target / ".complete").is_file():
            # a stale, unfinished tree (only possible if someone edited the cache by hand)
            stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                target.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / ".complete").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# the server tree and its environment


def prepare_server_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The server tree for this interpreter and this nvidia-pytriton install, built once:

        <cache>/tritonserver-<TRITON_SERVER_VERSION>-py3.11-<hash>/
            bin/tritonserver                       -> site-packages/pytriton/tritonserver/bin/tritonserver
            backends/python/libtriton_python.so, triton_python_backend_utils.py,
                            triton_python_backend_stub   (python_backend_stubs/3.11/)
            caches/local/libtritoncache_local.so
    """
    dist = _dist_dir()
    pytriton_libs_dir()
    stub = dist / "python_backend_stubs" / _pyver() / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
        raise ServerError(f"no Python backend stub for Python {_pyver()} in nvidia-pytriton (has {', '.join(have)})")
    try:
        pyt_version = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        pyt_version = "unknown"
    # the hash keys the tree to this site-packages (bin/tritonserver links into it) and wheel
    name = f"tritonserver-{TRITON_SERVER_VERSION}-py{_pyver()}-{short_hash(dist.resolve(), pyt_version)}"

    def build(tmp: Path) -> None:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(dist / "backends", tmp / "backends", ignore=ignore)
        shutil.copytree(dist / "caches", tmp / "caches", ignore=ignore)
        dst = tmp / "backends" / "python" / "triton_python_backend_stub"
        shutil.copy2(stub, dst)
        dst.chmod(0o755)
        (tmp / "bin").mkdir()
        # a symlink, not a copy (19 MB): the binary's RPATH ($ORIGIN/../../../nvidia_pytriton.libs)
        # is resolved from its real location; LD_LIBRARY_PATH covers the rest anyway.
        (tmp / "bin" / "tritonserver").symlink_to((dist / "bin" / "tritonserver").resolve())

    return atomic_build(cache_root(cache_dir) / name, build)


def server_binary(server_dir: Path) -> Path:
    return Path(server_dir) / "bin" / "tritonserver"


def server_env(base: Mapping[str, str] | None = None, pytriton: bool = True) -> dict[str, str]:
    """Environment for tritonserver and its Python backend stubs (a copy of `base`, default os.environ):

    - PATH starts with this interpreter's bin dir: the stub runs `python3` from PATH, so the
      models see this venv's packages (PYTHONPATH alone does not do it);
    - LD_LIBRARY_PATH = nvidia_pytriton.libs + the interpreter's LIBDIR (the stub links
      libpython3.X.so). Without it the server does not fail: it hangs at model load.
    """
    env = dict(os.environ if base is None else base)
    bindir = _venv_bin()
    if not (bindir / "python3").exists():
        raise ServerError(
            f"{bindir} has no `python3`; the Python backend stub runs `python3` from PATH and "
            f"must get this interpreter ({sys.executable}). Create the symlink or use a venv.")
    libdir = _python_libdir()
    if not any(libdir.glob(f"libpython{_pyver()}*.so*")):
        raise ServerError(
            f"no libpython{_pyver()}.so in {libdir} (sysconfig LIBDIR): the Python backend stub needs a "
            "shared-library build of Python (e.g. pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)")
    env["PATH"] = os.pathsep.join([str(bindir)] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    # pytriton=False: a server installed on its own (the NGC image's /opt/tritonserver) has its libraries
    ld = ([str(pytriton_libs_dir())] if pytriton else []) + [str(libdir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(ld))  # dedup, order kept
    # the stub must run this interpreter's own environment, not one a caller pointed elsewhere
    env.pop("PYTHONHOME", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_links(binary: Path, env: Mapping[str, str]) -> None:
    """Fail fast (instead of a hang at model load) when a library of `binary` does not resolve."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return
    try:
        out = subprocess.run([ldd, str(binary)], env=dict(env), capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return
    missing = [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]
    if missing:
        raise ServerError(f"{binary}: libraries not found with LD_LIBRARY_PATH={env.get('LD_LIBRARY_PATH')}: "
                          + ", ".join(missing))
    # the stub must load this interpreter's libpython, not another build of the same version
    # (e.g. the distribution's /usr/lib one), or the stub's Python does not match `python3`
    libdir = _python_libdir().resolve()
    for line in out.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if name.startswith("libpython") and rest:
            found = Path(rest.split(" (")[0].strip())
            if found.parent.resolve() != libdir:
                raise ServerError(f"{binary} would load {found}, not this interpreter's libpython in {libdir} "
                                  f"(LD_LIBRARY_PATH={env.get('LD_LIBRARY_PATH')})")
