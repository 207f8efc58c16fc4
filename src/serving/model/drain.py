"""Graceful shutdown handshake between the server process (TritonServer) and the model, through one file.

Triton gives a Python model no shutdown notice before its exit timeout: on SIGTERM it waits for
the requests in flight (in a decoupled model: every request the engine holds, waiting ones too)
and cuts off whatever is left after --exit-timeout-secs. So before TritonServer signals Triton it
creates the drain file; the model, which polls for it, closes its engine (new requests and every
waiting one are answered `engine_closed`), waits for the running request to finish and writes the
ack file: nothing is left to answer. Only then are client connections closed (Triton 2.51 waits
for open gRPC streams until its exit timeout, then hangs) and Triton gets SIGTERM.
"""

from __future__ import annotations

import os
from pathlib import Path

DRAIN_FILE_ENV = "PREFILLONLY_DRAIN_FILE"  # set by TritonServer in the server's environment


def ack_path(drain_file: str | os.PathLike) -> Path:
    return Path(f"{drain_file}.done")


def drain_file_from_env() -> Path | None:
    value = os.environ.get(DRAIN_FILE_ENV)
    return Path(value) if value else None


class DrainWatch:
    """The model's side: requested() once per watcher round is True (once) when a drain was asked for."""

    def __init__(self, drain_file: str | os.PathLike | None):
        self.drain_file = Path(drain_file) if drain_file else None
        self.drained = False

    def requested(self) -> bool:
        if self.drained or self.drain_file is None or not self.drain_file.exists():
            return False
        self.drained = True
        return True

    def acknowledge(self) -> None:
        if self.drain_file is not None:
            ack_path(self.drain_file).write_text("drained\n")
