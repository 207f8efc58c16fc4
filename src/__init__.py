"""PrefillOnly: an inference engine for prefill-only requests (one output token, its probability).

Public API (docs/design.md §5): Engine, EngineConfig, ScoreResult, TokenScore, ContinuationScore,
PromptLogprobs and the errors.
"""

from .contract.errors import (
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

# Engine, EngineConfig and the result types are loaded on first use (PEP 562), so that importing
# a tensor-free part of the package (the scheduler, the cache index, the wire protocol, the
# frontend's schemas) does not pay for torch: `import prefillonly.scheduler` runs this file first.
_LAZY = {"Engine": ".engine", "EngineConfig": ".config", "ScoreResult": ".contract.wire", "TokenScore": ".contract.wire",
         "ContinuationScore": ".contract.wire", "PromptLogprobs": ".contract.wire"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineConfig",
    "ScoreResult",
    "TokenScore",
    "ContinuationScore",
    "PromptLogprobs",
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
