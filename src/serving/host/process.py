"""LoggedProcess: a long-running child in its own process group, its output appended to a log.

The common half of TritonServer (triton_server.py) and EnvoyProxy (envoy.py): spawning, the log and
its tail, signals to the whole group (Triton's Python stubs go with it), readiness polling, and an
atexit net so that a crashed test or script never leaves a server or proxy behind. Also what /proc
tells of other processes (stat_fields, process_alive, process_group, child_pids, process_name). Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

_LIVE: "set[LoggedProcess]" = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_leftovers() -> None:
    with _LIVE_LOCK:
        leftovers = list(_LIVE)
    for proc in leftovers:
        with contextlib.suppress(Exception):
            proc.stop(timeout=5)


def log_tail(path: str | os.PathLike, max_bytes: int = 8000) -> str:
    """The last `max_bytes` of a log file ("" if it is gone)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def http_status(url: str, timeout: float = 2.0) -> int:
    """HTTP status of a GET of `url` (0: no answer at all: refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, ...; the name may hold
    spaces and parentheses, so it is cut at the last ")"); None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def process_group(pgid: int) -> list[int]:
    """Every live process whose process group is `pgid` (a server and the stubs it started)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(entry.name)
        if fields and int(fields[2]) == pgid:  # after the state and the ppid
            pids.append(int(entry.name))
    return sorted(pids)


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's), from /proc."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in children.read_text().split()]
    return found


def process_name(pid: int) -> str:
    """/proc/PID/comm: the executable's name, cut to 15 characters ("" if the process is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class LoggedProcess:
    name = "process"  # in messages and temporary log names
    error: type[Exception] = RuntimeError  # what spawn and wait failures raise

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.command: list[str] = []
        self.log_path: Path | None = None
        self._own_log = False  # a temporary log, removed on release (its tail is kept)
        self._log_file = None
        self._last_tail = ""

    # -- subclasses implement (is_ready) or may override (stop, _after_stop, describe) ---------
    def is_ready(self) -> bool:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, SIGKILL after `timeout` seconds, then release; the exit status (None if never
        started). Idempotent. TritonServer overrides it (it drains first); EnvoyProxy's
        `_after_stop` also removes its config folder."""
        if self.process is None:
            return None
        self._terminate(timeout)
        self._after_stop()
        return self.process.returncode

    def _after_stop(self) -> None:
        self._release()

    def describe(self) -> str:
        """Addresses for repr()."""
        return ""

    # -- shared --------------------------------------------------------------------------------
    def _spawn(self, command, log_path: str | os.PathLike | None, **popen_kwargs) -> None:
        """Start `command` (stdout and stderr appended to `log_path`, default a temporary file)."""
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path, self._own_log = Path(name), True
        else:
            self.log_path, self._own_log = Path(log_path), False
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.command = [str(c) for c in command]
        self._log_file = open(self.log_path, "ab", buffering=0)
        try:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True, **popen_kwargs)
        except OSError as e:
            self._release()
            raise self.error(f"could not run {self.command[0]}: {e}") from e
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def poll(self) -> int | None:
        """None while running, else the exit status (negative: killed by that signal)."""
        return self.process.poll() if self.process is not None else None

    def send_signal(self, sig: int) -> None:
        """Signal the whole process group."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def wait_ready(self, timeout: float, step: float = 0.2, hint: str = "",
                   stop_requested: Callable[[], bool] | None = None):
        """Poll is_ready() until it holds and return self; None as soon as `stop_requested()`
        holds; self.error with the log's tail at once if the process exits, or after `timeout`
        seconds (`hint` says what a hang usually means)."""
        if self.process is None:
            raise self.error(f"{self.name} not started")
        deadline = time.monotonic() + timeout
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise self.error(f"{self.name} exited with status {rc} before it was ready "
                                 f"(command: {' '.join(self.command)})\n--- log tail ---\n{self.log_tail()}")
            if self.is_ready():
                return self
            if stop_requested is not None and stop_requested():
                return None
            if time.monotonic() >= deadline:
                raise self.error(f"{self.name} not ready after {timeout:.0f} s (still running, pid {self.pid}{hint})"
                                 f"\n--- log tail ---\n{self.log_tail()}")
            time.sleep(step)

    def _terminate(self, timeout: float) -> None:
        """SIGTERM to the group, SIGKILL after `timeout` seconds; returns once the process is gone."""
        if self.process.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.process.wait(10)

    def log_tail(self, max_bytes: int = 8000) -> str:
        """The end of the output (kept after release removed a temporary log)."""
        return (log_tail(self.log_path, max_bytes) if self.log_path is not None else "") or self._last_tail

    def _release(self) -> None:
        """After the process ended: forget it, close the log (a temporary one is removed)."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_log and self.log_path is not None:
            self._last_tail = self.log_tail()
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "not started" if self.process is None else (
            f"pid {self.pid} running" if self.poll() is None else f"exited {self.poll()}")
        return f"<{type(self).__name__} {state} {self.describe()}>"
