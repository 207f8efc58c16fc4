"""Settings given as strings (Triton model parameters, CLI flags): what "unset" is and how an
integer is read. Tensor-free, so that EngineConfig and the frontend (which reads the served
model's settings without building an EngineConfig, and so without torch) apply one rule.
"""

from __future__ import annotations

from .errors import ConfigError

UNSET = ("", "none", "null")  # a string setting with one of these values takes its default


def is_unset(value) -> bool:
    return value is None or str(value).strip().lower() in UNSET


def optional_int(name: str, value, minimum: int) -> int | None:
    """`value` ("2048", " 1_000 ", an int, or None) as an int of at least `minimum`; None stays None;
    ConfigError naming `name` otherwise."""
    if value is None:
        return None
    try:
        number = int(str(value).strip().replace("_", ""))
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return number
