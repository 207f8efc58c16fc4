"""PrefillOnly: an inference engine for prefill-only requests (one output token, its probability).

Public API (docs/design.md §5): Engine, EngineConfig, ScoreResult, TokenScore and the errors.
"""

from .config import EngineConfig
from .engine import Engine
from .errors import (
    ConfigError,
    DeadlineExceededError,
    EngineClosedError,
    InvalidRequestError,
    OverloadedError,
    OverBudgetError,
    PrefillOnlyError,
    PromptTooLongError,
    UnsupportedModelError,
)
from .result import ScoreResult, TokenScore

__all__ = [
    "Engine",
    "EngineConfig",
    "ScoreResult",
    "TokenScore",
    "PrefillOnlyError",
    "ConfigError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "PromptTooLongError",
    "OverBudgetError",
    "OverloadedError",
    "DeadlineExceededError",
    "EngineClosedError",
]
