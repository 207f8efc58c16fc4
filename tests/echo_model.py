"""A tiny decoupled Python-backend echo model (TEXT in, the same TEXT out, one final response):
what the launcher tests serve to check tritonserver itself, without the engine.

    write_echo_model(tmp_path / "repo")
    with running_server(tmp_path / "repo") as server: ...
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

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
