"""Faults survived: the engine's process killed with requests in flight; a stop with a backlog
longer than the exit timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from clients.transport import MODEL, answer, generate_answer
from perf import benchutil as bu
from perf.reliability.stack import YES_NO, Stack, stub_model
from perf.workloads import NO_ID, YES_ID

FAULT_PROMPT = {"input_ids": [5] * 3000, "allowed_token_ids": [YES_ID, NO_ID], "cache_prefix_len": 0}


def in_threads(calls) -> list:
    """Start each zero-argument call in its own thread: (threads, results list filled in order as they end)."""
    out = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, c()), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, out


def wait_until(predicate, timeout: float, step: float = 0.1) -> float | None:
    """Seconds until predicate() held, or None after `timeout`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if predicate():
            return time.perf_counter() - t0
        time.sleep(step)
    return None


def tally(answers: list) -> dict:
    counts: dict = {}
    for a in answers:
        code = a.message.split(":")[0] if a is not None else ""
        status = "" if a is None or a.status == "error" else f" {a.status}"  # a stream error has no status
        key = "lost" if a is None else (a.kind if a.kind != "error" else f"error{status}: {code}")
        counts[key] = counts.get(key, 0) + 1
    return counts


def fault_kill_engine(out_dir: Path, dtype: str, timeout: float) -> dict:
    """kill -9 of the engine's process with requests in flight (HTTP generate and gRPC streams)."""
    from prefillonly.serving.host.probe import ready_status

    with Stack(out_dir, "fault-kill", dtype=dtype) as stack:
        url, grpc = stack.http_url, stack.grpc_url
        calls = [lambda: generate_answer(url, FAULT_PROMPT, timeout) for _ in range(3)]
        calls += [lambda: answer("grpc_stream", url, grpc, FAULT_PROMPT, timeout) for _ in range(3)]
        threads, answers = in_threads(calls)
        time.sleep(1.5)
        (stub,) = [p for p in stack.sup.server.stub_pids() if stub_model(p) == MODEL]
        os.kill(stub, signal.SIGKILL)
        not_ready_s = wait_until(lambda: ready_status(url) != 200, 30)
        for t in threads:
            t.join(timeout)
        ready_again_s = wait_until(lambda: ready_status(url) == 200, 300, 0.5)
        after = generate_answer(url, {"text_input": "Is the sky blue? Answer:", "allowed_tokens": YES_NO}, 60)
        return {"in_flight": len(calls), "answers": tally(answers), "not_ready_after_s": not_ready_s,
                "serving_again_after_s": None if ready_again_s is None else (not_ready_s or 0) + ready_again_s,
                "restarts": stack.sup.restarts, "request_after": f"{after.status} {after.message}"[:80],
                "events": list(stack.events)}


def fault_stop_with_backlog(out_dir: Path, dtype: str, timeout: float, n: int = 16) -> dict:
    """What SIGTERM to the serve command does (Supervisor.stop) with a backlog of n requests of
    ~3,000 tokens each: far longer than the exit timeout."""
    with Stack(out_dir, "fault-stop", dtype=dtype) as stack:
        url, grpc, exit_timeout = stack.http_url, stack.grpc_url, stack.sup.options.exit_timeout_secs
        threads, answers = in_threads([lambda: answer("grpc_stream", url, grpc, FAULT_PROMPT, timeout) for _ in range(n)])
        time.sleep(2.0)
        t0 = time.perf_counter()
        stack.sup.stop()
        stopped_s = time.perf_counter() - t0
        for t in threads:
            t.join(timeout)
        return {"requests": n, "exit_timeout_secs": exit_timeout, "stopped_in_s": stopped_s, "answers": tally(answers),
                "lost": sum(a is None or a.kind == "lost" for a in answers)}


def run_faults(out_dir: Path, dtype: str, timeout: float) -> dict:
    bu.log("[faults] kill -9 of the engine process with 6 requests in flight")
    kill = fault_kill_engine(out_dir, dtype, timeout)
    bu.log(f"[faults] {kill}")
    bu.log("[faults] stop with a backlog of 16 long requests")
    stop = fault_stop_with_backlog(out_dir, dtype, timeout)
    bu.log(f"[faults] {stop}")
    return {"date": bu.now_iso(), "dtype": dtype, "kill": kill, "stop": stop}
