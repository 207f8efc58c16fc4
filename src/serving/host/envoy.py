"""The Envoy process in front of Triton (or of a fleet): started on a config from envoy_config.py,
ready when Envoy says so, stopped with its temporary files.

    front = FrontDoor([Upstream("127.0.0.1", server.http_port, server.grpc_port)], http_port=8000, grpc_port=8001)
    with EnvoyProxy(front).start().wait_ready() as proxy:
        ... clients use proxy.http_url / proxy.grpc_url ...
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from .addresses import dial, free_ports
from .envoy_config import FrontDoor, ProxyError, envoy_binary, envoy_config
from .process import LoggedProcess, http_status


class EnvoyProxy(LoggedProcess):
    """One envoy process in front of `front.upstreams`.

        proxy = EnvoyProxy(front).start().wait_ready()   # ProxyError with the log tail
        ... proxy.http_url, proxy.grpc_url ...
        proxy.stop()

    or `with EnvoyProxy(front).start() as proxy:`. Ports of `front` that are 0 are chosen free at
    start(); `self.front` then holds the ports in use. Output goes to `log_path`, by default a
    temporary file removed by stop() (its tail is kept for log_tail()).
    """

    name = "envoy"
    error = ProxyError

    def __init__(self, front: FrontDoor, log_path: str | os.PathLike | None = None):
        super().__init__()
        self.front = front
        self.config: dict | None = None
        self._wanted_log = log_path
        self._tmp_dir: str | None = None

    def start(self) -> "EnvoyProxy":
        """Write the config and start envoy; returns at once (see wait_ready)."""
        if self.process is not None:
            raise ProxyError("this EnvoyProxy was already started")
        binary = envoy_binary()
        front = self.front
        zero = [name for name in ("http_port", "grpc_port", "admin_port") if getattr(front, name) == 0]
        if zero:
            front = dataclasses.replace(front, **dict(zip(zero, free_ports(len(zero)))))
        self.front = front
        self.config = envoy_config(front)
        self._tmp_dir = tempfile.mkdtemp(prefix="envoy-")
        config_path = Path(self._tmp_dir) / "envoy.json"
        config_path.write_text(json.dumps(self.config, indent=1))
        command = [
            str(binary), "-c", str(config_path),
            # no shared memory / domain socket for hot restart: several proxies can run side by side
            "--disable-hot-restart",
            "--log-level", "warn",
        ]
        try:
            self._spawn(command, self._wanted_log)
        except ProxyError:
            self._cleanup()
            raise
        return self

    def is_ready(self) -> bool:
        return http_status(f"{self.admin_url}/ready") == 200

    def wait_ready(self, timeout: float = 30.0) -> "EnvoyProxy":
        """Poll the admin /ready until 200. Envoy answers 200 once its listeners are up and the
        first round of health checks is done (it waits for that before it calls itself ready), so
        a replica that is ready now gets requests at once. Raises ProxyError with the log tail if
        the process exits, or after `timeout` seconds."""
        return super().wait_ready(timeout, step=0.1)

    # stop(): LoggedProcess's (SIGTERM: Envoy exits at once, cutting open connections)
    def _after_stop(self) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        self._release()
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    # -- addresses and logs --------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return dial(self.front.host, self.front.http_port)

    @property
    def grpc_url(self) -> str:
        return dial(self.front.host, self.front.grpc_port, scheme=None)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.front.admin_port}"

    def describe(self) -> str:
        return f"http={self.http_url} grpc={self.grpc_url} admin={self.admin_url}"
