"""Batched prefill: a ForwardBatch equals its members' single forwards, steps stay inside their
budgets, CSJF picks the members it should, no block is computed twice in one step, and every
request is answered exactly once."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest
import torch

from prefillonly import DeadlineExceededError, Engine, EngineConfig, OverBudgetError
from prefillonly.cache.prefix_io import PrefixKV
from prefillonly.worker.executor import ForwardBatch, HybridPrefillExecutor, Sequence
from prefillonly.kernels.backend import KernelBackend
from prefillonly.model.spec import ModelSpec
from prefillonly.cache.index import PrefixIndex
from prefillonly.scheduler.forward_plan import plan_items
from prefillonly.scheduler import IndexPrefixView, JctEstimator, Scheduler, StepBudget, StepOutcome, TokenSplit, WaitingRequest
from prefillonly.model.weights import ModelWeights

from ..conftest import FAMILY_CONFIGS
from ..reference import hf_logprobs, load_hf, max_abs

CPU = torch.device("cpu")
FP32_TOL = 1e-4


def _executor(folder, backend="sdpa"):
    spec = ModelSpec.from_folder(folder)
    return HybridPrefillExecutor(spec, ModelWeights.load(folder, spec, torch.float32, CPU), KernelBackend(CPU, torch.float32, spec.head_dim, backend))


def _ids(gen, vocab, n):
    return torch.randint(0, vocab, (n,), generator=gen)


def _members(gen, vocab, executor, lengths, prefixes):
    """Sequences of the given new lengths, each after a captured prefix of the given length (0: none)."""
    seqs = []
    for n, p in zip(lengths, prefixes):
        prefix = None
        if p:
            prefix = executor.forward(_ids(gen, vocab, p), None, capture=(0, p)).captured
        seqs.append(Sequence(_ids(gen, vocab, n), prefix=prefix))
    return seqs


def _batch_vs_singles(executor, seqs, chunk):
    batched = executor.forward_batch(ForwardBatch(seqs), chunk).logits
    worst = 0.0
    for i, s in enumerate(seqs):
        single = executor.forward(s.token_ids, chunk, prefix=s.prefix).logits
        worst = max(worst, max_abs(batched[i].log_softmax(-1), single.log_softmax(-1)))
    return worst


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_batch_equals_single_forwards_every_family(family_folders, name):
    executor = _executor(family_folders[name])
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    vocab = executor.spec.vocab_size
    # mixed lengths 1 ... 700 (odd ones), with and without prefixes, some prefixes block-aligned
    lengths = [1, 700, 7, 65, 130, 3]
    prefixes = [0, 0, 64, 33, 128, 257]
    seqs = _members(gen, vocab, executor, lengths, prefixes)
    for chunk in (None, 64, 7):  # chunks that span several sequences and split others
        assert _batch_vs_singles(executor, seqs, chunk) <= FP32_TOL, chunk


def test_batch_equals_transformers(family_folders):
    """The batched logits against transformers' forward of each whole prompt (prefix + new)."""
    folder = family_folders["qwen3_qknorm_untied"]
    executor, model = _executor(folder), load_hf(folder, torch.float32)
    gen = torch.Generator().manual_seed(3)
    prompts = [_ids(gen, executor.spec.vocab_size, n).tolist() for n in (5, 90, 1, 200)]
    cut = [0, 40, 0, 150]  # leading tokens given as a cached prefix
    seqs = []
    for ids, p in zip(prompts, cut):
        prefix = executor.forward(torch.tensor(ids[:p]), None, capture=(0, p)).captured if p else None
        seqs.append(Sequence(torch.tensor(ids[p:]), prefix=prefix))
    out = executor.forward_batch(ForwardBatch(seqs), 32).logits
    for i, ids in enumerate(prompts):
        assert max_abs(out[i].double().log_softmax(-1), hf_logprobs(model.double(), ids)) <= FP32_TOL


# The default (real) model: prompts as (cached prefix ids or None, new ids), and its float64 forward
# of each, once per module (~20 s on 2 cores).
DEFAULT_MODEL_LENGTHS, DEFAULT_MODEL_PREFIXES = [1, 2048, 170, 9], [0, 0, 1024, 333]


def _prompts(gen, vocab, lengths, prefixes):
    return [(_ids(gen, vocab, p) if p else None, _ids(gen, vocab, n)) for n, p in zip(lengths, prefixes)]


def _sequences(executor, prompts):
    return [Sequence(new, prefix=executor.forward(pre, None, capture=(0, len(pre))).captured if pre is not None else None)
            for pre, new in prompts]


@pytest.fixture(scope="module")
def default_model_float64(default_model_path):
    prompts = _prompts(torch.Generator().manual_seed(11), ModelSpec.from_folder(default_model_path).vocab_size,
                       DEFAULT_MODEL_LENGTHS, DEFAULT_MODEL_PREFIXES)
    spec = ModelSpec.from_folder(default_model_path)
    ex64 = HybridPrefillExecutor(spec, ModelWeights.load(default_model_path, spec, torch.float64, CPU), KernelBackend(CPU, torch.float64, spec.head_dim))
    return prompts, [ex64.forward(s.token_ids, 512, prefix=s.prefix).logits.log_softmax(-1) for s in _sequences(ex64, prompts)]


@pytest.mark.heavy  # the 135M model in float64 and fp32 on long prompts: ~40 s of the fast tier otherwise
@pytest.mark.parametrize("backend", ["cpu_flash", "sdpa"])
def test_batch_equals_single_forwards_default_model(default_model_path, default_model_float64, backend):
    """The real model packed in one step vs each prompt alone, both against its float64 forward.
    An absolute fp32 bound does not hold on every host here: fp32 GEMMs of different row counts
    round differently, and the first position's activations are this model's largest (seen on a
    Xeon with AMX: the 1-token prompt packed with 2K others is 1.1e-4 off float64, alone 2e-5, with
    either attention backend). So the bound is the host's own fp32 error: the batched forward
    within 8x the worst single forward's distance to float64, and a batching bug (rows mixed,
    a wrong prefix or position) is orders of magnitude beyond it."""
    from prefillonly.kernels import cpu_ext

    if backend == "cpu_flash" and cpu_ext.load_attention() is None:
        pytest.fail(f"the compiled attention kernel must build on every CI host: {cpu_ext.why_attention_unavailable()}")
    prompts, reference = default_model_float64
    executor = _executor(default_model_path, backend)
    seqs = _sequences(executor, prompts)
    batched = executor.forward_batch(ForwardBatch(seqs), 512).logits
    single_err = max(max_abs(executor.forward(s.token_ids, 512, prefix=s.prefix).logits.log_softmax(-1).double(), ref)
                     for s, ref in zip(seqs, reference))
    batched_err = max(max_abs(batched[i].log_softmax(-1).double(), ref) for i, ref in enumerate(reference))
    assert single_err <= FP32_TOL  # the fp32 path itself is right
    assert batched_err <= 8 * single_err, (batched_err, single_err)


def test_batch_captures_each_members_range(family_folders):
    executor = _executor(family_folders["llama_gqa_llama3rope_untied"])
    gen = torch.Generator().manual_seed(5)
    a, b = _ids(gen, 300, 20), _ids(gen, 300, 35)
    prefix = executor.forward(_ids(gen, 300, 10), None, capture=(0, 10)).captured
    out = executor.forward_batch(ForwardBatch([Sequence(a, capture=(0, 20)), Sequence(b, prefix=prefix, capture=(5, 45))]), 16)
    single_a = executor.forward(a, 16, capture=(0, 20)).captured
    single_b = executor.forward(b, 16, prefix=prefix, capture=(5, 45)).captured
    for got, want in ((out.captured[0], single_a), (out.captured[1], single_b)):
        assert isinstance(got, PrefixKV) and got.length == want.length
        for layer in range(len(want.keys)):
            assert max_abs(got.keys[layer], want.keys[layer]) <= 1e-5
            assert max_abs(got.values[layer], want.values[layer]) <= 1e-5


def test_forward_batch_refuses_empty_members(family_folders):
    with pytest.raises(ValueError):
        ForwardBatch([])
    with pytest.raises(ValueError):
        ForwardBatch([Sequence(torch.tensor([1, 2])), Sequence(torch.tensor([], dtype=torch.long))])


# -- the scheduler's step ----------------------------------------------------------------------
def _scheduler(policy="csjf", block=16, slots=4096):
    """A scheduler over a real (tensor-free) PrefixIndex, as the engine's and the simulator's."""
    est = JctEstimator()
    for u, c in [(100, 0), (1000, 0), (200, 2000), (50, 500), (3000, 0)]:
        est.observe(u, c, 0.002 + 1e-4 * u + 1e-8 * u * (u + 2 * c))
    index = PrefixIndex(slots, block_size=block)
    return Scheduler(policy, est, IndexPrefixView(index)), index


def _step(sched, budget):
    """The next step's plan within `budget`."""
    sched.budget = budget
    return sched.schedule()


def _finish(sched, plan):
    """The step ran (scheduler.finish with a result per member): its kept blocks become
    matchable, its pins are released; the members, in step order."""
    answers = sched.finish(plan, StepOutcome([None] * len(plan)))
    return [a.request for a in answers]


class TokensMemory:
    """A StepMemory whose prediction is 1.5 bytes per uncached token, against 2,000 bytes."""

    budget_bytes = 2000
    inplace_supported = False

    def peak_bytes(self, shape, captured=0, inplace=False, logprob_spans=None):
        return sum(s.uncached for s in shape) * 1.5


def _req(tokens, hashes=(), keep=None, priority=0, alone=False):
    hashes = list(hashes)
    return WaitingRequest(prompt_tokens=tokens, block_hashes=hashes, kept_blocks=len(hashes) if keep is None else keep,
                          priority=priority, runs_alone=alone)


def test_a_step_respects_the_token_budget_and_the_memory_check():
    """Every step's real (pinned) split fits both budgets; a step of one may be over them. Users
    share profiles (so groups, pins and the block rule all take part), and a small pool makes
    pins evict: the plan is checked on what the tickets found, not on the estimate."""
    rng = random.Random(7)
    for trial in range(200):
        sched, index = _scheduler(slots=rng.choice([8, 64, 4096]))
        profiles = [[f"{trial}-u{u}-{b}".encode() for b in range(rng.randint(0, 6))] for u in range(4)]
        for i in range(rng.randint(1, 30)):
            hashes = rng.choice(profiles) + [f"{trial}-{i}-{b}".encode() for b in range(rng.randint(0, 3))]
            sched.add(_req(rng.randint(len(hashes) * 16 + 1, len(hashes) * 16 + 600), hashes))
        budget = StepBudget(rng.choice([1, 100, 512, 2048, 8192]), rng.choice([None, TokensMemory()]))
        while len(sched):
            plan = _step(sched, budget)
            assert plan
            for m in plan.members:  # the split is the ticket's truth
                assert m.split == TokenSplit(m.request.prompt_tokens - m.ticket.cached_tokens, m.ticket.cached_tokens)
            if len(plan) > 1:  # a single request may be over either budget: it runs alone
                assert budget.admits(plan.shape)
            _finish(sched, plan)
        assert all(b.refs == 0 for b in index.blocks.values())  # every released or finished pin is gone


def test_a_step_follows_csjf_order_within_a_priority_class():
    sched, index = _scheduler()
    long_cold = _req(3000)
    short = [_req(n) for n in (200, 150, 400)]
    vip = _req(900, priority=5)
    alone = _req(50, alone=True)
    for r in [long_cold, *short, vip, alone]:
        sched.add(r)
    assert _finish(sched, _step(sched, StepBudget(4096))) == [vip]  # priorities first, never mixed with another class
    # shortest first; the multi-item request never shares a step; the long one does not fit
    assert _finish(sched, _step(sched, StepBudget(4096))) == [alone]
    assert _finish(sched, _step(sched, StepBudget(1000))) == [short[1], short[0], short[2]]
    assert _finish(sched, _step(sched, StepBudget(1000))) == [long_cold]  # over the budget: alone


def test_requests_needing_the_same_uncached_blocks_are_not_batched():
    # requests ranked on their own: with dependency groups `same_as_keeps_nothing` would lead
    # its group and go first (tests/cache_scheduler/test_dependency_groups.py), which this test is not about
    sched, index = _scheduler("csjf-independent")
    profile = [b"u1-0", b"u1-1", b"u1-2"]
    first = _req(60, profile)
    same_profile = _req(70, profile + [b"u1-x"])
    keeps_nothing = _req(55, [b"u2-0", b"u2-1"], keep=0)
    same_as_keeps_nothing = _req(56, [b"u2-0", b"u2-1", b"u2-2"])
    other = _req(80, [b"u3-0"])
    for r in (first, same_profile, keeps_nothing, same_as_keeps_nothing, other):
        sched.add(r)
    batch = _finish(sched, _step(sched, StepBudget(4096)))  # the step commits the profile
    assert first in batch and other in batch and keeps_nothing in batch
    assert same_profile not in batch  # it waits for `first` to cache the profile
    # `keeps_nothing` caches nothing, so sharing its blocks saves nothing by waiting
    assert same_as_keeps_nothing in batch
    assert sched.split(same_profile) == (70 - 48, 48)
    assert _finish(sched, _step(sched, StepBudget(4096))) == [same_profile]


def test_fully_cached_identical_prompts_share_a_step():
    sched, index = _scheduler()
    keys = [b"p0", b"p1"]
    sched.add(_req(33, keys))
    _finish(sched, _step(sched, StepBudget(4096)))  # caches both blocks
    reqs = [_req(32, keys) for _ in range(5)]  # e.g. perf_analyzer repeating one prompt
    for r in reqs:
        sched.add(r)
    assert _finish(sched, _step(sched, StepBudget(4096))) == reqs


class InPlaceMemory(TokensMemory):
    """TokensMemory where writing attention over Q halves the prediction."""

    inplace_supported = True

    def peak_bytes(self, shape, captured=0, inplace=False, logprob_spans=None):
        return (super().peak_bytes(shape) + captured) / (2 if inplace else 1)


def test_the_scheduler_decides_a_lone_members_memory_and_refuses_what_never_fits():
    """Out of place when it fits, in place when only that fits (counted), and a prompt that fits
    neither way with nothing cached is refused at add(), counted as rejected, never queued."""
    sched, index = _scheduler()
    sched.budget = StepBudget(8192, InPlaceMemory())
    fits, in_place, never = _req(1000), _req(2000), _req(3000)  # 1,500 / 3,000 / 4,500 bytes against 2,000
    sched.add(fits)
    sched.add(in_place)
    with pytest.raises(OverBudgetError, match="over the budget"):
        sched.add(never)
    assert len(sched) == 2 and sched.counters.rejected["over_memory_budget"] == 1
    first = sched.schedule()
    assert [m.request for m in first.members] == [fits] and not first.inplace_attention
    _finish(sched, first)
    second = sched.schedule()
    assert [m.request for m in second.members] == [in_place] and second.inplace_attention
    assert sched.counters.inplace_attention == 1
    _finish(sched, second)
    assert sched.counters.completed == 2


@pytest.mark.parametrize("seed", range(5))
def test_item_groups_keep_order_and_both_budgets(seed):
    """plan_items: every item exactly once, in order; a group of several fits the token budget
    and (its items each reading the shared prompt, held as a capture) the memory budget."""
    rng = random.Random(seed)
    items = [rng.randint(1, 400) for _ in range(rng.randint(1, 30))]
    shared = rng.randint(1, 300)
    budget = StepBudget(rng.choice([1, 300, 1000, 4096]), rng.choice([None, InPlaceMemory()]))
    plan = plan_items(budget, shared, 0, items)
    assert [j for g in plan.groups for j in g] == list(range(len(items)))
    for g in plan.groups:
        if len(g) > 1:
            shape = [TokenSplit(items[j], shared) for j in g]
            assert budget.admits(shape, captured=shared) and not plan.items_inplace


@pytest.mark.parametrize("seed", range(5))
def test_a_tree_plans_each_continuation_once_after_its_item_within_both_budgets(seed):
    """plan_items with continuations (decisions' options over their question): items as before; after
    each group, every continuation of its items exactly once, in order, a forward of several within
    the token budget and (the shared prompt and the group's item K/Vs held) the memory budget."""
    rng = random.Random(seed)
    items = [rng.randint(1, 200) for _ in range(rng.randint(1, 20))]
    conts = [[rng.randint(1, 30) for _ in range(rng.choice([0, 2, 5]))] for _ in items]
    shared = rng.randint(1, 300)
    budget = StepBudget(rng.choice([1, 300, 1000, 4096]), rng.choice([None, InPlaceMemory()]))
    plan = plan_items(budget, shared, 0, items, continuations=conts)
    assert [j for g in plan.groups for j in g] == list(range(len(items)))
    for group, forwards in zip(plan.groups, plan.continuations, strict=True):
        assert [p for f in forwards for p in f] == [(j, c) for j in group for c in range(len(conts[j]))]
        held = shared + sum(items[j] for j in group if conts[j])
        for f in forwards:
            if len(f) > 1:
                assert sum(conts[j][c] for j, c in f) <= budget.tokens
                assert budget.admits([TokenSplit(conts[j][c], shared + items[j]) for j, c in f], captured=held)


def test_step_cost_model_recovers_its_coefficients():
    a, b, k = 0.02, 2e-4, 3e-8
    est = JctEstimator()
    rng = random.Random(3)
    for _ in range(100):
        members = [(rng.randint(1, 2000), rng.choice([0, 512, 2048])) for _ in range(rng.randint(1, 8))]
        est.observe_step(members, a + sum(b * u + k * u * (u + 2 * c) for u, c in members))
    c = est.coefficients
    assert c.fixed_s == pytest.approx(a, rel=1e-3)
    assert c.per_token_s == pytest.approx(b, rel=1e-3)
    assert c.attention_s == pytest.approx(k, rel=1e-3)
    assert est.predict(100, 1000) == pytest.approx(a + b * 100 + k * 100 * 2100)  # a request's own term, plus a


# -- the engine's steps -------------------------------------------------------------------------
def _engine(folder, **kw):
    kw.setdefault("cache_budget_bytes", 8 << 20)
    return Engine(EngineConfig(model=folder, dtype="float32", threads=2, cache_block_size=16, **kw))


class StepRecorder:
    """Wraps the runner: holds the first step until released and records every step's members."""

    def __init__(self, engine):
        self.engine, self.runner = engine, engine.runner
        self.release, self.started = threading.Event(), threading.Event()
        self.steps = []  # per step: [(uncached, cached, first computed block, keeps it)]
        self.spans = []  # per step: its members' logprob spans (rows, top k)
        self._execute = engine.runner.execute
        engine.runner.execute = self.execute

    def execute(self, plan):
        self.steps.append([(m.split.uncached, m.split.cached, m.ticket.new[0].hash if m.ticket and m.ticket.new else None)
                           for m in plan.members])
        self.spans.append(plan.spans)
        if len(self.steps) == 1:
            self.started.set()
            self.release.wait(30)
        return self._execute(plan)


def test_engine_batches_and_matches_unbatched_results(family_folders):
    folder = family_folders["mistral_gqa_linear_rope"]
    rng = random.Random(9)
    profiles = [[rng.randrange(300) for _ in range(rng.choice([64, 100, 37]))] for _ in range(4)]
    prompts = [(u, profiles[u] + [rng.randrange(300) for _ in range(rng.randint(1, 40))]) for u in range(4) for _ in range(3)]
    prompts += [(None, [rng.randrange(300) for _ in range(n)]) for n in (1, 2, 513)]
    reference = {}
    with _engine(folder, max_batch_tokens=1) as plain:  # one request per step
        for i, (user, ids) in enumerate(prompts):
            reference[i] = plain.score(ids, [5, 17, 200], cache_prefix_len=len(profiles[user]) if user is not None else 0)
        items_ref = plain.score_items(profiles[0], [[1, 2, 3], [7] * 20, [9]], [5, 17])
        assert plain.stats().recent_steps and all(r.requests == 1 for r in plain.stats().recent_steps)
    with _engine(folder, max_batch_tokens=600) as engine:
        rec = StepRecorder(engine)
        first = engine.submit([1, 2, 3], [5])
        assert rec.started.wait(30)
        futures = {i: engine.submit(ids, [5, 17, 200], cache_prefix_len=len(profiles[user]) if user is not None else 0)
                   for i, (user, ids) in enumerate(prompts)}
        items = engine.submit_items(profiles[0], [[1, 2, 3], [7] * 20, [9]], [5, 17])
        rec.release.set()
        results = {i: f.result(60) for i, f in futures.items()}
        assert first.result(30).prompt_tokens == 3
        got_items = items.result(60)
        steps = engine.stats().recent_steps
    assert max(r.requests for r in steps) > 1, steps  # some step really batched
    for i, r in results.items():
        want = reference[i]
        assert [t.logprob for t in r.tokens] == pytest.approx([t.logprob for t in want.tokens], abs=FP32_TOL)
    for got, want in zip(got_items, items_ref):
        assert [t.logprob for t in got.tokens] == pytest.approx([t.logprob for t in want.tokens], abs=FP32_TOL)
    for members in rec.steps:
        if len(members) > 1:
            assert sum(u for u, _, _ in members) <= 600
            assert engine.scheduler.budget.fits_memory([TokenSplit(u, c) for u, c, _ in members])
        computed = [h for _, _, h in members if h is not None]
        assert len(computed) == len(set(computed)), "a block computed twice in one step"
    # every user's later requests found the profile its first one cached
    for user in range(4):
        cached = sorted(results[i].cached_tokens for i, (u, _) in enumerate(prompts) if u == user)
        assert cached[1:] == [len(profiles[user]) // 16 * 16] * 2, (user, cached)


def test_logprob_spans_share_a_step_and_match_their_lone_runs(family_folders):
    """Prompt-logprob requests (top k 0, 1 and 3; some over a profile another request cached) batch
    with each other and with plain requests; each answer equals its run alone, and every batched
    step fits the memory check with its members' spans counted."""
    folder = family_folders["mistral_gqa_linear_rope"]
    rng = random.Random(4)
    profile = [rng.randrange(300) for _ in range(70)]
    prompts = [profile + [rng.randrange(300) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    prompts += [[rng.randrange(300) for _ in range(n)] for n in (2, 45, 130)]
    asks = [dict(start=rng.randint(1, len(p) - 1), top_k=rng.choice([0, 1, 3])) for p in prompts]
    with _engine(folder, max_batch_tokens=1) as plain:
        plain.score(profile, [5])  # the profile cached (in the batched run the first request caches it)
        reference = [plain.prompt_logprobs(p, **a) for p, a in zip(prompts, asks)]
        score_ref = plain.score(prompts[0], [5, 17])
    with _engine(folder, max_batch_tokens=600) as engine:
        rec = StepRecorder(engine)
        first = engine.submit(profile, [5])
        assert rec.started.wait(30)
        futures = [engine.submit_prompt_logprobs(p, **a) for p, a in zip(prompts, asks)]
        scored = engine.submit(prompts[0], [5, 17])
        rec.release.set()
        results = [f.result(60) for f in futures]
        first.result(30)
        assert [t.logprob for t in scored.result(30).tokens] == pytest.approx([t.logprob for t in score_ref.tokens], abs=FP32_TOL)
    assert any(len(s) > 1 and any(rows for rows, _ in s) for s in rec.spans), rec.spans  # spans really batched
    for got, want in zip(results, reference):
        assert got.start == want.start and got.greedy == want.greedy
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=FP32_TOL)
        assert [[t.id for t in r] for r in got.top_k] == [[t.id for t in r] for r in want.top_k]
    for members, spans in zip(rec.steps, rec.spans):
        if len(members) > 1:
            assert engine.scheduler.budget.fits_memory([TokenSplit(u, c) for u, c, _ in members], logprob_spans=spans)


def test_a_profile_cached_by_one_step_moves_its_next_request_forward(family_folders):
    """CSJF re-estimates against the cache at every step: a request whose profile the previous
    step just cached becomes the shortest job and runs next, ahead of cold requests that
    arrived before it (FCFS would run it last)."""
    folder = family_folders["llama_mha_tied"]
    rng = random.Random(2)
    profile = [rng.randrange(300) for _ in range(480)]
    with _engine(folder, max_batch_tokens=502) as engine:
        rec = StepRecorder(engine)
        held = engine.submit([4, 5, 6], [5])
        assert rec.started.wait(30)
        owner = engine.submit(profile + [9], [5])  # 481 tokens: the shortest job, computes the profile
        cold = [engine.submit([rng.randrange(300) for _ in range(500)], [5]) for _ in range(2)]
        warm_soon = engine.submit(profile + [1, 2, 3], [5])  # needs the owner's blocks: waits one step
        rec.release.set()
        for f in (held, owner, warm_soon, *cold):
            f.result(60)
    sizes = [[(u, c) for u, c, _ in m] for m in rec.steps]
    assert sizes[1] == [(481, 0)], sizes  # the owner alone: the warm one must wait, a cold one does not fit
    assert sizes[2] == [(3, 480)], sizes  # next: the warm request, with the profile from the cache
    assert sizes[3:] == [[(500, 0)], [(500, 0)]], sizes
    assert warm_soon.result().cached_tokens == 480


def test_every_request_answered_once_under_concurrent_submits_cancels_and_deadlines(family_folders):
    folder = family_folders["qwen2_bias_tied"]
    outcomes, lock = [], threading.Lock()
    with _engine(folder, max_batch_tokens=256, max_waiting=512) as engine:
        def client(seed):
            rng = random.Random(seed)
            futures = []
            for _ in range(25):
                ids = [rng.randrange(300) for _ in range(rng.randint(1, 120))]
                deadline = rng.choice([None, None, 0.001, 5.0])
                f = engine.submit(ids, [5, 9], deadline_s=deadline, user=f"u{rng.randrange(3)}")
                if rng.random() < 0.2:
                    f.cancel()
                futures.append(f)
            for f in futures:
                try:
                    f.result(60)
                    kind = "ok"
                except CancelledError:
                    kind = "cancelled"
                except DeadlineExceededError:
                    kind = "deadline"
                with lock:
                    outcomes.append(kind)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(client, range(4), timeout=120))
        time.sleep(0.1)
        stats = engine.stats()
    assert len(outcomes) == 100
    assert stats.waiting == 0
    assert stats.counters.completed == outcomes.count("ok")
    assert stats.counters.rejected["deadline_exceeded"] == outcomes.count("deadline")


def _fail_once(obj, name: str, error: Exception) -> None:
    """obj.name raises `error` on its next call only (then the real method is back)."""
    real = getattr(obj, name)

    def broken(*args, **kwargs):
        setattr(obj, name, real)
        raise error

    setattr(obj, name, broken)


def test_a_failing_step_answers_its_requests_and_the_worker_keeps_serving(family_folders):
    with _engine(family_folders["llama_gqa_llama3rope_untied"]) as engine:
        _fail_once(engine.cache, "execute", RuntimeError("cache exploded"))
        with pytest.raises(RuntimeError, match="cache exploded"):
            engine.submit([1, 2, 3], [5]).result(30)  # a dead worker would time out here
        assert engine.stats().counters.failed["RuntimeError"] == 1
        _fail_once(engine.scheduler, "schedule", RuntimeError("scheduler exploded"))
        with pytest.raises(RuntimeError, match="scheduler exploded"):
            engine.submit([1, 2, 4], [5]).result(30)
        assert engine.stats().counters.failed["RuntimeError"] == 2
        _fail_once(engine.executor, "forward_batch", RuntimeError("forward exploded"))
        prompt = list(range(40))  # two whole blocks: reserved, then released by the failure
        with pytest.raises(RuntimeError, match="forward exploded"):
            engine.submit(prompt, [5]).result(30)
        again = engine.score(prompt, [5])  # nothing was cached by the failed step, nothing stays pinned
        assert again.cached_tokens == 0 and engine.score(prompt, [5]).cached_tokens == 32
        assert all(b.refs == 0 for b in engine.cache.index.blocks.values())
