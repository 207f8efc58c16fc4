"""The serve command's supervisor: Envoy in front, tritonserver behind, a watchdog over the engine.

    client -> Envoy (host:http_port, host:grpc_port; body limit, header stripping)
           -> tritonserver (127.0.0.1, internal ports; metrics on host:metrics_port)
           -> the prefillonly model's engine (a Python backend stub process)
    client -> Envoy (host:http_port: /v1/..., /v2/rerank, /rerank, /v2/embed, ...: envoy_config.FRONTEND_ROUTES)
           -> the scoring-API frontend (prefillonly.frontend, 127.0.0.1) -> Triton's gRPC

The watchdog restarts tritonserver (a process restart: the model reload API would need the
repository API open, and a dead stub's requests are only released when Triton goes) when
  - tritonserver exits on its own,
  - a Python backend stub process dies (checked every WATCH_INTERVAL_S), or
  - a liveness probe (prefillonly.serving.host.probe: a real 1-token inference) gets no engine answer
    within probe_timeout_s (a wedged engine);
and restarts Envoy or the frontend if either exits.
Killing Triton closes every connection it holds, so each in-flight request of the dead engine
gets a final error (HTTP 503 `unavailable: ...` from Envoy, gRPC UNAVAILABLE) instead of silence.
While Triton is down, Envoy answers 503 `unavailable`, readiness included.
stop() drains the engine (waiting requests answered `engine_closed`, the running one finishes),
then stops Envoy and Triton: every request has had its final response by then.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from ...contract.tenants import TENANTS_FILE_ENV, Quota, TenantConfigError
from .addresses import free_ports
from .api_keys import TRITON_FORWARD_ARGS, KeyFiles
from .envoy import EnvoyProxy
from .envoy_config import DEFAULT_MAX_REQUEST_BYTES, FrontDoor, Upstream
from .frontend_process import FrontendProcess
from .probe import probe
from .process import process_alive
from .server_tree import ServerError
from .triton_server import TritonServer

WATCH_INTERVAL_S = 0.5
RESTART_ATTEMPTS = 5  # consecutive failed starts before the supervisor gives up (exit status 1)


@dataclass
class ServeOptions:
    model_repository: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    proxy: bool = True  # Envoy in front (the safe default); False: Triton on host's ports directly
    frontend: bool = True  # the scoring APIs (rerank, score, completions) behind Envoy; needs proxy
    # where the frontend sends its gRPC streams: None = this server's Triton; in a fleet, the fleet's
    # front door, so that a request's `user` field routes it to that user's replica (affinity header)
    frontend_upstream: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 120.0  # the probe waits for the running request: longer than any one forward
    ready_timeout_s: float = 600.0
    exit_timeout_secs: int = 30
    admin_key: str | None = None
    open_admin_api: bool = False
    log_path: str | None = None
    log_verbose: int = 0
    cache_dir: str | None = None
    server_dir: str | None = None  # a Triton install (bin/, backends/, caches/), e.g. /opt/tritonserver; None = the PyPI wheel's
    extra_args: list = field(default_factory=list)
    # API keys (checked by Envoy; tenant "default") and a key file (`KEY TENANT [in_flight=N] [rps=R]`
    # lines, re-read by reload_keys); none of either: every client is served
    api_keys: list = field(default_factory=list)
    api_key_file: str | None = None
    tenant_quota: Quota = Quota()  # the quota of a tenant whose key-file lines name none


class Supervisor:
    def __init__(self, options: ServeOptions, say=None):
        self.options = options
        self.say = say or (lambda msg: print(f"prefillonly.serving: {msg}", file=sys.stderr, flush=True))
        self.server: TritonServer | None = None
        self.proxy: EnvoyProxy | None = None
        self.frontend: FrontendProcess | None = None
        self.restarts = 0
        self._internal_ports: list[int] | None = None
        self._stub_pids: list[int] = []
        self._probe_result: tuple[bool, str] | None = None
        self._probe_thread: threading.Thread | None = None
        self._next_probe = 0.0
        self._stopping = threading.Event()  # set by stop(): the watchdog must not restart what stop() ends
        self._lock = threading.Lock()  # one of check-and-restart or stop at a time
        self._own_log = options.log_path is None
        self.keys: KeyFiles | None = None
        if self._own_log:  # one log for every server this supervisor starts (restarts append)
            fd, options.log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)

    # -- addresses clients use ---------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return self.proxy.http_url if self.proxy else self.server.http_url

    @property
    def grpc_url(self) -> str:
        return self.proxy.grpc_url if self.proxy else self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, stop: threading.Event | None = None) -> bool:
        """Triton (and the frontend, which loads meanwhile), then Envoy in front of them; False if
        `stop` was set while waiting."""
        o = self.options
        self._load_keys()
        if o.proxy:
            self._internal_ports = free_ports(2, "127.0.0.1")
            if o.frontend:
                self._start_frontend()
        if not self._start_server(stop):
            return False
        if self.frontend is not None:
            self.frontend.wait_ready(o.ready_timeout_s)
        if o.proxy:
            self._start_proxy()
        return True

    def _load_keys(self) -> None:
        o = self.options
        if (o.api_keys or o.api_key_file) and not o.proxy:
            raise TenantConfigError("API keys are checked by the front door (Envoy): they cannot go with --no-proxy")
        if (o.api_keys or o.api_key_file) and not o.frontend:
            raise TenantConfigError("API keys need the scoring frontend (HTTP generate reaches the engine with its tenant "
                                    "through it): they cannot go with --no-frontend")
        self.keys = KeyFiles.create(o.api_keys, o.api_key_file, o.tenant_quota)
        self.say(f"{self.keys.describe()}; every route but the health checks needs `Authorization: Bearer <key>`"
                 if self.keys else "no API keys (--api-key, --api-key-file): every client that reaches the ports is served")

    def reload_keys(self) -> None:
        """Re-read the API key file (SIGHUP, or the watchdog seeing it change); a bad file keeps the
        keys in use and says why."""
        if self.keys is None:
            self.say("SIGHUP: no API keys to reload (the server was started without --api-key / --api-key-file)")
            return
        try:
            self.say(self.keys.reload())
        except TenantConfigError as e:
            self.say(f"the API keys were NOT reloaded, the ones in use stay: {e}")  # SIGHUP or the file changed

    def _start_frontend(self) -> None:
        upstream = self.options.frontend_upstream or f"127.0.0.1:{self._internal_ports[1]}"
        port = self.frontend.port if self.frontend is not None else 0  # a restart keeps the port Envoy routes to
        # with keys, Triton's HTTP generate goes through the frontend (envoy_config.GENERATE_ROUTE)
        triton_http = f"127.0.0.1:{self._internal_ports[0]}" if self.keys else None
        self.frontend = FrontendProcess(self.options.model_repository, upstream, port=port,
                                        log_path=self.options.log_path, triton_http=triton_http).start()

    def _start_proxy(self) -> None:
        o = self.options
        frontend_port = self.frontend.port if self.frontend is not None else None
        front = FrontDoor(upstreams=[Upstream("127.0.0.1", self.server.http_port, self.server.grpc_port, frontend_port)],
                          host=o.host, http_port=o.http_port, grpc_port=o.grpc_port, max_request_bytes=o.max_request_bytes,
                          api_keys_file=self.keys.envoy_path if self.keys else None)
        self.proxy = EnvoyProxy(front).start()
        self.proxy.wait_ready(60)

    def _start_server(self, stop: threading.Event | None) -> bool:
        o = self.options
        http, grpc = self._internal_ports or (o.http_port, o.grpc_port)
        env, extra_args = None, list(o.extra_args)
        if self.keys is not None:  # the model reads tenants and quotas; Triton passes the tenant header on
            env, extra_args = {**os.environ, TENANTS_FILE_ENV: self.keys.tenants_path}, [*TRITON_FORWARD_ARGS, *extra_args]
        self.server = TritonServer(o.server_dir, cache_dir=o.cache_dir, env=env)
        self.server.start(o.model_repository, http_port=http, grpc_port=grpc, metrics_port=o.metrics_port,
                          host="127.0.0.1" if o.proxy else o.host, metrics_host=o.host, log_path=o.log_path,
                          extra_args=extra_args, log_verbose=o.log_verbose, exit_timeout_secs=o.exit_timeout_secs,
                          admin_key=o.admin_key, open_admin_api=o.open_admin_api)
        stopping = lambda: (stop is not None and stop.is_set()) or self._stopping.is_set()  # noqa: E731
        if self.server.wait_ready(o.ready_timeout_s, stop_requested=stopping) is None:
            return False
        self._stub_pids = self.server.stub_pids()
        self._next_probe = time.monotonic() + o.probe_interval_s
        return True

    def watch(self, stop: threading.Event) -> None:
        """Until `stop` is set: check the engine, restart Triton when it is dead or wedged."""
        while not stop.wait(WATCH_INTERVAL_S):
            with self._lock:
                if self._stopping.is_set():
                    return
                problem = self.check()
                if problem and not stop.is_set():
                    self.restart(problem, stop)

    def check(self) -> str | None:
        """What is wrong with the running server, or None. (Also: a changed key file is reloaded.)"""
        if self.keys is not None and self.keys.changed():
            self.reload_keys()
        rc = self.server.poll()
        if rc is not None:
            return f"tritonserver exited with status {rc}"
        dead = [pid for pid in self._stub_pids if not process_alive(pid)]
        if dead:
            return f"the engine's process (Python backend stub, pid {', '.join(map(str, dead))}) died"
        if self.frontend is not None and self.frontend.poll() is not None:
            self.say(f"the scoring-API frontend exited with status {self.frontend.poll()}: restarting it")
            self.frontend.stop()
            self._start_frontend()
            self.frontend.wait_ready(self.options.ready_timeout_s)
        if self.proxy is not None and self.proxy.poll() is not None:
            self.say(f"envoy exited with status {self.proxy.poll()}: restarting it\n{self.proxy.log_tail(2000)}")
            self.proxy.stop()
            self._start_proxy()
        return self._check_probe()

    def _check_probe(self) -> str | None:
        if self._probe_thread is not None and not self._probe_thread.is_alive():
            self._probe_thread = None
            alive, what = self._probe_result
            if not alive:
                return f"the liveness probe failed ({what})"
        if self._probe_thread is None and time.monotonic() >= self._next_probe:
            url, timeout = self.server.http_url, self.options.probe_timeout_s

            def run():
                self._probe_result = probe(url, timeout=timeout)

            self._probe_thread = threading.Thread(target=run, name="prefillonly-probe", daemon=True)
            self._probe_thread.start()
            self._next_probe = time.monotonic() + self.options.probe_interval_s
        return None

    def restart(self, reason: str, stop: threading.Event | None = None) -> None:
        self.say(f"{reason}: restarting tritonserver (every request it held is answered with an error)")
        t0 = time.monotonic()
        self.server.kill()
        self._probe_thread = None
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                if self._start_server(stop):
                    self.restarts += 1
                    self.say(f"tritonserver restarted and ready in {time.monotonic() - t0:.1f} s (restart {self.restarts})")
                return
            except ServerError as e:
                self.say(f"restart attempt {attempt} failed: {e}")
                self.server.kill()
                time.sleep(min(2.0 * attempt, 10.0))  # e.g. the internal ports still held by the dead server
        raise ServerError(f"tritonserver could not be restarted after {RESTART_ATTEMPTS} attempts")

    def stop(self, timeout: float | None = None) -> int | None:
        """Drain the engine (waiting requests answered, the running one given up to
        exit_timeout_secs to finish), close the front door (every answer has been sent), then stop
        Triton: with no client connection left it exits at once."""
        self._stopping.set()  # a restart under way gives up waiting for readiness ...
        with self._lock:  # ... and releases the lock
            return self._stop(timeout)

    def _stop(self, timeout: float | None) -> int | None:
        rc = None
        if self.server is not None and self.server.poll() is None:
            if not self.server.drain(self.options.exit_timeout_secs):
                self.say(f"the running request did not finish within {self.options.exit_timeout_secs} s; stopping anyway")
        if self.proxy is not None:
            self.proxy.stop()
        if self.frontend is not None:
            self.frontend.stop()
        if self.server is not None:
            rc = self.server.stop(timeout=timeout if timeout is not None else 30, drain_timeout=0)
        if self._own_log:
            with contextlib.suppress(OSError):
                os.unlink(self.options.log_path)
        if self.keys is not None:
            self.keys.remove()
        return rc

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

