"""python -m prefillonly.serving.picker --port 9002 (--members-file members.json | --dns replicas.svc) [--decisions-log picks.jsonl]

Runs the endpoint picker (service.py) until SIGTERM / SIGINT. Prints "picker: serving on
host:port" once it accepts calls."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures

from .choice import DEFAULT_STICK_MARGIN_S, Picker
from .service import DnsMembers, Members, PickerState, servicer

DEFAULT_REPORT_INTERVAL_S = 0.1
DEFAULT_BLOCK_SIZE = 16  # EngineConfig.cache_block_size's default (tests/fleet/test_picker_choice.py checks)
DEFAULT_CACHE_BLOCKS = 16384  # 262,144 tokens of prefix cache per replica
# the seconds per token assumed of a replica before it reports a JCT fit (SmolLM2-135M on a 2-core
# CPU runs ~2,000-3,000 tokens/s; a GPU replica reports its fit within a few requests)
DEFAULT_FALLBACK_S_PER_TOKEN = 4e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefillonly.serving.picker", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9002, help="gRPC port Envoy's ext_proc filter calls (0: a free one)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--members-file", help='JSON list of {"key", "destination", "metrics_url"}, reread live')
    where.add_argument("--dns", help="one DNS name resolving to every ready replica (a headless Service), reresolved live")
    p.add_argument("--replica-http-port", type=int, default=8000, help="with --dns: the replicas' HTTP port")
    p.add_argument("--replica-metrics-port", type=int, default=8002, help="with --dns: the replicas' metrics port")
    p.add_argument("--report-interval-s", type=float, default=DEFAULT_REPORT_INTERVAL_S)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="the replicas' prefix-cache block size")
    p.add_argument("--cache-blocks", type=int, default=DEFAULT_CACHE_BLOCKS, help="each replica's prefix-cache size, in blocks")
    p.add_argument("--stick-margin-s", type=float, default=DEFAULT_STICK_MARGIN_S)
    p.add_argument("--fallback-s-per-token", type=float, default=DEFAULT_FALLBACK_S_PER_TOKEN)
    p.add_argument("--workers", type=int, default=16,
                   help="gRPC worker threads: requests being routed at once (each holds one for well under 1 ms)")
    p.add_argument("--decisions-log", default=None, help="append every decision here (JSON lines)")
    return p


def main(argv: list[str] | None = None) -> int:
    import grpc

    a = build_parser().parse_args(argv)
    picker = Picker(a.block_size, a.cache_blocks, a.fallback_s_per_token, a.stick_margin_s)
    members = Members(a.members_file) if a.members_file else DnsMembers(a.dns, a.replica_http_port, a.replica_metrics_port)
    state = PickerState(picker, members, a.report_interval_s, decisions_log=a.decisions_log).start()
    service, add = servicer(state)
    if a.workers < 1:
        raise SystemExit(f"--workers must be >= 1, not {a.workers}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=a.workers))
    add(service, server)
    port = server.add_insecure_port(f"{a.host}:{a.port}")
    server.start()
    print(f"picker: serving on {a.host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
