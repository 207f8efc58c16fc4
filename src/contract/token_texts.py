"""One token's text as every process reports it: the engine names tokens in results, the frontend
names them in echo and top-logprobs, and both must say the same string for the same id."""

from __future__ import annotations


class TokenTexts:
    """One token's text as the engine reports it (no clean-up of spaces), decoded once per id: a
    logprob span (echo) names a token at every position. Used by the engine and the frontend."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        return text
