"""The fleet's endpoint picker (prefillonly.serving.picker) as a child process.

    picker = PickerProcess(members_file, decisions_log=...).start().wait_ready()
    ... FrontDoor(picker=picker.address) ...
    picker.stop()

Standard library only: the picker's gRPC and Envoy protos stay in its process.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from .addresses import free_ports
from .process import LoggedProcess


def write_members(path: str | os.PathLike, members: list[dict]) -> None:
    """The picker's members file ({"key", "destination", "metrics_url"} per replica), replaced
    atomically (write, then rename) so the picker never reads half of it."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(members))
    tmp.replace(path)


class PickerError(RuntimeError):
    """The picker could not start or become ready."""


class PickerProcess(LoggedProcess):
    name = "prefillonly-picker"
    error = PickerError

    def __init__(self, members_file: str | os.PathLike, port: int = 0, *, report_interval_s: float | None = None,
                 cache_blocks: int | None = None, decisions_log: str | os.PathLike | None = None,
                 workers: int | None = None, log_path: str | os.PathLike | None = None):
        super().__init__()
        self.members_file, self.port = str(members_file), port
        self.options = {"--report-interval-s": report_interval_s, "--cache-blocks": cache_blocks,
                        "--decisions-log": decisions_log, "--workers": workers}
        self._wanted_log = log_path

    def start(self) -> "PickerProcess":
        if self.port == 0:
            self.port = free_ports(1)[0]
        command = [sys.executable, "-m", "prefillonly.serving.picker", "--host", "127.0.0.1", "--port", str(self.port),
                   "--members-file", self.members_file]
        for flag, value in self.options.items():
            if value is not None:
                command += [flag, str(value)]
        self._spawn(command, self._wanted_log)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def is_ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> "PickerProcess":
        return super().wait_ready(timeout, step=0.1)

    def describe(self) -> str:
        return self.address
