"""Test helpers: a real tritonserver for the duration of a `with` block, and a tiny echo model.

    from prefillonly.serving.testing import running_server, write_echo_model

    def test_something(tmp_path):
        write_echo_model(tmp_path / "repo")
        with running_server(tmp_path / "repo") as server:
            ...  # server.http_url, server.grpc_url
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from . import prometheus
from .triton_server import TritonServer


@contextlib.contextmanager
def running_server(model_repository: str | os.PathLike, *, ready_timeout: float = 120.0, stop_timeout: float = 15.0,
                   server_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                   **start_kwargs) -> Iterator[TritonServer]:
    """Start tritonserver on `model_repository` (free ports on 127.0.0.1 unless given), wait until
    every model is ready, yield the TritonServer, and stop it on the way out, whatever happens.
    `start_kwargs` go to TritonServer.start (http_port, log_path, extra_args, ...)."""
    server = TritonServer(server_dir, cache_dir=cache_dir)
    try:
        server.start(model_repository, **start_kwargs)
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop(stop_timeout)


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """POST a JSON body (Triton's /generate or /infer); (HTTP status, decoded JSON reply), errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def copy_model_repository(source: str | os.PathLike, dest: str | os.PathLike, models=("prefillonly", "prefillonly_sync"),
                          engine_model: str = "prefillonly", **parameters) -> Path:
    """Copy `models` of the repository `source` into `dest`, setting string parameters of
    `engine_model`'s config.pbtxt (e.g. model="/path/ckpt", dtype="float32", max_waiting="1");
    returns `dest`. A parameter the config does not have is an error, not a silent no-op."""
    dest = Path(dest)
    for name in models:
        shutil.copytree(Path(source) / name, dest / name)
    config = dest / engine_model / "config.pbtxt"
    text = config.read_text()
    for key, value in parameters.items():
        text, n = re.subn(rf'(key: "{re.escape(key)}" value: {{ string_value: )"[^"]*"', rf'\g<1>"{value}"', text)
        if n != 1:
            raise KeyError(f"{config} has no string parameter {key!r}")
    config.write_text(text)
    return dest


def scrape_metrics(metrics_url: str, prefixes=("prefillonly_", "nv_inference_")) -> dict[str, float]:
    """Triton's Prometheus endpoint as {'name{labels}': value} for the series starting with
    `prefixes` (None: every series). Retries briefly: the metrics port may open a moment after
    /v2/health/ready answers."""
    return prometheus.by_series(prometheus.scrape(metrics_url, timeout_s=30, attempts=50), prefixes)


ECHO_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }} ]
output [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

ECHO_MODEL = textwrap.dedent('''\
    """Decoupled echo: one final response per request, TEXT out = TEXT in."""
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
                out = pb_utils.Tensor("TEXT", np.array(text, dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
''')


def write_echo_model(model_repository: str | os.PathLike, name: str = "echo") -> Path:
    """Write a decoupled Python-backend echo model (input TEXT BYTES -> output TEXT BYTES, one
    final response) as <model_repository>/<name>/; returns the model's folder."""
    model_dir = Path(model_repository) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    (model_dir / "1" / "model.py").write_text(ECHO_MODEL)
    return model_dir
