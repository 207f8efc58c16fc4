"""A fleet on one host: N tritonserver replicas, one engine each, behind one Envoy that routes by user.

    with LocalFleet("model_repository", replicas=3).start() as fleet:
        ... clients use fleet.http_url / fleet.grpc_url, with the x-prefillonly-user header ...
        fleet.replicas[1].kill()   # Envoy takes it out of rotation; its users move to the others
        fleet.add_replica()        # a new replica joins the running front door

Why one engine per tritonserver (and not several model instances in one server): Triton hands a
request to whichever instance of a model is free, and a decoupled Python model has no say in it,
so N instances in one server would split every user's requests, and with them every user's
cached prefix, across N caches. A replica is therefore one tritonserver, one device, one engine,
one prefix cache, and routing happens in front of the servers, in Envoy (envoy.py).

Membership is live: Envoy reads the replicas from files it watches (FrontDoor.live_endpoints), so
add_replica() and remove_replica() change a running fleet, as a Kubernetes scale-up or -down
changes the DNS records Envoy resolves. A replica that dies on its own (a crash, an OOM kill) is
reaped within `reap_interval_s`: its process collected (no zombie), what is left of its process
group (Triton's Python stubs, which outlive their server) killed, its shared memory removed, and
it is taken out of Envoy's endpoints (health checks would take it out of rotation anyway, a few
seconds later).

GPU pinning, one way everywhere: a replica sees exactly one GPU through CUDA_VISIBLE_DEVICES and
its model's `device` parameter is "cuda" (deploy/kubernetes does the same with one
nvidia.com/gpu per pod). `gpus=[0, 1, 2]` here sets it per replica; None leaves the environment
as it is (CPU replicas).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .envoy import EnvoyProxy
from .envoy_config import FrontDoor, Upstream
from .picker_process import PickerProcess, write_members
from .triton_server import TritonServer


class LocalFleet:
    def __init__(self, model_repository: str | os.PathLike, replicas: int = 3, *, routing: str = "affinity",
                 gpus: list[int] | None = None, log_dir: str | os.PathLike | None = None, ready_timeout: float = 300.0,
                 reap_interval_s: float = 0.5, picker: bool = False, picker_options: dict | None = None, **front_options):
        """front_options go to FrontDoor (http_port, grpc_port, affinity_lb, hash_balance_factor, ...).
        picker: run the endpoint picker (PickerProcess, `picker_options` its keyword arguments) and
        route HTTP requests by it (FrontDoor.picker), Maglev as the fallback; it follows the
        members through a members file."""
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, not {replicas}")
        if gpus is not None and len(gpus) != replicas:
            raise ValueError(f"{replicas} replicas need {replicas} GPU indices, got {gpus}")
        self.model_repository = Path(model_repository)
        self.count, self.routing, self.gpus = replicas, routing, gpus
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ready_timeout = ready_timeout
        self.reap_interval_s = reap_interval_s
        self.front_options = front_options
        self.replicas: list[TritonServer] = []  # every replica ever started, by index (the dead ones too)
        self.members: list[int] = []  # indices of the replicas in Envoy's endpoints
        self.reaped: dict[int, int] = {}  # index -> exit status of each replica that died on its own, once reaped
        self.proxy: EnvoyProxy | None = None
        self.picker: PickerProcess | None = None
        self.picker_options = dict(picker_options or {}) if picker else None
        self._picker_dir = tempfile.mkdtemp(prefix="fleet-picker-") if picker else None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._reaper: threading.Thread | None = None

    def _log(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir is not None else None

    def _launch(self, gpu: int | None) -> TritonServer:
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        server = TritonServer(env=env)
        self.replicas.append(server)
        return server.start(self.model_repository, log_path=self._log(f"replica{len(self.replicas) - 1}"))

    def start(self) -> "LocalFleet":
        """Start every replica (in parallel: each loads its engine), wait until all are ready, then
        Envoy in front; on any failure everything started is stopped and the error raised."""
        try:
            for i in range(self.count):
                self._launch(self.gpus[i] if self.gpus is not None else None)
            for r in self.replicas:
                r.wait_ready(self.ready_timeout)
            self.members = list(range(self.count))
            if self.picker_options is not None:
                self._write_picker_members()
                self.start_picker()
            # free ports unless the caller chose them
            front = FrontDoor(self.upstreams, routing=self.routing, live_endpoints=True, fleet=True,
                              picker=self.picker.address if self.picker else None,
                              **{"http_port": 0, "grpc_port": 0, **self.front_options})
            self.proxy = EnvoyProxy(front, log_path=self._log("envoy")).start().wait_ready()
            self._reaper = threading.Thread(target=self._reap_loop, name="fleet-reaper", daemon=True)
            self._reaper.start()
            return self
        except BaseException:
            self.stop()
            raise

    @property
    def upstreams(self) -> list[Upstream]:
        """The members as Envoy has them (Upstream.key: what it places each by)."""
        return [Upstream("127.0.0.1", self.replicas[i].http_port, self.replicas[i].grpc_port) for i in self.members]

    def _set_members(self, members: list[int]) -> None:
        self.members = members
        self.proxy.set_upstreams(self.upstreams)
        if self.picker_options is not None:
            self._write_picker_members()

    # -- the endpoint picker -------------------------------------------------------------------
    @property
    def picker_members_file(self) -> Path:
        return Path(self._picker_dir) / "members.json"

    def _write_picker_members(self) -> None:
        write_members(self.picker_members_file, [
            {"key": u.key, "destination": f"{u.host}:{u.http_port}", "metrics_url": self.replicas[i].metrics_url}
            for i, u in zip(self.members, self.upstreams)])

    def start_picker(self) -> PickerProcess:
        """Start (or, after stop_picker, restart on the same port) the picker and wait until it serves."""
        port = self.picker.port if self.picker is not None else 0
        self.picker = PickerProcess(self.picker_members_file, port, log_path=self._log("picker"),
                                    **self.picker_options).start()
        return self.picker.wait_ready()

    def stop_picker(self, kill: bool = False) -> None:
        """Stop the picker (SIGKILL with kill=True): Envoy falls back to Maglev until it returns."""
        if kill:
            self.picker.send_signal(9)
        self.picker.stop(timeout=5)

    def wait_for_members(self, timeout: float = 30.0) -> None:
        """Until Envoy routes to exactly the current members (each healthy)."""
        with self._lock:
            wanted = {u.key for u in self.upstreams}
        self.proxy.wait_for_hosts(wanted, timeout)

    def add_replica(self, gpu: int | None = None) -> int:
        """Start one more replica, wait until it is ready, add it to Envoy's endpoints and wait
        until Envoy routes to it; its index. About 1/N of the users move to it (their next request
        is cold there): see envoy_config's "Which users move"."""
        server = self._launch(gpu)
        try:
            server.wait_ready(self.ready_timeout)
        except BaseException:
            server.stop(timeout=10)
            raise
        with self._lock:
            index = self.replicas.index(server)
            self._set_members(self.members + [index])
        self.wait_for_members()
        return index

    def remove_replica(self, index: int, drain_timeout: float = 30.0) -> int | None:
        """Scale down gracefully: out of Envoy's endpoints first (its users move on their next
        request), then the server drained and stopped; its exit status."""
        with self._lock:
            if index not in self.members:
                raise ValueError(f"replica {index} is not in the fleet (members {self.members})")
            self._set_members([i for i in self.members if i != index])
        self.wait_for_members()
        return self.replicas[index].stop(timeout=drain_timeout)

    def _reap_loop(self) -> None:
        while not self._stopping.wait(self.reap_interval_s):
            with self._lock:
                for i in list(self.members):
                    status = self.replicas[i].poll()  # collects the exit status: no zombie
                    if status is None:
                        continue
                    print(f"fleet: replica {i} exited with status {status}; reaping it and taking it out of Envoy's endpoints",
                          file=sys.stderr, flush=True)
                    # out of rotation first (its users move at once), then its leftovers killed;
                    # `reaped` is written last, so whoever sees it sees the whole reaping done
                    with contextlib.suppress(Exception):
                        self._set_members([m for m in self.members if m != i])
                    with contextlib.suppress(Exception):
                        self.replicas[i].stop(timeout=5)  # kills its group's leftovers (the stubs)
                    self.reaped[i] = status

    def stop(self) -> None:
        """Envoy first (no new requests), then every replica. Idempotent."""
        self._stopping.set()
        if self._reaper is not None:
            self._reaper.join(10)
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                self.proxy.stop()
        if self.picker is not None:
            with contextlib.suppress(Exception):
                self.picker.stop(timeout=5)
        # all at once: each drains and waits for its own requests, so one replica's wait never
        # holds up another's (one after the other, a fleet of N took N drains to stop)
        with ThreadPoolExecutor(max(1, len(self.replicas)), thread_name_prefix="fleet-stop") as pool:
            list(pool.map(_stop_quietly, self.replicas))

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


def _stop_quietly(replica: TritonServer) -> None:
    with contextlib.suppress(Exception):
        replica.stop(timeout=15)
