"""A fleet on one host: N tritonserver replicas, one engine each, behind one Envoy that routes by user.

    with LocalFleet("model_repository", replicas=3).start() as fleet:
        ... clients use fleet.http_url / fleet.grpc_url, with the x-prefillonly-user header ...
        fleet.replicas[1].kill()   # Envoy takes it out of rotation; its users move to the others

Why one engine per tritonserver (and not several model instances in one server): Triton hands a
request to whichever instance of a model is free, and a decoupled Python model has no say in it,
so N instances in one server would split every user's requests, and with them every user's
cached prefix, across N caches. A replica is therefore one tritonserver, one device, one engine,
one prefix cache, and routing happens in front of the servers, in Envoy (envoy.py).

GPU pinning, one way everywhere: a replica sees exactly one GPU through CUDA_VISIBLE_DEVICES and
its model's `device` parameter is "cuda" (deploy/kubernetes does the same with one
nvidia.com/gpu per pod). `gpus=[0, 1, 2]` here sets it per replica; None leaves the environment
as it is (CPU replicas).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .envoy import EnvoyProxy
from .envoy_config import FrontDoor, Upstream
from .triton_server import TritonServer


class LocalFleet:
    def __init__(self, model_repository: str | os.PathLike, replicas: int = 3, *, routing: str = "affinity",
                 gpus: list[int] | None = None, log_dir: str | os.PathLike | None = None, ready_timeout: float = 300.0,
                 **front_options):
        """front_options go to FrontDoor (http_port, grpc_port, hash_balance_factor, ...)."""
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, not {replicas}")
        if gpus is not None and len(gpus) != replicas:
            raise ValueError(f"{replicas} replicas need {replicas} GPU indices, got {gpus}")
        self.model_repository = Path(model_repository)
        self.count, self.routing, self.gpus = replicas, routing, gpus
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ready_timeout = ready_timeout
        self.front_options = front_options
        self.replicas: list[TritonServer] = []
        self.proxy: EnvoyProxy | None = None

    def _log(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir is not None else None

    def start(self) -> "LocalFleet":
        """Start every replica (in parallel: each loads its engine), wait until all are ready, then
        Envoy in front; on any failure everything started is stopped and the error raised."""
        try:
            for i in range(self.count):
                env = dict(os.environ)
                if self.gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = str(self.gpus[i])
                self.replicas.append(TritonServer(env=env).start(self.model_repository, log_path=self._log(f"replica{i}")))
            for r in self.replicas:
                r.wait_ready(self.ready_timeout)
            upstreams = [Upstream("127.0.0.1", r.http_port, r.grpc_port) for r in self.replicas]
            # free ports unless the caller chose them
            front = FrontDoor(upstreams, routing=self.routing, **{"http_port": 0, "grpc_port": 0, **self.front_options})
            self.proxy = EnvoyProxy(front, log_path=self._log("envoy")).start().wait_ready()
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Envoy first (no new requests), then every replica. Idempotent."""
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                self.proxy.stop()
        for r in self.replicas:
            with contextlib.suppress(Exception):
                r.stop(timeout=15)

    def __enter__(self) -> "LocalFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def http_url(self) -> str:
        return self.proxy.http_url

    @property
    def grpc_url(self) -> str:
        return self.proxy.grpc_url

    def replica_of_port(self, port: int) -> int:
        """Index of the replica serving HTTP or gRPC on `port`."""
        for i, r in enumerate(self.replicas):
            if port in (r.http_port, r.grpc_port):
                return i
        raise KeyError(port)
