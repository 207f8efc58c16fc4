"""The engine settings of a model repository's config.pbtxt: its string `parameters`, as the
Triton model hands them to EngineConfig.from_strings. Standard library only (the frontend and the
benchmarks read them without Triton)."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError

_PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def engine_settings(model_dir: str | Path) -> dict[str, str]:
    """{parameter: string value} of `model_dir`/config.pbtxt; ConfigError if it cannot be read."""
    path = Path(model_dir) / "config.pbtxt"
    try:
        return dict(_PARAMETER.findall(path.read_text()))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
