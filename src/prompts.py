"""Turns user input into token ids: prompts (text or ids) and allowed output tokens.

A string allowed token is scored as exactly the one token it encodes to; nothing is added
(no leading space, no special tokens). "Yes" and " Yes" are different tokens (docs/design.md §5).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence

from .contract.errors import InvalidRequestError
from .contract.limits import RequestLimits
from .contract.token_texts import TokenTexts
from .request import ITEM_PLACEHOLDER, check_item_template


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int, limits: RequestLimits | None = None):
        self.tokenizer = tokenizer  # a transformers tokenizer, or None for id-only models
        self.vocab_size = vocab_size
        self.limits = limits  # None: no size limits (checked before: trusting(); tests of the encoding alone)
        # the longest token's bytes: an allowed string longer than this is never one token (kept by
        # trusting(): it is a cheap answer, not a quota)
        self.max_token_bytes = limits.max_token_bytes if limits is not None else 0
        self._texts = TokenTexts(tokenizer) if tokenizer is not None else None

    def trusting(self) -> "PromptEncoder":
        """This encoder without the size limits' checks, for requests a caller already checked
        against the same RequestLimits (the engine's own Triton model: protocol.parse_request)."""
        twin = copy.copy(self)
        twin.limits = None
        return twin

    def encode_prompt(self, prompt, apply_chat_template: bool = False, what: str = "prompt", add_special_tokens: bool = True,
                      text_prefix: str = "") -> list[int]:
        """Token ids of a text/bytes/ids prompt. Items of a multi-item request are encoded with
        add_special_tokens=False (no BOS in the middle of a sequence). A text over the byte limit
        is refused before it is decoded or tokenized. text_prefix: put before a (non-empty) text and
        tokenized with it (an embedding model's named prompt); token ids are taken as they are."""
        if self.limits is not None:
            self.limits.check_text(prompt, what)
        if isinstance(prompt, (bytes, bytearray)):
            prompt = decode_utf8(bytes(prompt), what)
        if isinstance(prompt, str):
            _check_encodable(prompt, what)
            if not prompt:
                raise InvalidRequestError(f"{what} is empty")
            prompt = text_prefix + prompt
            tok = self._need_tokenizer(f"a text {what}")
            if apply_chat_template:
                if not getattr(tok, "chat_template", None):
                    raise InvalidRequestError("apply_chat_template was requested but the model's tokenizer has no chat template")
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
                if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
                    ids = ids["input_ids"]
            else:
                ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
            ids = list(ids)
        else:
            if apply_chat_template:
                raise InvalidRequestError("apply_chat_template needs a text prompt, not token ids")
            ids = self._ids(prompt, what)
        if not ids:
            raise InvalidRequestError(f"{what} is empty (0 tokens)")
        return ids

    def special_ids(self) -> set[int]:
        """The tokenizer's special tokens' ids (BOS, EOS, ...): what a truncation keeps."""
        return set(self.tokenizer.all_special_ids) if self.tokenizer is not None else set()

    def resolve_allowed(self, allowed) -> list[int]:
        if allowed is None or isinstance(allowed, (str, bytes)) or not isinstance(allowed, Sequence) and not hasattr(allowed, "tolist"):
            raise InvalidRequestError("allowed_tokens must be a list of token strings or token ids")
        items = allowed.tolist() if hasattr(allowed, "tolist") else list(allowed)
        if not items:
            raise InvalidRequestError("allowed_tokens is empty; give at least one token")
        if self.limits is not None:
            self.limits.check_count(len(items), "allowed tokens", "max_allowed_tokens")
        ids = []
        for item in items:
            if isinstance(item, (bytes, bytearray)):
                item = decode_utf8(bytes(item), "allowed token")
            if isinstance(item, str):
                ids.append(self._single_token(item))
            else:
                ids.append(self._id(item, "allowed token id"))
        seen = {}
        for item, i in zip(items, ids):
            if i in seen:
                raise InvalidRequestError(f"allowed tokens {seen[i]!r} and {item!r} are the same token (id {i}); list each once")
            seen[i] = item
        return ids

    def encode_items(self, items, template: str | None) -> list[list[int]]:
        """Token ids of a multi-item request's items (text, bytes or ids; no special tokens).
        `template` (e.g. "\\nPost: {item}\\nAnswer:") wraps each text item first: only its
        literal {item} is replaced."""
        if items is None or isinstance(items, (str, bytes)) or not hasattr(items, "__len__"):
            raise InvalidRequestError("items must be a list of item texts or token-id lists")
        if len(items) == 0:
            raise InvalidRequestError("items is empty; give at least one item")
        if self.limits is not None:
            self.limits.check_count(len(items), "items", "max_items")
        if template is not None:
            check_item_template(template)
            self._check_text(template, "item_template")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, (bytes, bytearray)):
                self._check_text(item, f"item {i}")  # before decoding it
                item = decode_utf8(bytes(item), f"item {i}")
            if template is not None and isinstance(item, str):
                self._check_text(item, f"item {i}")  # before the template copies it
                item = template.replace(ITEM_PLACEHOLDER, item)
            out.append(self.encode_prompt(item, what=f"item {i}", add_special_tokens=False))
        return out

    def encode_continuations(self, context, continuations) -> tuple[list[int], list[list[int]]]:
        """Token ids of a log-likelihood request: the context, and each continuation as it follows
        the context (lm-evaluation-harness's rule for text: the context's trailing whitespace moves
        to the continuation, the pair is encoded whole and the continuation is what follows the
        context's own encoding). Token ids are taken as they are."""
        if continuations is None or isinstance(continuations, (str, bytes)) or not hasattr(continuations, "__len__"):
            raise InvalidRequestError("continuations must be a list of texts or token-id lists")
        if len(continuations) == 0:
            raise InvalidRequestError("continuations is empty; give at least one")
        if self.limits is not None:
            self.limits.check_count(len(continuations), "continuations", "max_items")
        if isinstance(context, (bytes, bytearray)):
            context = decode_utf8(bytes(context), "context")
        decoded = []
        for i, cont in enumerate(continuations):
            if isinstance(cont, (bytes, bytearray)):
                self._check_text(cont, f"continuations[{i}]")
                cont = decode_utf8(bytes(cont), f"continuations[{i}]")
            decoded.append(cont)
        if isinstance(context, str) and all(isinstance(c, str) for c in decoded):
            self._check_text(context, "context")
            stripped = context.rstrip() if context.strip() else context
            ctx = self.encode_prompt(stripped, what="context")
            return ctx, [self._text_continuation(context, c, ctx, f"continuations[{i}]") for i, c in enumerate(decoded)]
        ctx = self.encode_prompt(context, what="context")
        return ctx, [self.encode_prompt(c, what=f"continuations[{i}]", add_special_tokens=False) for i, c in enumerate(decoded)]

    def _text_continuation(self, context: str, continuation: str, context_ids: list[int], what: str) -> list[int]:
        self._check_text(continuation, what)
        _check_encodable(continuation, what)
        if not continuation:
            raise InvalidRequestError(f"{what} is empty")
        spaces = len(context) - len(context.rstrip())
        if spaces and context.strip():
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ids = self.encode_prompt(context + continuation, what=what)[len(context_ids):]
        if not ids:
            raise InvalidRequestError(f"{what} adds no token after the context")
        return ids

    def _check_text(self, text, what: str) -> None:
        if self.limits is not None:
            self.limits.check_text(text, what)

    def token_text(self, token_id: int) -> str:
        return self._texts(token_id) if self._texts is not None else ""

    def _single_token(self, text: str) -> int:
        if self.max_token_bytes and len(text) > self.max_token_bytes:
            # cheap refusal of a huge "token" before the tokenizer sees it
            raise InvalidRequestError(f"allowed token of {len(text):,} characters is longer than any token of this model "
                                      f"(the longest is {self.max_token_bytes} bytes); each must be exactly one token")
        _check_encodable(text, "allowed token")
        if not text:
            raise InvalidRequestError("allowed token '' is empty")
        tok = self._need_tokenizer("allowed tokens given as strings")
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            pieces = [tok.decode([i]) for i in ids]
            hint = ""
            if not text.startswith(" ") and len(tok.encode(" " + text, add_special_tokens=False)) == 1:
                hint = f"; note {' ' + text!r} (with a leading space) is a single token"
            raise InvalidRequestError(
                f"allowed token {text!r} encodes to {len(ids)} tokens {pieces} (ids {ids}); "
                f"each allowed string must be exactly one token{hint}"
            )
        return ids[0]

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise InvalidRequestError(f"this model has no tokenizer, so {what} cannot be used; pass token ids")
        return self.tokenizer

    def _ids(self, values, what: str) -> list[int]:
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, Sequence):
            raise InvalidRequestError(f"{what} must be text or a sequence of token ids, got {type(values).__name__}")
        return [self._id(v, what + " token id") for v in values]

    def _id(self, value, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidRequestError(f"{what} {value!r} is not an integer")
        value = int(value)
        if not 0 <= value < self.vocab_size:
            raise InvalidRequestError(f"{what} {value} is outside the vocabulary [0, {self.vocab_size})")
        return value


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start}") from None


def _check_encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode text: {e.reason} at character {e.start}") from None
