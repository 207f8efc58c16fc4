"""What a scoring request returns (names fixed by docs/design.md §5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TokenScore:
    id: int
    text: str
    logprob: float  # log-probability over the full vocabulary
    prob: float  # allowed tokens: renormalised over the allowed set; top_k entries: exp(logprob)


@dataclass
class ScoreResult:
    tokens: list[TokenScore]  # one per allowed token, in the order asked
    chosen: TokenScore  # the allowed token with the highest probability
    top_k: list[TokenScore] = field(default_factory=list)  # full-vocabulary top tokens, if asked
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from a cache instead of being computed
    peak_bytes: int | None = None  # measured peak memory growth of the request (None if unmeasurable)

    def to_dict(self) -> dict:
        return asdict(self)
