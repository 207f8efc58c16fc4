"""perf_analyzer, the Triton load generator, in the server's version (TRITON_SERVER_VERSION).

The binary is unpacked from the tritonclient==<version> manylinux1 wheel (downloaded with pip,
never installed: the tritonclient the clients use is a newer pin) next to a lib dir of symlinks
into nvidia_pytriton.libs, once, under the cache dir. (The PyPI perf-analyzer wheels need glibc
2.38.)

    python -m perf.perf_analyzer [--cache-dir DIR] [--env]   print its path (--env: and LD_LIBRARY_PATH=...)
    python -m perf.perf_analyzer [--cache-dir DIR] -- -m prefillonly -u localhost:8001 -i grpc --streaming ...
                                                              run it with those arguments, in its environment

From Python: perf_analyzer_path(), perf_analyzer_env(), run_perf_analyzer(), read_perf_analyzer_csv().
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterable, Mapping

from prefillonly.serving.host.server_tree import (TRITON_SERVER_VERSION, ServerError, atomic_build, cache_root,
                                             pytriton_libs_dir, short_hash)

PERF_ANALYZER_REQUIREMENT = f"tritonclient=={TRITON_SERVER_VERSION}"
_WHEEL_GLOB = f"tritonclient-{TRITON_SERVER_VERSION}-*manylinux1_x86_64.whl"
_WHEEL_NAME = f"tritonclient-{TRITON_SERVER_VERSION}-py3-none-manylinux1_x86_64.whl"
_PA_MEMBER = f"tritonclient-{TRITON_SERVER_VERSION}.data/data/bin/perf_analyzer"
# perf_analyzer's NEEDED sonames -> the hashed file names' prefixes in nvidia_pytriton.libs
_PA_LIBS = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}
# only linked from nvidia_pytriton.libs when the system has no copy of its own
_PA_LIBS_FALLBACK = {"libssl.so.3": "libssl-", "libcrypto.so.3": "libcrypto-"}


class PerfAnalyzerUnavailable(RuntimeError):
    """perf_analyzer could not be obtained (e.g. no access to the package index and no cached copy)."""


def _find_lib(libs: Path, prefix: str) -> Path:
    hits = sorted(p for p in libs.iterdir() if p.name.startswith(prefix) and ".so" in p.name)
    if not hits:
        raise PerfAnalyzerUnavailable(f"no {prefix}*.so in {libs}")
    return hits[0]


def _system_has(soname: str) -> bool:
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if ldconfig is None:
        return True  # cannot tell: trust the system
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return True
    return any(line.strip().startswith(soname + " ") for line in out.splitlines())


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
           "manylinux1_x86_64", "--disable-pip-version-check", "-q", "-d", str(dest), PERF_ANALYZER_REQUIREMENT]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PerfAnalyzerUnavailable(f"`{' '.join(cmd)}` failed: {e}") from e
    wheels = sorted(dest.glob(_WHEEL_GLOB))
    if r.returncode != 0 or not wheels:
        raise PerfAnalyzerUnavailable(
            f"could not download {PERF_ANALYZER_REQUIREMENT} (needed for perf_analyzer; it is not installed, only "
            f"unpacked): `{' '.join(cmd)}` exited {r.returncode}\n{(r.stderr or r.stdout)[-2000:]}\n"
            f"Offline: put {_WHEEL_NAME} where $PREFILLONLY_TRITONCLIENT_WHEEL points.")
    return wheels[0]


def perf_analyzer_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a runnable perf_analyzer (run it with perf_analyzer_env()). Built once under
    <cache>/perf_analyzer-<version>-<hash>/{bin/perf_analyzer, lib/}: the binary is unpacked from
    the tritonclient wheel ($PREFILLONLY_TRITONCLIENT_WHEEL, or `pip download`ed); lib/ has
    libb64.so.0d and libcudart.so.12 symlinked to nvidia_pytriton.libs' hashed copies."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        raise PerfAnalyzerUnavailable("perf_analyzer from the tritonclient wheel runs on Linux x86_64 only")
    try:
        libs = pytriton_libs_dir()
    except ServerError as e:
        raise PerfAnalyzerUnavailable(str(e)) from e
    target = cache_root(cache_dir) / f"perf_analyzer-{TRITON_SERVER_VERSION}-{short_hash(libs.resolve())}"

    def build(tmp: Path) -> None:
        given = os.environ.get("PREFILLONLY_TRITONCLIENT_WHEEL")
        wheel = Path(given) if given else _download_wheel(tmp)
        (tmp / "bin").mkdir()
        binary = tmp / "bin" / "perf_analyzer"
        try:
            with zipfile.ZipFile(wheel) as z, z.open(_PA_MEMBER) as src, open(binary, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise PerfAnalyzerUnavailable(f"{wheel}: cannot extract {_PA_MEMBER}: {e}") from e
        binary.chmod(0o755)
        if not given:
            wheel.unlink()
        (tmp / "lib").mkdir()
        for soname, prefix in _PA_LIBS.items():
            (tmp / "lib" / soname).symlink_to(_find_lib(libs, prefix).resolve())
        for soname, prefix in _PA_LIBS_FALLBACK.items():
            if not _system_has(soname):
                (tmp / "lib" / soname).symlink_to(_find_lib(libs, prefix).resolve())

    return atomic_build(target, build) / "bin" / "perf_analyzer"


def perf_analyzer_env(base: Mapping[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment to run perf_analyzer_path() in: its lib dir first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    lib = perf_analyzer_path(cache_dir).parent.parent / "lib"
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


def run_perf_analyzer(args: Iterable[str], *, timeout: float | None = None,
                      cache_dir: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run perf_analyzer_path() with `args` in perf_analyzer_env(); stdout and stderr captured as
    text. perf_analyzer exits non-zero when any request failed (or no measurement was made)."""
    return subprocess.run([str(perf_analyzer_path(cache_dir)), *map(str, args)], env=perf_analyzer_env(cache_dir=cache_dir),
                          capture_output=True, text=True, timeout=timeout)


def read_perf_analyzer_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a perf_analyzer `-f FILE` CSV (one per load level) as {column: value}: the first
    column is "Concurrency" or "Request Rate", latencies are in microseconds."""
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if any(v.strip() for v in row.values() if v)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.perf_analyzer",
        description=f"perf_analyzer {TRITON_SERVER_VERSION} (fetched once): print its path, or run it with the "
                    "arguments after `--` in its environment.")
    p.add_argument("--cache-dir", default=None, help="where it is unpacked (default $PREFILLONLY_CACHE_DIR or "
                                                     "~/.cache/prefillonly)")
    p.add_argument("--env", action="store_true", help="also print LD_LIBRARY_PATH=... to run it with")
    p.add_argument("args", nargs=argparse.REMAINDER, help="`-- ARGS...`: run perf_analyzer ARGS...")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        binary = perf_analyzer_path(a.cache_dir)
        env = perf_analyzer_env(cache_dir=a.cache_dir)
    except PerfAnalyzerUnavailable as e:
        print(f"perf.perf_analyzer: {e}", file=sys.stderr)
        return 1
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        print(binary)
        if a.env:
            print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
        return 0
    sys.stdout.flush()
    os.execve(str(binary), [str(binary), *args], env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
