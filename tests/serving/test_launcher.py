"""The real tritonserver 2.51.0 (from nvidia-pytriton) started by prefillonly.serving: a decoupled
Python-backend echo model answered over gRPC streaming and HTTP generate; perf_analyzer runs."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from perf.perf_analyzer import PerfAnalyzerUnavailable, perf_analyzer_env, perf_analyzer_path
from prefillonly.serving.host.server_tree import ServerError, prepare_server_dir
from prefillonly.serving.host.triton_server import TritonServer, running_server

from ..echo_model import write_echo_model

TEXT = "héllo, prefill wörld"


def _perf_analyzer() -> Path:
    try:
        return perf_analyzer_path()
    except PerfAnalyzerUnavailable as e:
        pytest.fail(f"perf_analyzer could not be obtained (it needs the tritonclient==2.51.0 wheel from the package "
                    f"index once, then it is cached): {e}")


def _grpc_stream_echo(url: str, texts: list[str]) -> list[str]:
    import tritonclient.grpc as grpcclient

    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for i, text in enumerate(texts):
            inp = grpcclient.InferInput("TEXT", [1], "BYTES")
            inp.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
            client.async_stream_infer("echo", [inp], request_id=str(i),
                                      outputs=[grpcclient.InferRequestedOutput("TEXT")])
        got = {}
        for _ in texts:
            result, error = results.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("TEXT")[0].decode()
    finally:
        client.stop_stream()
        client.close()
    return [got[str(i)] for i in range(len(texts))]


def test_echo_over_grpc_stream_and_http_generate(tmp_path: Path):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    with running_server(repo, log_path=tmp_path / "server.log") as server:
        assert server.poll() is None
        assert _grpc_stream_echo(server.grpc_url, [TEXT, "second"]) == [TEXT, "second"]

        req = urllib.request.Request(f"{server.http_url}/v2/models/echo/generate",
                                     data=json.dumps({"TEXT": TEXT}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read())
        assert body["TEXT"] in (TEXT, [TEXT])
        assert body["model_name"] == "echo"

        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            assert b"nv_inference_request_success" in r.read()

        # perf_analyzer drives the decoupled model over gRPC streaming (bounded: 3 windows of 50)
        pa = subprocess.run([str(_perf_analyzer()), "-m", "echo", "-u", server.grpc_url, "-i", "grpc", "--streaming",
                             "--shape", "TEXT:1", "--concurrency-range", "1", "--measurement-mode", "count_windows",
                             "--measurement-request-count", "50", "-s", "999", "--max-trials", "3"],
                            env=perf_analyzer_env(), capture_output=True, text=True, timeout=120)
        assert pa.returncode == 0, pa.stdout[-3000:] + pa.stderr[-3000:]
        assert "Detected decoupled model" in pa.stdout and "throughput" in pa.stdout
        pid = server.pid
    assert server.poll() is not None  # stopped on the way out
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of its process group (the Python stubs) is left
    assert list(Path("/dev/shm").glob(server._shm_prefix + "*")) == []


def test_server_that_fails_to_load_fails_fast_with_its_log(tmp_path: Path):
    repo = tmp_path / "repo"
    model = write_echo_model(repo, name="broken")
    (model / "1" / "model.py").write_text("raise RuntimeError('deliberately broken model')\n")
    server = TritonServer().start(repo)
    try:
        with pytest.raises(ServerError, match="deliberately broken model"):
            server.wait_ready(60)
    finally:
        server.stop(10)


def test_prepare_server_dir_is_idempotent(tmp_path: Path):
    first = prepare_server_dir(tmp_path)
    assert prepare_server_dir(tmp_path) == first
    assert os.access(first / "bin" / "tritonserver", os.X_OK)
    assert os.access(first / "backends" / "python" / "triton_python_backend_stub", os.X_OK)
    assert (first / "caches" / "local").is_dir()


def test_perf_analyzer_runs():
    binary = _perf_analyzer()
    env = perf_analyzer_env()
    # perf_analyzer 2.51.0 has no --help (it prints its usage and exits 99); --version exits 0
    version = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stdout + version.stderr
    assert "2.51.0" in version.stdout + version.stderr
    usage = subprocess.run([str(binary), "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert "--streaming" in usage.stdout + usage.stderr  # it loads and knows the flag we use
