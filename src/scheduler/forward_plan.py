"""How a step's lone member runs within the activation budget (tensor-free): the scheduler's
memory decisions beyond which requests share a step.

    attention_in_place(budget, shape, captured)    False if the step fits with attention out of
                                                   place, True if only in place, else OverBudgetError
    item_modes(budget, shared, cached, items)      a multi-item request: the shared prompt's mode and
                                                   the items' mode (what submit checks)
    plan_items(budget, shared, cached, items)      those modes and the items' grouping per forward
                                                   (and their continuations', for a tree)

The same functions answer at submit (Scheduler.add, with nothing cached: the worst case) and at
pick time (on the member's real split), so a prompt that can never fit is refused before it waits.
"""

from __future__ import annotations

from ..contract.errors import OverBudgetError
from .plan import ItemsPlan, StepBudget, TokenSplit


def attention_in_place(budget: StepBudget, shape: list[TokenSplit], captured: int = 0,
                       logprob_spans: list[tuple[int, int]] | None = None) -> bool:
    """Whether one forward over `shape` (its members' logprob spans, (rows, top k) each) must write
    attention over Q (CPU: slower, no second [S, q_width] tensor) to fit the activation budget;
    OverBudgetError if it fits neither way."""
    if budget.fits_memory(shape, captured, logprob_spans=logprob_spans):
        return False
    memory = budget.memory
    if memory.inplace_supported and budget.fits_memory(shape, captured, True, logprob_spans):
        return True
    need = memory.peak_bytes(shape, captured, memory.inplace_supported, logprob_spans)
    tokens = sum(s.uncached + s.cached for s in shape)
    raise OverBudgetError(
        f"a {tokens}-token prompt needs ~{need / 2**20:.1f} MiB of activation memory, over the budget of "
        f"{memory.budget_bytes / 2**20:.1f} MiB (raise activation_budget_bytes or lower chunk_size)")


def item_modes(budget: StepBudget, shared_tokens: int, cached: int, items: list[int],
               item_logprobs: bool = False, continuations: list[list[int]] | None = None) -> tuple[bool, bool]:
    """Whether a multi-item request's shared prompt, and its longest item over the held shared K/V,
    need attention in place (OverBudgetError if either fits neither way): the whole check at submit.
    item_logprobs: each item computes its own tokens' logprobs (a span of its length - 1 rows);
    continuations: per item, the lengths of those scored over it (the longest over the longest item
    must fit too, with both K/Vs held)."""
    longest = max(items)
    shared_mode = attention_in_place(budget, [TokenSplit(shared_tokens - cached, cached)], captured=shared_tokens)
    if continuations and any(continuations):
        held = shared_tokens + longest
        items_mode = attention_in_place(budget, [TokenSplit(longest, shared_tokens)], held)
        cont = max(n for c in continuations for n in c)
        return shared_mode, attention_in_place(budget, [TokenSplit(cont, held)], held, [(cont - 1, 0)]) or items_mode
    return (shared_mode, attention_in_place(budget, [TokenSplit(longest, shared_tokens)], shared_tokens,
                                            _item_rows([longest], item_logprobs)))


def _item_rows(items: list[int], item_logprobs: bool) -> list[tuple[int, int]] | None:
    return [(n - 1, 0) for n in items] if item_logprobs else None


def plan_items(budget: StepBudget, shared_tokens: int, cached: int, items: list[int],
               item_logprobs: bool = False, continuations: list[list[int]] | None = None) -> ItemsPlan:
    """The shared prompt once (its K/V held for the request, counted like a capture of its size),
    then consecutive items per forward while their tokens fit the token budget and the step's
    prediction (each item reads the shared K/V as its prefix) fits the memory budget; items that
    need attention in place run one per forward. With continuations (a tree), an item that has
    some keeps its own K/V until they ran (counted as captured), and after each group its
    continuations run in forwards of their own (plan_continuations), in the items' attention mode."""
    tree = bool(continuations and any(continuations))
    shared_inplace, items_inplace = item_modes(budget, shared_tokens, cached, items, item_logprobs, continuations)
    held = (lambda group: shared_tokens + sum(items[g] for g in group if continuations[g])) if tree else (lambda group: shared_tokens)
    groups: list[list[int]] = []
    group: list[int] = []
    tokens = 0
    for j, n in enumerate(items):
        candidate = [TokenSplit(items[g], shared_tokens) for g in group] + [TokenSplit(n, shared_tokens)]
        rows = _item_rows([items[g] for g in group] + [n], item_logprobs and not tree)
        if group and not items_inplace and tokens + n <= budget.tokens and \
                budget.fits_memory(candidate, held(group + [j]), logprob_spans=rows):
            group.append(j)
            tokens += n
        else:
            if group:
                groups.append(group)
            group, tokens = [j], n
    groups.append(group)
    if not tree:
        return ItemsPlan(shared_inplace, items_inplace, groups)
    return ItemsPlan(shared_inplace, items_inplace, groups,
                     [plan_continuations(budget, shared_tokens, items, continuations, g, held(g)) for g in groups])


def plan_continuations(budget: StepBudget, shared_tokens: int, items: list[int], continuations: list[list[int]],
                       group: list[int], held: int) -> list[list[tuple[int, int]]]:
    """The continuations of a group's items as (item, continuation) pairs per forward: each reads
    the shared K/V and its item's as its prefix and its own tokens' logprobs (a span of its length
    - 1 rows), while the group's item K/Vs are held; consecutive pairs while tokens and memory fit."""
    forwards: list[list[tuple[int, int]]] = []
    batch: list[tuple[int, int]] = []
    tokens = 0
    for j in group:
        for c, n in enumerate(continuations[j]):
            candidate = batch + [(j, c)]
            shape = [TokenSplit(continuations[a][b], shared_tokens + items[a]) for a, b in candidate]
            spans = [(continuations[a][b] - 1, 0) for a, b in candidate]
            if batch and tokens + n <= budget.tokens and budget.fits_memory(shape, held, logprob_spans=spans):
                batch.append((j, c))
                tokens += n
            else:
                if batch:
                    forwards.append(batch)
                batch, tokens = [(j, c)], n
    if batch:
        forwards.append(batch)
    return forwards
