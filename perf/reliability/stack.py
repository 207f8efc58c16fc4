"""The serve stack under test and what /proc tells of its processes."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

from clients.transport import generate_answer
from perf import benchutil as bu

REPO = bu.REPO_ROOT / "model_repository"
YES_NO = [" Yes", " No"]
LOG_PROBLEM_MARKERS = ("Segmentation fault", "signal 11", "core dumped", "terminate called", "Traceback",
                       "Stub process", "is not healthy", "Killed")


class Stack:
    """Envoy + supervised tritonserver on a copy of model_repository/ (engine settings set by
    keyword), with the supervisor's watchdog running, as `scripts/serve.sh` runs it."""

    def __init__(self, out_dir: Path, name: str, **engine_parameters):
        self.out_dir, self.name, self.parameters = out_dir, name, engine_parameters
        self.log_path = out_dir / f"{name}-tritonserver.log"
        self.events: list[str] = []  # what the supervisor said (restarts), what the watchdog hit
        self.stop_event = threading.Event()
        self.sup = None
        self._tmp = None
        self._watcher = None

    def __enter__(self) -> "Stack":
        from prefillonly.serving.host.addresses import free_ports
        from prefillonly.serving.host.supervisor import ServeOptions, Supervisor
        from prefillonly.serving.host.model_settings import copy_model_repository

        self._tmp = tempfile.mkdtemp(prefix="prefillonly-reliability-")
        repo = copy_model_repository(REPO, Path(self._tmp) / "repo", **self.parameters)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        http, grpc, metrics = free_ports(3)
        options = ServeOptions(model_repository=str(repo), http_port=http, grpc_port=grpc, metrics_port=metrics,
                               ready_timeout_s=900, log_path=str(self.log_path))
        self.sup = Supervisor(options, say=self._say)
        t0 = time.perf_counter()
        try:
            if not self.sup.start(self.stop_event):
                raise RuntimeError("serve stack start was interrupted")
        except BaseException:
            self.__exit__()
            raise
        self.ready_s = time.perf_counter() - t0
        # the ports stay when the watchdog restarts a process
        self.http_url, self.grpc_url, self.metrics_url = self.sup.http_url, self.sup.grpc_url, self.sup.metrics_url
        self._watcher = threading.Thread(target=self._watch, name="reliability-watchdog", daemon=True)
        self._watcher.start()
        bu.log(f"{self.name}: serve stack ready in {self.ready_s:.0f} s (Envoy http {self.http_url}, grpc {self.grpc_url}; "
               f"tritonserver pid {self.sup.server.pid}; log {self.log_path})")
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self._watcher is not None:
            self._watcher.join(10)
        if self.sup is not None:
            self.sup.stop(timeout=60)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _say(self, msg: str) -> None:
        self.events.append(msg)
        bu.log(f"{self.name}: supervisor: {msg}")

    def _watch(self) -> None:
        try:
            self.sup.watch(self.stop_event)
        except Exception as e:  # e.g. Envoy died: the watchdog gives up; the report says so
            self.events.append(f"watchdog stopped: {type(e).__name__}: {e}")
            bu.log(f"{self.name}: watchdog stopped: {e}")

    def processes(self) -> dict[str, list[int]]:
        """Role -> pids for everything the stack runs right now (pids change after a restart).
        The stubs of one model (the forwarder has several instances) share a role."""
        procs = {"tritonserver": [self.sup.server.pid]}
        for pid in self.sup.server.stub_pids():
            procs.setdefault(f"stub {stub_model(pid)}", []).append(pid)
        if self.sup.proxy is not None:
            procs["envoy"] = [self.sup.proxy.pid]
        return procs

    def health(self) -> dict:
        """Is everything still up, has nothing restarted, does a good request get an answer?"""
        from prefillonly.serving.host.process import process_alive

        answer = generate_answer(self.http_url, {"text_input": "Is the sky blue? Answer:", "allowed_tokens": YES_NO}, 60)
        return {"tritonserver_running": self.sup.server.poll() is None,
                "stubs_alive": all(process_alive(p) for p in self.sup.server.stub_pids()) and bool(self.sup.server.stub_pids()),
                "envoy_running": self.sup.proxy is None or self.sup.proxy.poll() is None,
                "restarts": self.sup.restarts, "good_request": f"{answer.status} {answer.message}"[:80],
                "good_request_ok": answer.kind == "ok", "supervisor_events": list(self.events),
                "log_problems": log_problems(self.log_path)}


def stub_model(pid: int) -> str:
    """The model a Python backend stub serves: its first argument is <repo>/<model>/<version>/model.py."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid{pid}"
    for arg in args:
        if arg.endswith(b"model.py"):
            return Path(arg.decode(errors="replace")).parent.parent.name
    return f"pid{pid}"


def log_problems(path: Path) -> list[str]:
    """Lines of the tritonserver log that speak of a crash (first 10)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:200] for line in lines if any(m in line for m in LOG_PROBLEM_MARKERS)][:10]
