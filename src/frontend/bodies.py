"""What every route does with a call before its own work: the JSON body read (and kept for the
error shape), checked against the API's request model (the fields it ignores kept for the answer's
header), its prompts in OpenAI's forms, the caller's user, a new answer id."""

from __future__ import annotations

import json
import uuid

from fastapi import Request
from pydantic import ValidationError

from ..contract.wire import USER_HEADER
from .error_shapes import APIError, validation_message
from .lenient import ignored_fields


async def read_json(request: Request):
    """The body as JSON; kept on the request, where the error handlers read which API it is."""
    try:
        raw = json.loads(await request.body())
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}", param="body") from None
    request.state.body = raw
    return raw


def body_as(request: Request, cls, raw):
    """`raw` as a `cls` body; the fields it ignored are kept for the answer's header."""
    try:
        body = cls.model_validate(raw)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(message, param=param) from None
    request.state.ignored = ignored_fields(body, request.url.path)
    return body


async def parse_body(request: Request, cls):
    return body_as(request, cls, await read_json(request))


def user_of(request: Request, body_user: str | None) -> str | None:
    """The cache namespace: the body's user, else the x-prefillonly-user header."""
    return body_user or request.headers.get(USER_HEADER) or None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prompts_of(value, name: str, empty_code: str = "invalid_request") -> list:
    """OpenAI's prompt forms (and vLLM's and TEI's inputs): a text, texts, token ids, lists of
    token ids; one prompt each (a text or an id list). None of them (empty_code: TEI's "empty")
    is refused."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(f"{name} is empty; give at least one input", code=empty_code, param=name)
    return [value] if isinstance(value[0], int) else list(value)
