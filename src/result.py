"""What a scoring request returns (names fixed by docs/design.md §5): ScoreResult and TokenScore;
a log-likelihood request ContinuationScore, a prompt-logprobs request PromptLogprobs.

They are defined with the rest of the wire contract (wire.py), so that the engine's result, its
`result_json` form and what the frontend and the clients decode from it are one type.
"""

from __future__ import annotations

from .wire import ContinuationScore, PromptLogprobs, ScoreResult, TokenScore

__all__ = ["ContinuationScore", "PromptLogprobs", "ScoreResult", "TokenScore"]
