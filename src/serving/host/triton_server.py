"""TritonServer: one real tritonserver process on a model repository (ports, command line, drain,
stop), run from the server tree of server_tree.py or from a Triton install of its own."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from ..model.drain import DRAIN_FILE_ENV, ack_path
from .addresses import dial, free_ports
from .process import LoggedProcess, child_pids, http_status, process_name
from .server_tree import ServerError, check_links, prepare_server_dir, server_binary, server_env

# Triton's administrative APIs (change logging, register shared memory that the server then reads,
# load/unload models, tracing): closed to anyone without the admin key header, on HTTP and gRPC.
# Inference, health, metadata, model config and statistics stay open (clients and perf_analyzer).
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace")
ADMIN_KEY_HEADER = "prefillonly-admin-key"


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
            check_links(path, env)

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
        command = self._command(binary, repo, server_dir, host, log_verbose)
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

    def _command(self, binary: Path, repo: Path, server_dir: Path, host: str, log_verbose: int) -> list[str]:
        """tritonserver's command line for this server's ports, repository and shm prefix."""
        return [
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

    def is_ready(self) -> bool:
        return http_status(f"{self.http_url}/v2/health/ready") == 200

    def wait_ready(self, timeout: float = 120.0, stop_requested=None) -> "TritonServer | None":
        """Poll /v2/health/ready (every model loaded) until it answers 200. Raises ServerError with
        the log's tail at once if the process exits, or after `timeout` seconds; None if
        `stop_requested()` holds first."""
        return super().wait_ready(timeout, hint="; a hang at model load often means LD_LIBRARY_PATH lacks "
                                                "nvidia_pytriton.libs or libpython", stop_requested=stop_requested)

    def drain(self, timeout: float = 5.0) -> bool:
        """Ask the model to close its engine (prefillonly.serving.model.drain): waiting requests are
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
            self._terminate(timeout)
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
        return [pid for pid in child_pids(self.pid) if process_name(pid).startswith("triton_python_b")]

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
        return dial(self.host, self.http_port)

    @property
    def grpc_url(self) -> str:
        return dial(self.host, self.grpc_port, scheme=None)

    @property
    def metrics_url(self) -> str:
        return dial(self.metrics_host, self.metrics_port) + "/metrics"

    def describe(self) -> str:
        return f"http={self.http_url} grpc={self.grpc_url}"


@contextlib.contextmanager
def running_server(model_repository: str | os.PathLike, *, ready_timeout: float = 120.0, stop_timeout: float = 15.0,
                   server_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                   **start_kwargs) -> Iterator[TritonServer]:
    """Start tritonserver on `model_repository` (free ports on 127.0.0.1 unless given), wait until
    every model is ready, yield the TritonServer, and stop it on the way out, whatever happens.
    `start_kwargs` go to TritonServer.start (http_port, log_path, extra_args, ...)."""
    server = TritonServer(server_dir, cache_dir=cache_dir)
    try:
        server.start(model_repository, **start_kwargs)
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop(stop_timeout)
