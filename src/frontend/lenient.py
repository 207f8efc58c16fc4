"""Fields a request carries that this server does not implement: ignored as the original servers
ignore them (vLLM, SGLang, TEI and Cohere's clients send fields of their own), unless the name is a
near miss of a field we do implement (`top_m` for `top_n`), which is refused: a misspelt field
silently ignored would change the answer without a word.

Each request model lists, in `ORIGINAL_FIELDS`, the fields its original API documents that are
accepted and ignored here (docs/scoring-apis.md has the table); those are never taken for a
misspelling. The names ignored in a call come back in the IGNORED_HEADER of its answer, and each
is logged once (debug) per route.
"""

from __future__ import annotations

import difflib
import logging

from pydantic import BaseModel

from .error_shapes import APIError

log = logging.getLogger("prefillonly.frontend")
IGNORED_HEADER = "x-prefillonly-ignored-fields"
NEAR_MISS_CUTOFF = 0.8  # difflib ratio: top_m / top_n 0.8, max_token_per_doc / max_tokens_per_doc 0.97
_logged: set[tuple[str, str]] = set()


def ignored_fields(body: BaseModel, route: str) -> list[str]:
    """The names of `body`'s fields that no field of its model takes (pydantic's extras), after
    refusing any that is a near miss of an implemented one."""
    extra = list((body.model_extra or {}).keys())
    implemented = [name for name in type(body).model_fields]
    original = getattr(type(body), "ORIGINAL_FIELDS", frozenset())
    for name in extra:
        if name in original:
            continue
        close = difflib.get_close_matches(name, implemented, n=1, cutoff=NEAR_MISS_CUTOFF)
        if close:
            raise APIError(f"unknown field {name!r}: did you mean {close[0]!r}?", param=name)
    for name in extra:
        if (route, name) not in _logged:
            _logged.add((route, name))
            log.debug("%s: field %r is not used by this server; ignored", route, name)
    return extra
