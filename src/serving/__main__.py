"""`python -m prefillonly.serving serve --model-repository DIR`: run the real tritonserver in the
foreground (DESIGN.md §5), and `python -m prefillonly.serving perf-analyzer-path`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .launcher import PerfAnalyzerUnavailable, ServerError, TritonServer, perf_analyzer_env, perf_analyzer_path

USAGE_HINT = """\
tritonserver {version} ready (pid {pid}); models in {repo}
  HTTP    {http}
  gRPC    {grpc}
  metrics {metrics}

Score over HTTP (decoupled model: use generate, not infer):
  curl -s {http}/v2/models/prefillonly/generate -H 'Content-Type: application/json' \\
       -d '{{"text_input": "Is the sky blue on a clear day? Answer Yes or No. Answer:", "allowed_tokens": [" Yes", " No"]}}'
gRPC (decoupled models need the bidirectional stream):
  import tritonclient.grpc as g; c = g.InferenceServerClient("{grpc}")
  c.start_stream(callback=lambda result, error: ...); c.async_stream_infer("prefillonly", inputs)
perf_analyzer: python -m prefillonly.serving perf-analyzer -- -m prefillonly -u {grpc} -i grpc --streaming ...
Ctrl-C (SIGINT) or SIGTERM stops the server.
"""


def _follow(path: Path, stop: threading.Event, out=sys.stderr) -> None:
    """Copy what the server writes to its log file onto our stderr, until `stop` is set."""
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


def _serve(a: argparse.Namespace) -> int:
    repo = Path(a.model_repository)
    server = TritonServer(cache_dir=a.cache_dir)
    log_path = Path(a.log_file) if a.log_file else None
    stop_follow = threading.Event()
    follower = None
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        if len(received) == 1:
            print(f"\nprefillonly.serving: {signal.Signals(signum).name} -> tritonserver (again to kill)",
                  file=sys.stderr, flush=True)
            server.send_signal(signum)
        else:
            server.send_signal(signal.SIGKILL)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        server.start(repo, http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port, host=a.host,
                     log_path=log_path, extra_args=a.extra, log_verbose=a.log_verbose,
                     exit_timeout_secs=a.exit_timeout_secs)
        if received:  # a signal that came while the server was being prepared
            server.send_signal(received[0])
        if not a.quiet:
            follower = threading.Thread(target=_follow, args=(server.log_path, stop_follow), daemon=True)
            follower.start()
        deadline = time.monotonic() + a.ready_timeout
        while not server.is_ready():  # wait_ready, but a signal meanwhile stops the wait too
            if server.poll() is not None:
                raise ServerError(f"tritonserver exited with status {server.poll()} before it was ready"
                                  + ("" if follower else "\n--- log tail ---\n" + server.log_tail()))
            if received:
                break
            if time.monotonic() > deadline:
                raise ServerError(f"tritonserver not ready after {a.ready_timeout:.0f} s\n--- log tail ---\n"
                                  + server.log_tail())
            time.sleep(0.2)
        else:
            time.sleep(0.3)  # let the follower print the startup table first
            print("\n" + USAGE_HINT.format(version="2.51.0", pid=server.pid, repo=repo.resolve(), http=server.http_url,
                                           grpc=server.grpc_url, metrics=server.metrics_url), flush=True)
        while server.poll() is None:
            try:
                server.process.wait()
            except InterruptedError:
                pass
        rc = server.poll()
    except ServerError as e:
        print(f"prefillonly.serving: {e}", file=sys.stderr)
        rc = server.poll()
        rc = 1 if rc in (None, 0) else rc
    finally:
        server.stop(timeout=a.stop_timeout)
        stop_follow.set()
        if follower is not None:
            follower.join(2)
    if rc is None:
        rc = server.poll() or 0
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, as a shell reports it


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefillonly.serving",
                                description="Run the real Triton Inference Server 2.51.0 (from nvidia-pytriton).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start tritonserver on a model repository and stay in the foreground",
                       description="Extra tritonserver flags go after `--`, e.g. -- --exit-on-error=false")
    s.add_argument("--model-repository", required=True)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--host", default="0.0.0.0", help="bind address for all three endpoints (default 0.0.0.0)")
    s.add_argument("--log-file", default=None, help="keep the server's log here (default: a temporary file)")
    s.add_argument("--log-verbose", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="do not copy the server's log to stderr")
    s.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every model to load")
    s.add_argument("--exit-timeout-secs", type=int, default=None,
                   help="how long the server drains in-flight requests on SIGTERM (Triton's default 30)")
    s.add_argument("--stop-timeout", type=float, default=60.0, help="SIGKILL after this many seconds of stopping")
    s.add_argument("--cache-dir", default=None, help="where the server tree is built (default $PREFILLONLY_CACHE_DIR "
                                                     "or ~/.cache/prefillonly)")
    s.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    pp = sub.add_parser("perf-analyzer-path", help="print the path of perf_analyzer 2.51.0 (fetched once)")
    pp.add_argument("--cache-dir", default=None)
    pp.add_argument("--env", action="store_true", help="also print LD_LIBRARY_PATH=... to run it with")
    pr = sub.add_parser("perf-analyzer", help="run perf_analyzer with its environment; its arguments go after `--`")
    pr.add_argument("--cache-dir", default=None)
    pr.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)

    if a.cmd == "serve":
        return _serve(a)
    try:
        binary = perf_analyzer_path(a.cache_dir)
        env = perf_analyzer_env(cache_dir=a.cache_dir)
    except PerfAnalyzerUnavailable as e:
        print(f"prefillonly.serving: {e}", file=sys.stderr)
        return 1
    if a.cmd == "perf-analyzer-path":
        print(binary)
        if a.env:
            print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
        return 0
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    sys.stdout.flush()
    os.execve(str(binary), [str(binary), *args], env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
