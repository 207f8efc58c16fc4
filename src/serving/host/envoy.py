"""The Envoy process in front of Triton (or of a fleet): started on a config from envoy_config.py,
ready when Envoy says so, stopped with its temporary files.

    front = FrontDoor([Upstream("127.0.0.1", server.http_port, server.grpc_port)], http_port=8000, grpc_port=8001)
    with EnvoyProxy(front).start().wait_ready() as proxy:
        ... clients use proxy.http_url / proxy.grpc_url ...

With `FrontDoor(live_endpoints=True)` the replicas can change while Envoy runs: set_upstreams()
rewrites the endpoint files Envoy watches, and wait_for_hosts() waits until Envoy routes to
exactly the replicas wanted (healthy), read from its admin /clusters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from .addresses import dial, free_ports
from .envoy_config import FrontDoor, ProxyError, Upstream, endpoint_files, envoy_binary, envoy_config
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
        self._tmp_dir = tempfile.mkdtemp(prefix="envoy-")
        if front.live_endpoints:
            self._write_endpoints(front)
        self.config = envoy_config(front, self._tmp_dir if front.live_endpoints else None)
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

    def set_upstreams(self, upstreams: list[Upstream]) -> None:
        """Route to `upstreams` from now on (live_endpoints only); Envoy applies it within a moment
        and health-checks new replicas before they get requests (see wait_for_hosts)."""
        if not self.front.live_endpoints:
            raise ProxyError("set_upstreams needs a front door with live_endpoints=True")
        self.front = dataclasses.replace(self.front, upstreams=list(upstreams))
        self._write_endpoints(self.front)

    def _write_endpoints(self, front: FrontDoor) -> None:
        for name, text in endpoint_files(front).items():
            # Envoy reloads a watched file when another is moved onto it: never a half-written one
            tmp = Path(self._tmp_dir) / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, Path(self._tmp_dir) / name)

    def cluster_hosts(self) -> dict[str, dict[str, bool]]:
        """Envoy's view, from its admin /clusters: cluster name -> {"host:port": healthy}."""
        with urllib.request.urlopen(f"{self.admin_url}/clusters?format=json", timeout=5) as r:
            data = json.load(r)
        out = {}
        for cluster in data.get("cluster_statuses", []):
            hosts = {}
            for h in cluster.get("host_statuses", []):
                address = h["address"]["socket_address"]
                status = h.get("health_status", {})
                # pending_dynamic_removal: out of the endpoints but still routed to until it fails a check
                bad = [k for k, v in status.items() if k not in ("eds_health_status", "pending_dynamic_removal") and v is True]
                hosts[f"{address['address']}:{address['port_value']}"] = not bad and \
                    status.get("eds_health_status", "HEALTHY") == "HEALTHY"
            out[cluster["name"]] = hosts
        return out

    def wait_for_hosts(self, http_addresses: set[str], timeout: float = 30.0, settle_s: float = 1.0) -> None:
        """Until the healthy hosts of Envoy's Triton HTTP clusters (those it routes to) are exactly
        `http_addresses` ("host:port"), then `settle_s` more: the admin API shows the main thread's
        view, and the worker threads that route take the new tables a moment later (measured: the
        first few requests right after still went by the old table). ProxyError after `timeout`
        seconds with what Envoy has instead."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                clusters = {n: h for n, h in self.cluster_hosts().items() if n.startswith("triton_http")}
            except OSError:  # the admin API busy or not up yet: ask again
                clusters = {}
            if clusters and all({a for a, ok in h.items() if ok} == http_addresses for h in clusters.values()):
                time.sleep(settle_s)
                return
            if time.monotonic() >= deadline or self.poll() is not None:
                raise ProxyError(f"Envoy did not converge on {sorted(http_addresses)} within {timeout:.0f} s: {clusters}")
            time.sleep(0.1)

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
