"""Exceptions the engine raises. Every rejection names the problem in its message.

`code` is a short machine-readable reason (used later for metrics and for mapping to
Triton status codes); the message is for humans.
"""


class PrefillOnlyError(Exception):
    """Base class of every error the engine raises on purpose."""

    code = "error"


class ConfigError(PrefillOnlyError, ValueError):
    """An EngineConfig value (or a model folder) is unusable."""

    code = "bad_config"


class UnsupportedModelError(ConfigError):
    """The checkpoint's architecture is not one the engine implements."""

    code = "unsupported_model"


class InvalidRequestError(PrefillOnlyError, ValueError):
    """The request itself is malformed (empty prompt, bad token ids, ...)."""

    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt is longer than the configured max input length."""

    code = "prompt_too_long"


class OverBudgetError(PrefillOnlyError):
    """Serving the request would exceed the activation memory budget."""

    code = "over_memory_budget"


class OverloadedError(PrefillOnlyError):
    """The waiting set is full; the request was not queued (retry later or elsewhere)."""

    code = "overloaded"


class EngineBusyError(PrefillOnlyError):
    """A liveness probe's answer while one long step runs and keeps finishing forwards: the engine
    is alive (its progress shows it), so the probe is not queued behind that step."""

    code = "engine_busy"


class DeadlineExceededError(PrefillOnlyError):
    """The request's deadline passed while it waited; it was never run."""

    code = "deadline_exceeded"


class EngineClosedError(PrefillOnlyError):
    """The engine is shut down (or shutting down) and takes no more work."""

    code = "engine_closed"


class RateLimitedError(PrefillOnlyError):
    """Over the tenant's quota (requests in flight, or per second): retry after `retry_after_s`."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
