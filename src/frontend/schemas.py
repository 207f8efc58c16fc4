"""Request bodies of the scoring APIs, field names exactly as each API spells them.

Unknown fields are refused (a misspelt `top_n` would otherwise be ignored without a word);
fields of an API that this engine accepts but that cannot change one greedy token
(temperature, seed, ...) are listed and ignored. Responses are plain dicts built in routes.py,
so each API keeps its own shape.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextDocument(_Strict):
    text: str


Document = Union[str, TextDocument]


class RerankRequest(_Strict):
    """Jina / vLLM `POST /v1/rerank` and `POST /rerank`, Cohere v2 `POST /v2/rerank`."""
    model: Optional[str] = None  # None: the default preset (the first in scoring_presets.json)
    query: str
    documents: list[Document]
    top_n: Optional[int] = None  # None or 0: every document
    return_documents: Optional[bool] = None  # default: True on /v1/rerank, False on /v2/rerank
    max_tokens_per_doc: Optional[int] = Field(None, ge=1)
    instruction: Optional[str] = None
    user: Optional[str] = None
    priority: Optional[int] = None  # Cohere: lower runs earlier
    relevant_spans: Optional[dict] = None  # Cohere: refused when given (not supported)


class TeiRerankRequest(_Strict):
    """Text Embeddings Inference `POST /rerank` (a body with `texts`)."""
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    model: Optional[str] = None
    user: Optional[str] = None


class ScoreRequest(_Strict):
    """SGLang `POST /v1/score` and vLLM `POST /generative_scoring`."""
    model: Optional[str] = None
    query: Union[str, list[int]]
    items: Union[list[str], list[list[int]]]
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: Optional[bool] = None  # default: False on /v1/score (SGLang's), True on /generative_scoring (vLLM's)
    item_first: bool = False
    user: Optional[str] = None


class CompletionRequest(_Strict):
    """OpenAI `POST /v1/completions`, for exactly one token (this engine never decodes)."""
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 1
    logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None  # vLLM's extension: choose among these only
    echo: bool = False
    n: int = 1
    best_of: Optional[int] = None
    stream: bool = False
    user: Optional[str] = None
    # accepted, no effect on one greedy token
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
