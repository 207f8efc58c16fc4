"""Launch the real Triton Inference Server 2.51.0 shipped in the `nvidia-pytriton==0.7.0` wheel, and
obtain the matching `perf_analyzer` (DESIGN.md §5). Standard library only: nothing here imports
pytriton, torch or tritonclient.

- `prepare_server_dir()`  builds (once, atomically) a server tree under the cache dir:
  `bin/tritonserver` (a symlink into site-packages), `backends/` (python backend + the stub for
  the running interpreter's version) and `caches/`.
- `server_env()`          PATH / LD_LIBRARY_PATH the server and its Python stubs need.
- `TritonServer`          start (free ports when not given), wait_ready, stop, context manager.
- `perf_analyzer_path()`  the perf_analyzer binary from the tritonclient==2.51.0 manylinux1 wheel
  (downloaded with pip, never installed) plus a lib dir of symlinks; `perf_analyzer_env()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
import zipfile
from pathlib import Path
from typing import Iterable, Mapping

from .drain import DRAIN_FILE_ENV, ack_path
from .process import LoggedProcess, http_status

TRITON_SERVER_VERSION = "2.51.0"  # the server inside nvidia-pytriton==0.7.0
PERF_ANALYZER_REQUIREMENT = "tritonclient==2.51.0"
_PA_MEMBER = "tritonclient-2.51.0.data/data/bin/perf_analyzer"
# perf_analyzer's NEEDED sonames -> the hashed file names' prefixes in nvidia_pytriton.libs
_PA_LIBS = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}
# only linked from nvidia_pytriton.libs when the system has no copy of its own
_PA_LIBS_FALLBACK = {"libssl.so.3": "libssl-", "libcrypto.so.3": "libcrypto-"}


# Triton's administrative APIs (change logging, register shared memory that the server then reads,
# load/unload models, tracing): closed to anyone without the admin key header, on HTTP and gRPC.
# Inference, health, metadata, model config and statistics stay open (clients and perf_analyzer).
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace")
ADMIN_KEY_HEADER = "prefillonly-admin-key"


class ServerError(RuntimeError):
    """The Triton server could not be prepared, started, or did not become ready."""


class PerfAnalyzerUnavailable(RuntimeError):
    """perf_analyzer could not be obtained (e.g. no access to the package index and no cached copy)."""


# ---------------------------------------------------------------------------------------------
# locations


def default_cache_dir() -> Path:
    """$PREFILLONLY_CACHE_DIR or ~/.cache/prefillonly (the same place as the converted default model)."""
    return Path(os.environ.get("PREFILLONLY_CACHE_DIR") or Path.home() / ".cache" / "prefillonly")


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


def _libs_dir() -> Path:
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


def _hash(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:10]


def _atomic_build(target: Path, build) -> Path:
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

        <cache>/tritonserver-2.51.0-py3.11-<hash>/
            bin/tritonserver                       -> site-packages/pytriton/tritonserver/bin/tritonserver
            backends/python/libtriton_python.so, triton_python_backend_utils.py,
                            triton_python_backend_stub   (python_backend_stubs/3.11/)
            caches/local/libtritoncache_local.so
    """
    dist = _dist_dir()
    _libs_dir()
    stub = dist / "python_backend_stubs" / _pyver() / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
        raise ServerError(f"no Python backend stub for Python {_pyver()} in nvidia-pytriton (has {', '.join(have)})")
    try:
        pyt_version = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        pyt_version = "unknown"
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # the hash keys the tree to this site-packages (bin/tritonserver links into it) and wheel
    name = f"tritonserver-{TRITON_SERVER_VERSION}-py{_pyver()}-{_hash(dist.resolve(), pyt_version)}"

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

    return _atomic_build(cache / name, build)


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
    ld = ([str(_libs_dir())] if pytriton else []) + [str(libdir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(ld))  # dedup, order kept
    # the stub must run this interpreter's own environment, not one a caller pointed elsewhere
    env.pop("PYTHONHOME", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _check_links(binary: Path, env: Mapping[str, str]) -> None:
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


# ---------------------------------------------------------------------------------------------
# the server process


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` right now (all held open together while choosing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::") else host
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((bind_host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def client_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _children(pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in children.read_text().split()]
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class TritonServer(LoggedProcess):
    """One tritonserver process (its own process group, so its Python stubs go with it).

        server = TritonServer().start("model_repository")   # free ports on 127.0.0.1
        server.wait_ready(60)                                # raises ServerError with the log tail
        ... server.http_url, server.grpc_url, server.metrics_url ...
        server.stop()

    or `with TritonServer().start(repo) as server:`. Output (stdout + stderr) goes to `log_path`,
    by default a temporary file removed by stop().
    """

    name = "tritonserver"
    error = ServerError

    def __init__(self, server_dir: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None):
        super().__init__()
        self._server_dir = Path(server_dir) if server_dir is not None else None
        self._cache_dir = cache_dir
        self._base_env = env
        self._shm_prefix = ""
        self._drain_dir: Path | None = None
        self.drain_file: Path | None = None
        self.admin_key: str | None = None
        self.host = self.metrics_host = "127.0.0.1"
        self.http_port = self.grpc_port = self.metrics_port = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, model_repository: str | os.PathLike, http_port: int | None = None, grpc_port: int | None = None,
              metrics_port: int | None = None, host: str = "127.0.0.1", log_path: str | os.PathLike | None = None,
              extra_args: Iterable[str] = (), log_verbose: int = 0,
              exit_timeout_secs: int | None = None, metrics_host: str | None = None,
              admin_key: str | None = None, open_admin_api: bool = False) -> "TritonServer":
        """Start tritonserver on `model_repository` and return at once (see wait_ready).

        Ports left None are chosen free on `host` (`metrics_host`, default `host`, for metrics).
        `extra_args` are appended to the command line (later flags win, e.g.
        "--exit-on-error=false"). `exit_timeout_secs`: how long the server waits for in-flight
        requests on SIGTERM (Triton's default 30). The ADMIN_APIS need the header
        ADMIN_KEY_HEADER: `admin_key` (default a random one, kept in self.admin_key), unless
        `open_admin_api`."""
        if self.process is not None:
            raise ServerError("this TritonServer was already started")
        repo = Path(model_repository).resolve()
        if not repo.is_dir():
            raise ServerError(f"model repository {repo} is not a directory")
        server_dir = self._server_dir or prepare_server_dir(self._cache_dir)
        binary = server_binary(server_dir)
        env = server_env(self._base_env, pytriton=self._server_dir is None)
        stub = server_dir / "backends" / "python" / "triton_python_backend_stub"
        for path in (binary, stub, server_dir / "backends" / "python" / "libtriton_python.so"):
            _check_links(path, env)

        wanted = [http_port, grpc_port, metrics_port]
        chosen = iter(free_ports(sum(p is None for p in wanted), host))
        self.http_port, self.grpc_port, self.metrics_port = (p if p is not None else next(chosen) for p in wanted)
        self.host = host
        self.metrics_host = metrics_host or host
        self._drain_dir = Path(tempfile.mkdtemp(prefix="prefillonly-drain-"))
        self.drain_file = self._drain_dir / "drain"
        env[DRAIN_FILE_ENV] = str(self.drain_file)
        # python backend shared-memory regions under /dev/shm: a unique prefix per server, so that
        # servers side by side never collide and stop() can remove what a killed server left
        self._shm_prefix = f"prefillonly_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        command = [
            str(binary),
            f"--model-repository={repo}",
            f"--backend-directory={server_dir / 'backends'}",
            f"--cache-directory={server_dir / 'caches'}",
            f"--http-address={host}", f"--http-port={self.http_port}",
            f"--grpc-address={host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.metrics_host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            "--cuda-memory-pool-byte-size=0:0",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--log-verbose={int(log_verbose)}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
        ]
        if exit_timeout_secs is not None:
            command.append(f"--exit-timeout-secs={int(exit_timeout_secs)}")
        if not open_admin_api:
            self.admin_key = admin_key or secrets.token_hex(16)
            apis = ",".join(ADMIN_APIS)
            command += [f"--http-restricted-api={apis}:{ADMIN_KEY_HEADER}={self.admin_key}",
                             f"--grpc-restricted-protocol={apis}:{ADMIN_KEY_HEADER}={self.admin_key}"]
        command += [str(a) for a in extra_args]
        self._spawn(command, log_path, env=env, cwd=str(server_dir))
        return self

    def is_ready(self) -> bool:
        return http_status(f"{self.http_url}/v2/health/ready") == 200

    def wait_ready(self, timeout: float = 120.0, stop_requested=None) -> "TritonServer | None":
        """Poll /v2/health/ready (every model loaded) until it answers 200. Raises ServerError with
        the log's tail at once if the process exits, or after `timeout` seconds; None if
        `stop_requested()` holds first."""
        return super().wait_ready(timeout, hint="; a hang at model load often means LD_LIBRARY_PATH lacks "
                                                "nvidia_pytriton.libs or libpython", stop_requested=stop_requested)

    def drain(self, timeout: float = 5.0) -> bool:
        """Ask the model to close its engine (prefillonly.serving.drain): waiting requests are
        answered `engine_closed`, new ones refused, the running one finishes. True once the model
        acknowledged (nothing left to answer), False after `timeout` (the running request is still
        going, the model is not ours, or its process is dead)."""
        if self.drain_file is None or self.poll() is not None:
            return False
        self.drain_file.touch()
        deadline = time.monotonic() + timeout
        while not ack_path(self.drain_file).exists():
            if time.monotonic() >= deadline or self.poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 30.0, drain_timeout: float = 5.0) -> int | None:
        """Drain (see drain()), then SIGTERM to the process group (Triton waits for the requests
        still in flight), SIGKILL after `timeout` seconds. Returns the exit status (None if never
        started). Idempotent."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.drain(drain_timeout)
            self.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.process.wait(10)
        # stubs outlive a SIGKILLed server briefly; take whatever is left of the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._cleanup()
        return self.process.returncode

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (no drain: for a server that cannot answer)."""
        if self.process is None:
            return None
        self.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        return self.stop(timeout=5, drain_timeout=0)

    def stub_pids(self) -> list[int]:
        """Pids of the server's Python backend stubs (one per model instance), from /proc."""
        if self.pid is None:
            return []
        return [pid for pid in _children(self.pid) if _comm(pid).startswith("triton_python_b")]

    def _cleanup(self) -> None:
        self._release()
        if self._drain_dir is not None:
            shutil.rmtree(self._drain_dir, ignore_errors=True)
            self._drain_dir = None
        if self._shm_prefix:
            for leftover in Path("/dev/shm").glob(self._shm_prefix + "*"):
                with contextlib.suppress(OSError):
                    leftover.unlink()

    # -- addresses and logs --------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port, as tritonclient.grpc.InferenceServerClient(url=...) takes it."""
        return f"{client_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{client_host(self.metrics_host)}:{self.metrics_port}/metrics"

    def describe(self) -> str:
        return f"http={self.http_url} grpc={self.grpc_url}"


# ---------------------------------------------------------------------------------------------
# perf_analyzer


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
    wheels = sorted(dest.glob("tritonclient-2.51.0-*manylinux1_x86_64.whl"))
    if r.returncode != 0 or not wheels:
        raise PerfAnalyzerUnavailable(
            f"could not download {PERF_ANALYZER_REQUIREMENT} (needed for perf_analyzer; it is not installed, only "
            f"unpacked): `{' '.join(cmd)}` exited {r.returncode}\n{(r.stderr or r.stdout)[-2000:]}\n"
            "Offline: put tritonclient-2.51.0-py3-none-manylinux1_x86_64.whl where $PREFILLONLY_TRITONCLIENT_WHEEL "
            "points.")
    return wheels[0]


def perf_analyzer_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a runnable perf_analyzer 2.51.0 (run it with perf_analyzer_env()). Built once under
    <cache>/perf_analyzer-2.51.0/{bin/perf_analyzer, lib/}: the binary is unpacked from the
    tritonclient==2.51.0 manylinux1 wheel ($PREFILLONLY_TRITONCLIENT_WHEEL, or `pip download`ed);
    lib/ has libb64.so.0d and libcudart.so.12 symlinked to nvidia_pytriton.libs' hashed copies.
    (The PyPI perf-analyzer wheels need glibc 2.38.)"""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        raise PerfAnalyzerUnavailable("perf_analyzer from the tritonclient wheel runs on Linux x86_64 only")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        libs = _libs_dir()
    except ServerError as e:
        raise PerfAnalyzerUnavailable(str(e)) from e
    target = cache / f"perf_analyzer-2.51.0-{_hash(libs.resolve())}"

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

    return _atomic_build(target, build) / "bin" / "perf_analyzer"


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
    import csv

    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if any(v.strip() for v in row.values() if v)]
