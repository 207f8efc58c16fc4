"""Request bodies of the scoring APIs, field names exactly as each API spells them.

Fields this server does not implement are ignored, as vLLM, SGLang and TEI ignore them (clients
send fields of their own: LiteLLM's `rank_fields`, TEI clients' `truncate: null`); a near miss of
a field we implement is refused instead (frontend/lenient.py). `ORIGINAL_FIELDS` lists, per
model, what the original API documents and this server accepts without acting on it (temperature,
seed, ... cannot change one greedy token). Responses are plain dicts built in routes.py, so each
API keeps its own shape.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset()


class TextDocument(BaseModel):
    """A document object: `text` (or the keys `rank_fields` names); every other key is kept and
    comes back with the document (Cohere v1 documents carry ids and titles)."""
    model_config = ConfigDict(extra="allow")
    text: Optional[str] = None


Document = Union[str, TextDocument]


class RerankRequest(_Lenient):
    """Jina / vLLM / Cohere v1 `POST /v1/rerank` and `POST /rerank`, Cohere v2 `POST /v2/rerank`."""
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset({
        "max_chunks_per_doc",  # Cohere v1: long documents are cut to fit here instead of chunked
        "max_tokens_per_query", "truncate_prompt_tokens", "encoding_format", "request_id", "use_activation",
        "softmax", "activation", "mm_processor_kwargs", "cache_salt", "additional_data", "truncation"})
    model: Optional[str] = None  # None: the default preset (the first in scoring_presets.json)
    query: str
    documents: list[Document]
    top_n: Optional[int] = None  # None or 0: every document
    return_documents: Optional[bool] = None  # default: True on /v1/rerank, False on /v2/rerank
    max_tokens_per_doc: Optional[int] = Field(None, ge=0)  # 0: no limit (vLLM); default 4,096 on /v2/rerank
    rank_fields: Optional[list[str]] = None  # Cohere v1 / LiteLLM: the document keys scored, in order
    truncate: Optional[bool] = None  # a document too long for the model: cut (None, True) or refused (False)
    truncation_side: Optional[Literal["left", "right"]] = None  # vLLM's; default right (a document's start kept)
    instruction: Optional[str] = None
    user: Optional[str] = None
    priority: Optional[int] = None  # Cohere and vLLM: lower runs earlier
    relevant_spans: Optional[dict] = None  # Cohere: refused when given (not supported)


class TeiRerankRequest(_Lenient):
    """Text Embeddings Inference `POST /rerank` (a body with `texts`)."""
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: Optional[bool] = None  # None: cut, as TEI's --auto-truncate (its default); False: refused
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    model: Optional[str] = None
    user: Optional[str] = None


class ScoreRequest(_Lenient):
    """SGLang `POST /v1/score` and vLLM `POST /generative_scoring`."""
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"add_special_tokens", "request_id", "return_tokens"})
    model: Optional[str] = None
    query: Union[str, list[int]]
    items: Union[str, list[str], list[list[int]]]  # SGLang: one string is one item
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: Optional[bool] = None  # default: False on /v1/score (SGLang's), True on /generative_scoring (vLLM's)
    item_first: bool = False
    user: Optional[str] = None
    priority: Optional[int] = None  # vLLM: lower runs earlier


class PairScoreRequest(_Lenient):
    """vLLM's cross-encoder `POST /score` (and `/v1/score` with a `text_1` body): text_1 the query
    (one, or one per text_2), text_2 the documents; scored by the default rerank preset or `model`."""
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"truncate_prompt_tokens", "encoding_format", "request_id",
                                                            "mm_processor_kwargs", "use_activation", "activation"})
    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    user: Optional[str] = None
    priority: Optional[int] = None


class CompletionRequest(_Lenient):
    """OpenAI `POST /v1/completions`, for exactly one token (this engine never decodes)."""
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset({
        "suffix", "stream_options", "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens", "request_id",
        "prompt_logprobs", "truncate_prompt_tokens", "priority", "response_format", "guided_json", "stop_token_ids"})
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 1
    logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None  # vLLM's extension: choose among these only
    logit_bias: Optional[dict[str, float]] = None  # +100 on k tokens: choose among those (OpenAI's way)
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


# -- embeddings and classification (frontend/pooling_routes.py) ------------------------------------
Prompts = Union[str, list[str], list[int], list[list[int]]]  # OpenAI's input forms: one prompt, or several
TruncationSide = Literal["Right", "Left", "right", "left"]  # TEI spells them capitalised, huggingface_hub lower case


class _VllmPooling(_Lenient):
    """What vLLM's pooling requests share (its PoolingBasicRequestMixin): truncate_prompt_tokens
    -1 (or at least the model's input length) cuts a prompt to fit, from truncation_side (vLLM's
    pooling default: right, the start kept); a smaller count is refused (the engine cuts to its
    input length only)."""
    ORIGINAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"add_special_tokens", "request_id", "mm_processor_kwargs",
                                                            "cache_salt", "padding"})
    model: Optional[str] = None
    user: Optional[str] = None
    priority: Optional[int] = None  # vLLM: lower runs earlier
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    use_activation: Optional[bool] = None  # embed: normalise; classify: the activation (false: raw logits)


class EmbeddingRequest(_VllmPooling):
    """OpenAI `POST /v1/embeddings` (with vLLM's extensions)."""
    input: Prompts
    dimensions: Optional[int] = None
    encoding_format: Literal["float", "base64"] = "float"  # the openai SDK asks base64 unless told otherwise
    # vLLM's base64 knobs: only what this server writes (little-endian float32) is taken
    embed_dtype: Optional[Literal["float32"]] = None
    endianness: Optional[Literal["native", "little"]] = None


class PoolingRequest(EmbeddingRequest):
    """vLLM `POST /pooling`: the served model's own output (task absent), its embedding or its label
    probabilities."""
    task: Optional[str] = None


class ClassifyRequest(_VllmPooling):
    """vLLM `POST /classify`; or, this server's best-of-N extension, `prompt` and its `responses`
    (each scored after the prompt, the prompt computed once) instead of `input`."""
    input: Optional[Prompts] = None
    prompt: Optional[Union[str, list[int]]] = None
    responses: Optional[Union[list[str], list[list[int]]]] = None
    encoding_format: Optional[str] = None  # refused unless "float": labels' probabilities come as numbers


class TeiEmbedRequest(_Lenient):
    """Text Embeddings Inference `POST /embed` (huggingface_hub's feature_extraction sends it)."""
    inputs: Prompts
    normalize: bool = True  # TEI's default, whatever the checkpoint says
    truncate: Optional[bool] = None  # None: cut, as TEI's --auto-truncate (what /info reports); False: refused
    truncation_direction: TruncationSide = "Right"
    prompt_name: Optional[str] = None
    dimensions: Optional[int] = None
    model: Optional[str] = None
    user: Optional[str] = None
    encoding_format: Optional[str] = None  # refused unless "float": TEI answers floats


class TeiPredictRequest(_Lenient):
    """Text Embeddings Inference `POST /predict`: a text, a pair [a, b], or a list of either
    (huggingface_hub's text_classification sends `parameters`: top_k, function_to_apply)."""
    inputs: Union[str, list[Union[str, list[str]]]]
    raw_scores: bool = False
    truncate: Optional[bool] = None
    truncation_direction: TruncationSide = "Right"
    parameters: Optional[dict] = None
    model: Optional[str] = None
    user: Optional[str] = None
    encoding_format: Optional[str] = None


class CohereEmbedRequest(_Lenient):
    """Cohere v2 `POST /v2/embed`, texts only."""
    model: Optional[str] = None
    texts: Optional[list[str]] = None
    images: Optional[list] = None  # refused: text only
    inputs: Optional[list] = None  # refused: text only
    input_type: Optional[str] = None  # a named prompt of the checkpoint where it has one of that name
    embedding_types: Optional[list[str]] = None  # ["float"] only
    output_dimension: Optional[int] = None
    truncate: Optional[Literal["NONE", "START", "END"]] = None  # Cohere's default END: the end cut
    max_tokens: Optional[int] = None  # refused: the engine cuts to its input length only
