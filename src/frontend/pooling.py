"""What the embedding and classification routes do between their HTTP shapes and the engine:
check the inputs (naming each API's own field), call the engine's embed and classify tasks (one
Triton request per prompt; a prompt with responses as one multi-item request), and hand back the
engine's EmbeddingResults and ClassificationResults. The routes (pooling_routes.py) only translate
shapes.

What the served checkpoint can answer is the engine's to say (embed on a sequence classifier, or
classify on an embedding model, is its invalid_request naming why); the frontend reads only what
it needs to name a bad field before the call (PooledModel: the head, the hidden size, the named
prompts; and for TEI's /info its pooling or labels), from the checkpoint's files without torch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..contract.checkpoint import (CLASSIFIER_HEAD, LM_HEAD, NO_HEAD, SUPPORTED_ARCHITECTURES, class_labels, head_of,
                                   read_config)
from ..contract.pooling_files import DEFAULT_POOLING, read_pooling_files
from ..contract.wire import CLASSIFY, EMBED, ClassificationResult, EmbeddingResult
from .error_shapes import APIError
from .presets import TemplateTokenizer
from .upstream import TritonUpstream, UpstreamError


@dataclass(frozen=True)
class PooledModel:
    """What the pooled routes (and TEI's /info) know of the served checkpoint before calling it."""
    head: str = LM_HEAD  # contract.checkpoint's: lm, embedding (a bare model) or classifier
    hidden_size: int | None = None  # the most embedding dimensions (None: unknown, the engine checks)
    prompts: tuple[str, ...] = ()  # its sentence-transformers named prompts
    # an embedding checkpoint's pooling (last, mean, cls): its sentence-transformers files', or a bare
    # model's default; None where it is not one (a causal LM without those files, a classifier)
    pooling: str | None = None
    labels: tuple[str, ...] = ()  # a classifier's label names, in id order

    @classmethod
    def read(cls, folder: str) -> "PooledModel":
        config, _ = read_config(folder)
        head = head_of(next(a for a in config["architectures"] if a in SUPPORTED_ARCHITECTURES))
        hidden = config.get("hidden_size")
        files = read_pooling_files(folder) if head != CLASSIFIER_HEAD else None
        embeds = files or (DEFAULT_POOLING if head == NO_HEAD else None)  # a bare model pools by default
        return cls(head, hidden if isinstance(hidden, int) else None, tuple(files.prompts) if files else (),
                   embeds.mode if embeds else None, class_labels(config) if head == CLASSIFIER_HEAD else ())

    @property
    def task(self) -> str:
        """What the checkpoint answers when a call does not say (vLLM's /pooling without a task)."""
        return CLASSIFY if self.head == CLASSIFIER_HEAD else EMBED


@dataclass(frozen=True)
class Fields:
    """A route's names for the engine's inputs, so that a refusal names the field the caller sent."""
    input: str = "input"
    dimensions: str = "dimensions"
    prompt_name: str = "prompt_name"
    empty_code: str = "invalid_request"  # TEI answers an empty batch with its own error type


class Pooler:
    def __init__(self, upstream: TritonUpstream, model: PooledModel, base_model: str, tokens: TemplateTokenizer, *,
                 max_prompts: int, max_items: int):
        self.upstream = upstream
        self.model = model
        self.base_model = base_model
        self.tokens = tokens  # the served tokenizer: the engine's ids (a shared prompt's length, for usage)
        self.max_input_len = tokens.max_input_len  # the engine's: a longer prompt is cut (truncate) or refused
        self.max_prompts = max_prompts  # prompts per call (each its own engine request)
        self.max_items = max_items  # responses to one prompt (one engine request): the engine's max_items

    def model_name(self, model: str | None) -> str:
        """The served model a call names (absent: it); 404 naming it otherwise (the scoring
        presets are templates over a language model's tokens, nothing to embed with)."""
        if model is None or model == self.base_model:
            return self.base_model
        raise APIError(f"model {model!r} is not served here; embeddings and classifications come from {self.base_model!r}",
                       param="model", status=404)

    async def embed(self, prompts: list, fields: Fields = Fields(), *, dimensions: int | None = None,
                    normalize: bool | None = None, prompt_name: str | None = None, truncate: str | None = None,
                    user: str | None = None, priority: int = 0) -> list[EmbeddingResult]:
        self.check_prompts(prompts, fields)
        if dimensions is not None and not 1 <= dimensions <= (self.model.hidden_size or dimensions):
            top = f"the model's hidden size {self.model.hidden_size}" if self.model.hidden_size else "the hidden size"
            raise APIError(f"{fields.dimensions} must be between 1 and {top}, not {dimensions}", param=fields.dimensions)
        if prompt_name is not None and prompt_name not in self.model.prompts:
            known = ", ".join(self.model.prompts) or "it names none"
            raise APIError(f"{fields.prompt_name} {prompt_name!r} is not one of this model's named prompts ({known})",
                           param=fields.prompt_name)
        return await self._call(self.upstream.embed(prompts, dimensions=dimensions, normalize=normalize,
                                                    prompt_name=prompt_name, truncate=truncate, user=user,
                                                    priority=priority), fields)

    async def classify(self, prompts: list, fields: Fields = Fields(), *, truncate: str | None = None,
                       user: str | None = None, priority: int = 0) -> list[ClassificationResult]:
        self.check_prompts(prompts, fields)
        return await self._call(self.upstream.classify(prompts, truncate=truncate, user=user, priority=priority), fields)

    async def classify_responses(self, prompt, responses: list, *, user: str | None = None,
                                 priority: int = 0) -> list[ClassificationResult]:
        """One result per response (the `responses` field), each scored after `prompt` + response,
        the prompt computed once: one multi-item request, up to the engine's max_items responses."""
        self.check_prompts([prompt], Fields("prompt"))
        self.check_prompts(responses, Fields("responses"), self.max_items, "the engine's max_items per request")
        return await self._call(self.upstream.classify_items(prompt, responses, user=user, priority=priority),
                                Fields("responses"))

    def prompt_length(self, prompt) -> int:
        """A prompt's tokens as the engine counts them: an id list's length, a text's ids with the
        model's special tokens (the frontend's tokenizer gives the engine's ids)."""
        return len(prompt) if not isinstance(prompt, str) else len(self.tokens.encode(prompt, first=True))

    async def classify_pairs(self, pairs: list[tuple[str, str]], fields: Fields, *, user: str | None = None,
                             priority: int = 0) -> list[ClassificationResult]:
        """Each pair (a, b) scored as a followed by b: one multi-item request per distinct a (its
        b's the items), so a first text shared by several pairs is computed once; results in order."""
        self.check_prompts(pairs, fields)
        groups: dict[str, list[int]] = {}
        for i, (first, _) in enumerate(pairs):
            groups.setdefault(first, []).append(i)
        parts = await asyncio.gather(*(self._call(self.upstream.classify_items(first, [pairs[i][1] for i in where],
                                                                               user=user, priority=priority), fields)
                                       for first, where in groups.items()))
        return in_input_order(list(groups.values()), parts, len(pairs))

    def check_prompts(self, prompts: list, fields: Fields, most: int | None = None,
                      bound: str = "the frontend's --max-prompts-per-call") -> None:
        """At least one, at most `most` (the frontend's per-call bound), none empty (a text, an id
        list, or either side of a pair)."""
        most = most or self.max_prompts
        if not prompts:
            raise APIError(f"{fields.input} is empty; give at least one input", code=fields.empty_code, param=fields.input)
        if len(prompts) > most:
            raise APIError(f"too many inputs in {fields.input}: {len(prompts)}, over {most} ({bound}); split the call",
                           param=fields.input)
        for i, p in enumerate(prompts):
            if not p or (isinstance(p, tuple) and not all(p)):
                raise APIError(f"{fields.input}[{i}] is empty", param=fields.input)

    @staticmethod
    async def _call(coro, fields: Fields):
        """The engine's refusal as the route's error; a prompt too long names the input field."""
        try:
            return await coro
        except UpstreamError as e:
            error = APIError.from_upstream(e)
            if e.code == "prompt_too_long":
                error.param = fields.input
            raise error from None


def in_input_order(positions: list[list[int]], parts: list[list], n: int) -> list:
    """The results of calls made on groups of a call's n inputs (`positions`: each group's input
    indices; `parts`: each group's results, in the same order) back in input order."""
    results: list = [None] * n
    for where, part in zip(positions, parts):
        for i, r in zip(where, part):
            results[i] = r
    return results
