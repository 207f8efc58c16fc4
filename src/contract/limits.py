"""Per-request size limits: one table, checked once at each process boundary, before any
expensive work (tokenizing, queueing).

A request is refused with InvalidRequestError naming the limit it broke, so no single request can
hold the tokenizer (or the queue) long enough to stall other clients. The byte bound on a text is
derived, not guessed: a token is at most `max_token_bytes` bytes of text, so a text longer than
max_input_len * max_token_bytes bytes cannot fit in max_input_len tokens, whatever it contains.

Where each is checked (once per boundary): the scoring frontend checks what its APIs carry, in
their own error shapes (documents, prompts per call, tokens); the Triton model checks a direct
client's request, the counts and byte sizes on the wire before anything is decoded
(serving/model/protocol.py); the engine's Python API checks its callers' through the prompt
encoder (prompts.py), and a request its own Triton model already checked is not checked again.
Only the prompt's length in tokens is the engine's alone: nothing before it has tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError

# The table: each limit's default (EngineConfig's settings of these names read them; the frontend
# reads the served model's settings with them, without building an EngineConfig)
DEFAULT_MAX_ITEMS = 256  # items (or continuations) of one multi-item request
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64  # or max_waiting where that is smaller: a request must fit the queue whole
DEFAULT_MAX_ALLOWED_TOKENS = 256  # allowed output tokens of one request
# the question and option tokens of one decision call (up to 400 questions: its own bound, not
# max_items); the work is split into steps under the activation budget either way
DEFAULT_MAX_DECISION_TOKENS = 1 << 18
DEFAULT_MAX_WAITING = 1024  # waiting requests beyond this are refused at once ("overloaded")
# max_input_len: the checkpoint's context length unless set (resolve_max_input_len)
# max_prompt_bytes: max_input_len x the longest token's bytes unless set (derived_max_prompt_bytes)


def default_max_prompts(max_waiting: int) -> int:
    return min(DEFAULT_MAX_PROMPTS_PER_REQUEST, max_waiting)


def resolve_max_input_len(configured: int | None, context_length: int) -> int:
    """The longest prompt (tokens) a model takes: its setting, else the checkpoint's context
    length (a setting above it is an explicit override). One rule for the engine and the frontend."""
    return configured or context_length


def derived_max_prompt_bytes(max_input_len: int, token_bytes: int) -> int:
    """The byte bound of a text that could still fit max_input_len tokens (with no tokenizer,
    prompts are token ids and a text is refused anyway: the bound is then max_input_len)."""
    return max_input_len * token_bytes if token_bytes else max_input_len


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int  # bytes of one prompt, item or template text
    max_prompts_per_request: int  # independent prompts in one Triton request (text_input values)
    max_items: int  # items of one multi-item request
    max_allowed_tokens: int  # allowed output tokens of one request
    max_token_bytes: int  # the longest token's text: an allowed string longer than this is never one token

    def check_text_bytes(self, nbytes: int, what: str) -> None:
        if nbytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"{what} is {nbytes:,} bytes, over the limit of {self.max_prompt_bytes:,} bytes (max_prompt_bytes); "
                f"it could not fit the max input length anyway")

    def check_text(self, text, what: str) -> None:
        """check_text_bytes for str or bytes, without encoding a str that is too long anyway."""
        if isinstance(text, (bytes, bytearray)):
            self.check_text_bytes(len(text), what)
        elif isinstance(text, str):
            # UTF-8 takes at least one byte per character: most oversized texts are caught without encoding
            self.check_text_bytes(len(text) if len(text) > self.max_prompt_bytes else len(text.encode("utf-8", "surrogatepass")), what)

    def check_count(self, n: int, what: str, limit_name: str) -> None:
        limit = getattr(self, limit_name)
        if n > limit:
            raise InvalidRequestError(f"too many {what}: {n:,}, the limit is {limit:,} per request ({limit_name})")


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry in UTF-8.
    Byte-level (Ġ) and SentencePiece (▁) spellings take at least as many bytes as the text they
    stand for, so the bound is never too small for those tokenizers. 0 when there is no tokenizer."""
    if tokenizer is None:
        return 0
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=0)
