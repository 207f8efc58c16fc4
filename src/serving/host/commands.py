"""`python -m prefillonly.serving serve --model-repository DIR`: the real tritonserver behind Envoy,
supervised (prefillonly.serving.host.supervisor), in the foreground; `... probe` (container liveness).
(perf_analyzer: `python -m perf.perf_analyzer` from a checkout.)"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ...contract.tenants import Quota, TenantConfigError, parse_quota
from .envoy_config import DEFAULT_MAX_REQUEST_BYTES, ProxyError
from .frontend_process import FrontendError
from .probe import probe, probe_key
from .server_tree import TRITON_SERVER_VERSION, ServerError
from .supervisor import ServeOptions, Supervisor
from .triton_server import ADMIN_APIS, ADMIN_KEY_HEADER

USAGE_HINT = """\
prefillonly ready: tritonserver {version} (pid {pid}) serving {repo}{behind}
  HTTP    {http}
  gRPC    {grpc}
  metrics {metrics}
  {admin}

{keys}Score over HTTP (decoupled model: use generate, not infer):
  curl -s {http}/v2/models/prefillonly/generate -H 'Content-Type: application/json' \\
       -d '{{"text_input": "Is the sky blue on a clear day? Answer Yes or No. Answer:", "allowed_tokens": [" Yes", " No"]}}'
{apis}gRPC (decoupled models need the bidirectional stream):
  import tritonclient.grpc as g; c = g.InferenceServerClient("{grpc}")
  c.start_stream(callback=lambda result, error: ...); c.async_stream_infer("prefillonly", inputs)
perf_analyzer (from a checkout): python -m perf.perf_analyzer -- -m prefillonly -u {grpc} -i grpc --streaming ...
Liveness: python -m prefillonly.serving probe --url {http}
Ctrl-C (SIGINT) or SIGTERM stops the server (waiting requests are answered engine_closed first).
"""


SCORING_APIS_HINT = """\
Scoring APIs (Cohere / Jina / vLLM / TEI rerank, SGLang / vLLM score, OpenAI completions, OpenAI / vLLM / TEI / Cohere
embeddings and classification, as the checkpoint answers; models: GET {http}/v1/models):
  curl -s {http}/v1/rerank -H 'Content-Type: application/json' \\
       -d '{{"model": "qwen3-reranker", "query": "capital of France", "documents": ["Paris is the capital of France.", "Berlin is in Germany."]}}'
"""


def _follow(path: Path, stop: threading.Event, out=sys.stderr) -> None:
    """Copy what the server writes to its log file onto our stderr, until `stop` is set (a
    restarted server appends to the same file)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                out.write(chunk.decode("utf-8", errors="replace"))
                out.flush()
            elif stop.is_set():
                return
            else:
                time.sleep(0.2)


def _serve_options(a: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model_repository=str(Path(a.model_repository).resolve()), host=a.host, http_port=a.http_port,
        grpc_port=a.grpc_port, metrics_port=a.metrics_port, proxy=not a.no_proxy, frontend=not a.no_frontend,
        frontend_upstream=a.frontend_upstream,
        max_request_bytes=a.max_request_bytes,
        probe_interval_s=a.probe_interval, probe_timeout_s=a.probe_timeout, ready_timeout_s=a.ready_timeout,
        exit_timeout_secs=a.exit_timeout_secs, admin_key=a.admin_key or os.environ.get("PREFILLONLY_ADMIN_KEY"),
        open_admin_api=a.open_admin_api, log_path=a.log_file, log_verbose=a.log_verbose, cache_dir=a.cache_dir,
        server_dir=a.server_dir or os.environ.get("PREFILLONLY_TRITON_DIR"),
        api_keys=list(a.api_key or []) + _env_keys(), api_key_file=a.api_key_file or os.environ.get("PREFILLONLY_API_KEY_FILE"),
        tenant_quota=a.tenant_quota, extra_args=list(a.extra))


def _serve(a: argparse.Namespace) -> int:
    options = _serve_options(a)
    supervisor = Supervisor(options)
    stop = threading.Event()
    stop_follow = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        if len(received) == 1:
            print(f"\nprefillonly.serving: {signal.Signals(signum).name}: draining and stopping (again to kill)",
                  file=sys.stderr, flush=True)
            stop.set()
        else:
            for part in (supervisor.server, supervisor.proxy, supervisor.frontend):
                if part is not None:
                    part.send_signal(signal.SIGKILL)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: supervisor.reload_keys())
    if not options.proxy:
        print("prefillonly.serving: --no-proxy: Triton's ports face clients directly; a JSON body over ~4 MiB or the "
              "triton_grpc_error header can crash Triton 2.51", file=sys.stderr, flush=True)
    rc = 0
    try:
        if supervisor.start(stop):
            if not a.quiet:
                log = supervisor.server.log_path
                threading.Thread(target=_follow, args=(log, stop_follow), daemon=True).start()
                time.sleep(0.3)  # let the follower print the startup table first
            admin = ("admin APIs (" + ", ".join(ADMIN_APIS) + ") open to anyone (--open-admin-api)" if options.open_admin_api
                     else f"admin APIs ({', '.join(ADMIN_APIS)}) need header {ADMIN_KEY_HEADER}: "
                          + ("the --admin-key value" if options.admin_key else "a random key (set --admin-key to use them)"))
            apis = SCORING_APIS_HINT
            behind = f" behind Envoy (bodies up to {options.max_request_bytes:,} bytes)" if options.proxy else ""
            print("\n" + USAGE_HINT.format(version=TRITON_SERVER_VERSION, pid=supervisor.server.pid, repo=options.model_repository,
                                           behind=behind, http=supervisor.http_url, grpc=supervisor.grpc_url,
                                           metrics=supervisor.metrics_url, admin=admin, keys=_keys_hint(supervisor),
                                           apis=apis.format(http=supervisor.http_url)
                                           if supervisor.frontend is not None else ""), flush=True)
            supervisor.watch(stop)
    except (ServerError, ProxyError, FrontendError, TenantConfigError) as e:
        print(f"prefillonly.serving: {e}", file=sys.stderr)
        rc = 1
    finally:
        server_rc = supervisor.stop(timeout=a.stop_timeout)
        stop_follow.set()
    if rc == 0 and server_rc:
        rc = 128 - server_rc if server_rc < 0 else server_rc  # killed by signal N -> 128+N, as a shell reports it
    return rc


def _keys_hint(supervisor) -> str:
    if supervisor.keys is None:  # the supervisor said so at start, once
        return ""
    return (f"API keys: {supervisor.keys.describe()}. Add -H 'Authorization: Bearer <key>' to each call below\n"
            "(gRPC: the metadata authorization: Bearer <key>); the health checks need none. SIGHUP re-reads the key file.\n\n")


def _env_keys() -> list[str]:
    """PREFILLONLY_API_KEYS: keys separated by commas or spaces (a Secret as an environment variable)."""
    return os.environ.get("PREFILLONLY_API_KEYS", "").replace(",", " ").split()


def _quota(text: str) -> Quota:
    try:
        return parse_quota(text, "--tenant-quota")
    except TenantConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _probe(a: argparse.Namespace) -> int:
    alive, what = probe(a.url.rstrip("/"), model=a.model, timeout=a.timeout, api_key=a.api_key or probe_key())
    print(f"{'alive' if alive else 'NOT alive'}: {what}")
    return 0 if alive else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefillonly.serving",
                                description=f"Run the real Triton Inference Server {TRITON_SERVER_VERSION} (from nvidia-pytriton).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start tritonserver on a model repository and stay in the foreground",
                       description="Extra tritonserver flags go after `--`, e.g. -- --exit-on-error=false")
    s.add_argument("--model-repository", required=True)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--host", default="127.0.0.1",
                   help="bind address of the HTTP, gRPC and metrics ports (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    s.add_argument("--no-proxy", action="store_true",
                   help="no Envoy in front: Triton binds the ports itself (unsafe: see docs/serving.md, 'Reliability and security')")
    s.add_argument("--no-frontend", action="store_true",
                   help="no scoring-API frontend (rerank, score, completions, embedding routes); Triton's own routes only")
    s.add_argument("--frontend-upstream", default=None, metavar="HOST:PORT",
                   help="gRPC address the frontend calls (default: this Triton); in a fleet, the fleet front door's, so "
                        "that a request's `user` field routes it to that user's replica")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest HTTP request body the front door passes on (default {DEFAULT_MAX_REQUEST_BYTES:,})")
    s.add_argument("--probe-interval", type=float, default=5.0, help="seconds between liveness probes (default 5)")
    s.add_argument("--probe-timeout", type=float, default=120.0,
                   help="a probe unanswered this long restarts the server (default 120; above your longest request)")
    s.add_argument("--admin-key", default=None, help="value of the prefillonly-admin-key header the admin APIs need "
                                                      "(default $PREFILLONLY_ADMIN_KEY, else a random one)")
    s.add_argument("--open-admin-api", action="store_true", help="leave Triton's admin APIs open to every client")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="an API key clients must send (`Authorization: Bearer KEY`), of tenant `default`; repeatable "
                        "(also $PREFILLONLY_API_KEYS). No key at all: every client is served")
    s.add_argument("--api-key-file", metavar="FILE", help="API keys with their tenants, a line each: `KEY TENANT "
                   "[in_flight=N] [rps=R]` (also $PREFILLONLY_API_KEY_FILE); re-read on SIGHUP")
    s.add_argument("--tenant-quota", type=_quota, default=Quota(), metavar="in_flight=N,rps=R",
                   help="the quota of each tenant whose key-file lines set none, per replica (default: none)")
    s.add_argument("--server-dir", default=None,
                   help="a Triton install to run (bin/tritonserver, backends/, caches/), e.g. /opt/tritonserver in the "
                        "NGC image (default $PREFILLONLY_TRITON_DIR, else the server from the nvidia-pytriton wheel)")
    s.add_argument("--log-file", default=None, help="keep the server's log here (default: a temporary file)")
    s.add_argument("--log-verbose", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="do not copy the server's log to stderr")
    s.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every model to load")
    s.add_argument("--exit-timeout-secs", type=int, default=30,
                   help="on stop, how long Triton waits for the running request after the drain (default 30)")
    s.add_argument("--stop-timeout", type=float, default=60.0, help="SIGKILL after this many seconds of stopping")
    s.add_argument("--cache-dir", default=None, help="where the server tree is built (default $PREFILLONLY_CACHE_DIR "
                                                     "or ~/.cache/prefillonly)")
    s.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    pb = sub.add_parser("probe", help="one real 1-token inference: exit 0 if the engine answers (container liveness)")
    pb.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP address of the server or the front door")
    pb.add_argument("--model", default="prefillonly")
    pb.add_argument("--timeout", type=float, default=60.0)
    pb.add_argument("--api-key", default=None, help="the key to send when the server checks API keys (default "
                    "$PREFILLONLY_PROBE_KEY, else the first of $PREFILLONLY_API_KEYS or of $PREFILLONLY_API_KEY_FILE)")
    a = p.parse_args(argv)

    if a.cmd == "serve":
        return _serve(a)
    return _probe(a)

