"""A rerank document's text and what comes back of it: a string, or an object whose `text` (or
the keys `rank_fields` names, in order) is scored and whose every key, extra ones included
(Cohere v1 documents carry ids and titles), is returned with the result."""

from __future__ import annotations

from .error_shapes import APIError
from .schemas import TextDocument


def document_text(document: str | TextDocument, rank_fields: list[str] | None, index: int) -> str:
    """The text scored: a string as it is; an object's one rank field's value, or with several
    fields "key: value" lines in rank_fields order (Cohere v1's multi-field documents)."""
    if isinstance(document, str):
        return document
    fields = rank_fields or ["text"]
    values = _fields(document)
    missing = [f for f in fields if not isinstance(values.get(f), str)]
    if missing:
        raise APIError(f"documents[{index}] has no text field {missing[0]!r} (rank_fields: {fields})", param="documents")
    if len(fields) == 1:
        return values[fields[0]]
    return "\n".join(f"{f}: {values[f]}" for f in fields)


def returned_document(document: str | TextDocument) -> dict:
    return {"text": document} if isinstance(document, str) else _fields(document)


def _fields(document: TextDocument) -> dict:
    out = {"text": document.text} if document.text is not None else {}
    return {**out, **(document.model_extra or {})}
