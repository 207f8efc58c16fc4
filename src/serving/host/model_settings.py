"""The engine settings of a model repository's config.pbtxt: its string `parameters`, as the
Triton model hands them to EngineConfig.from_strings. `engine_settings` reads them (the frontend
and the benchmarks, without Triton); `copy_model_repository` writes a copy with some changed (the
tests, the benchmarks and the fleet serve the repository with their own model and dtype).
Standard library only."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ...contract.errors import ConfigError

_PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def engine_settings(model_dir: str | Path) -> dict[str, str]:
    """{parameter: string value} of `model_dir`/config.pbtxt; ConfigError if it cannot be read."""
    path = Path(model_dir) / "config.pbtxt"
    try:
        return dict(_PARAMETER.findall(path.read_text()))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


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
