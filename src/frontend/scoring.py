"""What every scoring route does between its HTTP shape and the engine: pick the preset, render
token ids, check the bounds, call the engine (one multi-item request per query), return plain
per-document numbers. The routes (routes.py) only translate shapes.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from ..contract.decisions import DecisionCall, DecisionResult
from ..contract.limits import DEFAULT_MAX_ITEMS
from ..contract.wire import ScoreResult, TokenScore
from .error_shapes import APIError
from .pooling import PooledModel, Pooler
from .presets import QUERY, DOCUMENT, Rendered, ScoringPreset, TemplateTokenizer
from .upstream import TritonUpstream, UpstreamError


DEFAULT_MAX_PROMPTS_PER_CALL = 256  # lm-evaluation-harness batches up to this many prompts per completions call


@dataclass(frozen=True)
class Limits:
    max_documents: int = DEFAULT_MAX_ITEMS  # the engine's max_items: one query's documents in one request
    max_prompts: int = DEFAULT_MAX_PROMPTS_PER_CALL  # completions / item_first prompts per call (each its own engine request)
    max_logprobs: int = 20
    # an echo call's answer: each prompt position's logprob and its top `logprobs` (~1 KB each while
    # the answer is built): bounded per call, so that no call can make the frontend hold gigabytes
    max_echo_entries: int = 1 << 20


@dataclass
class DocumentScore:
    index: int
    labels: list[TokenScore]  # the labels' id, text, logprob (full vocabulary), prob (renormalised over them)


@dataclass
class Scored:
    scores: list[DocumentScore]  # in document order
    prompt_tokens: int  # tokens of every query + document pair, as vLLM and Jina count them
    cached_tokens: int  # tokens read from the prefix cache instead of computed
    truncated: list[int] = field(default_factory=list)  # indices of the documents cut to fit


class Scoring:
    def __init__(self, tokens: TemplateTokenizer, presets: dict[str, ScoringPreset], upstream: TritonUpstream,
                 base_model: str = "prefillonly", limits: Limits = Limits(), pooled: PooledModel = PooledModel()):
        self.tokens = tokens
        self.presets = presets
        self.upstream = upstream
        self.base_model = base_model  # the raw model: completions, and score routes without a template
        self.limits = limits
        # the embedding and classification routes' work (pooling.py)
        self.pooler = Pooler(upstream, pooled, base_model, tokens, max_prompts=limits.max_prompts,
                             max_items=limits.max_documents)
        self._raw = ScoringPreset(name=base_model, template=QUERY + DOCUMENT, labels=(), label_ids=())

    # -- models -----------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.base_model] + list(self.presets)

    def preset(self, model: str | None, *, for_rerank: bool) -> ScoringPreset:
        """The preset a request names; for_rerank: the raw model is not a reranker (no labels)."""
        if model is None:
            return next(iter(self.presets.values())) if for_rerank else self._raw
        if model in self.presets:
            return self.presets[model]
        if model == self.base_model and not for_rerank:
            return self._raw
        names = list(self.presets) if for_rerank else self.model_names()
        raise APIError(f"model {model!r} is not served here; choose one of {', '.join(names)} (GET /v1/models)",
                       param="model", status=404)

    # -- rerank and score ---------------------------------------------------------------------
    async def rerank(self, preset: ScoringPreset, query: str, documents: list[str], *, instruction: str | None,
                     max_tokens_per_doc: int | None, truncate: str | None, user: str | None, priority: int = 0) -> Scored:
        if instruction is not None and "{instruction}" not in preset.template:
            raise APIError(f"model {preset.name!r} takes no instruction (its template has no {{instruction}})", param="instruction")
        self._check_documents(len(documents), "documents")
        rendered = await asyncio.to_thread(self.tokens.render, preset, query, documents, instruction=instruction,
                                           max_tokens_per_doc=max_tokens_per_doc, truncate=truncate)
        return await self._items(rendered, list(preset.label_ids), user, priority)

    async def score(self, preset: ScoringPreset, query, items: list, label_ids: list[int], *, item_first: bool,
                    user: str | None, join_text: bool = False, priority: int = 0) -> Scored:
        """SGLang / vLLM generative scoring. With the raw model and text: vLLM tokenizes the query
        with the model's special tokens and each item without and concatenates the ids; SGLang
        (join_text) tokenizes query + item as one string (the two can differ at the boundary).
        Item first when asked; token ids go as they are. A template preset renders text through its
        template."""
        self._check_documents(len(items), "items")
        if len(set(label_ids)) != len(label_ids):
            raise APIError("label_token_ids has duplicates; list each token once", param="label_token_ids")
        ids_in = not isinstance(query, str)
        if ids_in != all(not isinstance(x, str) for x in items):
            raise APIError("query and items must both be text or both be token ids", param="items")
        if not preset.raw:
            if ids_in or item_first:
                raise APIError(f"model {preset.name!r} applies a template to text; token ids and item_first need the "
                               f"raw model {self.base_model!r}", param="model")
            rendered = await asyncio.to_thread(self.tokens.render, preset, query, items)
            return await self._items(rendered, label_ids, user, priority)
        if ids_in:
            query_ids, item_ids = list(query), [list(x) for x in items]
        elif join_text and not item_first:
            query_ids, item_ids = await asyncio.to_thread(self.tokens.split_joined, query, items)
        else:
            query_ids, item_ids = await asyncio.to_thread(
                lambda: (self.tokens.encode(query, first=True), [self.tokens.encode(x) for x in items]))
        if not query_ids:
            raise APIError("query has no tokens", param="query")
        for i, x in enumerate(item_ids):
            if not x:
                raise APIError(f"items[{i}] has no tokens", param="items")
            self._check_length(len(query_ids) + len(x), f"items[{i}]")
        if not item_first:
            return await self._items(Rendered(shared=query_ids, items=item_ids, truncated=[]), label_ids, user, priority)
        self._check_prompts(len(items), "items with item_first")
        results = await self._call(self.upstream.score_prompts([x + query_ids for x in item_ids], label_ids, user=user,
                                                               priority=priority))
        return _scored(results, sum(r.prompt_tokens for r in results), sum(r.cached_tokens for r in results))

    async def _items(self, rendered: Rendered, label_ids: list[int], user: str | None, priority: int) -> Scored:
        results = await self._call(self.upstream.score_items(rendered.shared, rendered.items, label_ids, user=user,
                                                             priority=priority))
        pairs = sum(len(rendered.shared) + len(item) for item in rendered.items)
        scored = _scored(results, pairs, results[0].cached_tokens if results else 0)
        scored.truncated = list(rendered.truncated)
        return scored

    # -- decisions ------------------------------------------------------------------------------
    async def decide(self, call: DecisionCall, user: str | None) -> DecisionResult:
        """One engine request for the whole call: its input rendered once, every question over it."""
        return await self._call(self.upstream.decide(call.to_json(), user=user))

    # -- completions ----------------------------------------------------------------------------
    async def complete(self, prompts: list, allowed_ids: list[int] | None, top_k: int, user: str | None) -> list[ScoreResult]:
        """One ScoreResult per prompt. Without allowed ids the chosen token is the argmax of
        the whole vocabulary: the engine is asked for its top_k (>= 1) and any allowed id."""
        self._check_prompts(len(prompts), "prompts")
        if allowed_ids is not None and len(set(allowed_ids)) != len(allowed_ids):
            raise APIError("allowed_token_ids has duplicates", param="allowed_token_ids")
        ids = await self.prompt_ids(prompts)
        return await self._call(self.upstream.score_prompts(ids, allowed_ids or [0], user=user, top_k=top_k))

    async def prompt_ids(self, prompts: list) -> list[list[int]]:
        """Token ids of completions prompts (texts with the model's special tokens, ids as they are)."""
        self._check_prompts(len(prompts), "prompts")
        ids = await asyncio.to_thread(lambda: [self.tokens.encode(p, first=True) if isinstance(p, str) else list(p)
                                               for p in prompts])
        for i, p in enumerate(ids):
            if not p:
                raise APIError(f"prompt[{i}] is empty", param="prompt")
            self._check_length(len(p), f"prompt[{i}]")
        return ids

    async def echo(self, ids: list[list[int]], top_k: int, user: str | None) -> list:
        """Per prompt (token ids), its own tokens' logprobs with the top_k at each and the next
        tokens after it (a PromptLogprobs); a one-token prompt, which has no position to score, gets
        its ScoreResult with the max(1, top_k) next tokens instead."""
        entries = sum(map(len, ids)) * (top_k + 1)
        if entries > self.limits.max_echo_entries:
            raise APIError(f"echo would return {entries:,} logprob entries (every prompt token, and logprobs={top_k} "
                           f"alternatives at each), over the limit of {self.limits.max_echo_entries:,} per call; send "
                           "fewer prompts per call or ask for fewer logprobs", param="prompt")
        longer = [p for p in ids if len(p) > 1]
        single = [p for p in ids if len(p) == 1]
        spans = await self._call(self.upstream.prompt_logprobs(longer, top_k=top_k, user=user)) if longer else []
        singles = await self._call(self.upstream.score_prompts(single, [0], user=user, top_k=max(1, top_k))) if single else []
        spans, singles = iter(spans), iter(singles)
        return [next(spans) if len(p) > 1 else next(singles) for p in ids]

    def token_text(self, token_id: int) -> str:
        return self.tokens.token_text(token_id)

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokens.tokenizer, "eos_token_id", None)

    # -- bounds ---------------------------------------------------------------------------------
    def _check_documents(self, n: int, name: str) -> None:
        if n == 0:
            raise APIError(f"{name} is empty; give at least one", param=name)
        if n > self.limits.max_documents:
            raise APIError(f"too many {name}: {n} (max_items is {self.limits.max_documents} per request); split the call",
                           param=name)

    def _check_prompts(self, n: int, name: str) -> None:
        if n > self.limits.max_prompts:
            raise APIError(f"too many {name}: {n} (the frontend takes at most {self.limits.max_prompts} per call: "
                           "--max-prompts-per-call, never above the engine's max_waiting); split the call", param=name)

    def _check_length(self, n: int, name: str) -> None:
        if n > self.tokens.max_input_len:
            raise APIError(f"{name} has {n} tokens, over the model's input length of {self.tokens.max_input_len}",
                           code="prompt_too_long", param=name.split("[")[0])

    @staticmethod
    async def _call(coro):
        try:
            return await coro
        except UpstreamError as e:
            raise APIError.from_upstream(e) from None


def _scored(results: list[ScoreResult], prompt_tokens: int, cached_tokens: int) -> Scored:
    return Scored([DocumentScore(i, r.tokens) for i, r in enumerate(results)], prompt_tokens, cached_tokens)


def relevance(score: DocumentScore) -> float:
    """P(first label) renormalised over the preset's labels."""
    return score.labels[0].prob


def log_odds(score: DocumentScore) -> float:
    """TEI's raw score: log(p / (1 - p)) of the relevance (the logit whose sigmoid is it), from
    the labels' full-vocabulary logprobs so that it keeps its precision far from 0.5."""
    first, others = score.labels[0].logprob, [label.logprob for label in score.labels[1:]]
    top = max(others)
    return first - (top + math.log(sum(math.exp(x - top) for x in others)))
