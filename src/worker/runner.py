"""PrefillRunner: one device's compute. It turns a step the scheduler planned into results.

    outcome = runner.execute(plan)   # the cache's data moves, the forward(s), the answers

It owns the executor, the prefix cache's tensors and the memory meter; it decides nothing: which
requests run, on which cached prefix, with attention in place or not and (a multi-item request)
in which item groups is in the plan (scheduler/plan.py). The scheduler owns every cache ticket
(it began them while picking; its finish() commits or aborts them and counts the outcome): the
runner only executes the plan's data moves and gives the executor each ticket's view
(PrefixCache.access: the tokens read, a source, a sink). Each request's kind (tasks/) builds its
answer from its rows. A step of several requests is one ForwardBatch (their uncached tokens
packed row after row); a multi-item request is a step of its own: its shared prompt (K/V
captured), then its items batched over that K/V.
"""

from __future__ import annotations

import time

import torch

from ..cache.prefix_cache import NO_PREFIX, PrefixAccess, PrefixCache
from .executor import ForwardBatch, HybridPrefillExecutor, Sequence
from .memory import PeakMemoryMeter
from ..cache.prefix_io import ChainedPrefix, PrefixKV
from ..request import Request
from ..scheduler import ItemsPlan, StepOutcome, StepPlan, TokenSplit
from ..tasks.base import RowOutput


class PrefillRunner:
    def __init__(self, executor: HybridPrefillExecutor, cache: PrefixCache | None, chunk_size: int | None, token_text):
        self.executor = executor
        self.cache = cache
        self.chunk_size = chunk_size
        self.token_text = token_text
        self.meter = PeakMemoryMeter(executor.device)

    def execute(self, plan: StepPlan) -> StepOutcome:
        """The plan's data moves (restores and offloads between cache tiers, in order, before any
        forward writes a block), then its members' forward: one result per member, or the one
        error the whole step failed with."""
        try:
            if self.cache is not None:
                self.cache.execute(plan.moves)
            if not plan.members:
                return StepOutcome()
            access = [self.cache.access(m.ticket) if m.ticket is not None else NO_PREFIX for m in plan.members]
            if plan.items is not None:
                return self._run_items(plan.members[0].request, access[0], plan.items)
            return self._run_batch([m.request for m in plan.members], access, plan.shape, plan.inplace_attention)
        except BaseException as e:  # every member gets exactly one answer: this error
            return StepOutcome(error=e)

    def _run_batch(self, requests: list[Request], access: list[PrefixAccess], shape: list[TokenSplit],
                   inplace: bool) -> StepOutcome:
        batch = ForwardBatch([_uncached_sequence(r.token_ids, a, logprobs=(r.logprob_rows, r.logprob_top_k), pool=r.pool)
                              for r, a in zip(requests, access)])
        t0 = time.perf_counter()
        self.meter.start()
        out = self.executor.forward_batch(batch, self.chunk_size, inplace)
        peak = self.meter.peak_growth()
        forward_s = time.perf_counter() - t0
        results = [r.kind.result(r, RowOutput(out.logits[i], out.spans[i], split.cached, peak, out.pooled[i]), self.token_text)
                   for i, (r, split) in enumerate(zip(requests, shape))]
        return StepOutcome(results, forward_s=forward_s)

    def _run_items(self, request: Request, access: PrefixAccess, items_plan: ItemsPlan) -> StepOutcome:
        """The shared prompt once (its K/V captured for this request only, whatever the cache
        budget), then the items in the plan's groups; a tree's continuations after each group."""
        shared, items = request.token_ids, request.item_ids
        p = access.cached_tokens
        regime = request.rope_length  # the shared part and every item rotate as its longest item does
        shared_out = self.executor.forward_batch(
            ForwardBatch([_uncached_sequence(shared, access, capture=(0, len(shared)), rope_length=regime)]), self.chunk_size,
            items_plan.shared_inplace)
        shared_kv: PrefixKV = shared_out.captured[0]
        continuations = request.item_continuations
        spans = request.item_logprobs and continuations is None  # each item's own tokens after the first (log-likelihood)
        context = request.kind.items_context(shared_out.logits[0])
        results = []
        for g_index, group in enumerate(items_plan.groups):
            self.meter.start()
            out = self.executor.forward_batch(
                ForwardBatch([Sequence(torch.tensor(items[j], dtype=torch.long), prefix=shared_kv, rope_length=regime,
                                       logprob_rows=len(items[j]) - 1 if spans else 0, pool=request.pool,
                                       capture=(len(shared), len(shared) + len(items[j])) if continuations and continuations[j] else None)
                              for j in group]),
                self.chunk_size, items_plan.items_inplace)
            peak = self.meter.peak_growth()
            tree = self._run_continuations(request, shared_kv, dict(zip(group, out.captured)), items_plan.continuations[g_index],
                                           regime, items_plan.items_inplace) if continuations else {}
            results += [request.kind.item_result(request, j, context,
                                                 RowOutput(out.logits[g], tree.get(j, out.spans[g]), p, peak, out.pooled[g]),
                                                 self.token_text)
                        for g, j in enumerate(group)]
        # items and their continuations: every computed token but the shared prompt's
        return StepOutcome([request.kind.items_done(request, results, p)], item_tokens=request.prompt_tokens - request.cache_tokens)

    def _run_continuations(self, request: Request, shared_kv: PrefixKV, item_kv: dict, forwards: list[list[tuple[int, int]]],
                           regime: int, inplace: bool) -> dict[int, list]:
        """Each item's continuations over the shared K/V and the item's own, in the plan's forwards:
        per item, one logprob span per continuation (its tokens after the first; None for one token)."""
        continuations = request.item_continuations
        spans = {j: [None] * len(continuations[j]) for j in item_kv if continuations[j]}
        for pairs in forwards:
            out = self.executor.forward_batch(
                ForwardBatch([Sequence(torch.tensor(continuations[j][c], dtype=torch.long),
                                       prefix=ChainedPrefix(shared_kv, item_kv[j]), rope_length=regime,
                                       logprob_rows=len(continuations[j][c]) - 1) for j, c in pairs]),
                self.chunk_size, inplace)
            for (j, c), span in zip(pairs, out.spans):
                spans[j][c] = span if len(continuations[j][c]) > 1 else None
        return spans


def _uncached_sequence(ids: list[int], access: PrefixAccess, capture: tuple[int, int] | None = None,
                       rope_length: int | None = None, logprobs: tuple[int, int] = (0, 0), pool: str | None = None) -> Sequence:
    """The tokens the cache did not hold, fed the cached prefix and keeping the ticket's blocks;
    logprobs: (positions, top k) of a logprob span over the prompt's last positions but one
    (cached ones read their hidden states from the cache)."""
    rows = logprobs[0]
    return Sequence(torch.tensor(ids[access.cached_tokens:], dtype=torch.long), prefix=access.source,
                    sink=access.sink, capture=capture, rope_length=rope_length,
                    logprob_rows=rows, logprob_top_k=logprobs[1],
                    logprob_targets=torch.tensor(ids[len(ids) - rows :], dtype=torch.long) if rows else None, pool=pool)
