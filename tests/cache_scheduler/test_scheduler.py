"""Scheduler policies, the JCT estimator, and the engine's request loop."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass

import numpy as np
import pytest

from prefillonly import DeadlineExceededError, Engine, EngineClosedError, EngineConfig, OverloadedError
from prefillonly.cache.index import IndexTicket, usable_cached_tokens
from prefillonly.scheduler import JctEstimator, Scheduler, WaitingRequest


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fitted_estimator(per_token=1e-3, attention=1e-8, fixed=0.01):
    est = JctEstimator()
    rng = random.Random(0)
    for _ in range(20):
        u, c = rng.randrange(10, 4000), rng.randrange(0, 4000)
        est.observe(u, c, fixed + per_token * u + attention * u * (u + 2 * c))
    return est


class UserPrefix:
    """A PrefixView whose cached tokens per user the test sets (no blocks: no groups, no pins)."""

    block_size = 0

    def __init__(self, cached):
        self.cached = cached

    def cached_tokens(self, req):
        return self.cached.get(req.user, 0)

    def begin(self, req):
        return IndexTicket(cached_tokens=usable_cached_tokens(self.cached_tokens(req), req.cache_tokens), matched=[], new=[]), []

    def commit(self, ticket):
        pass

    def abort(self, ticket):
        pass


def make(policy, cached=None, **kw):
    clock = FakeClock()
    cached = cached if cached is not None else {}
    s = Scheduler(policy, fitted_estimator(), UserPrefix(cached), clock=clock, **kw)
    return s, clock, cached


def pick(s):
    """The next request alone (a step of one), or None."""
    plan = s.schedule()  # the default budget: one request per step
    return plan.members[0].request if plan else None


@dataclass(eq=False)
class LabelledRequest(WaitingRequest):
    """A waiting request with a name the tests pick by (and key the fake cache on)."""

    user: str | None = None


def req(tokens, user=None, priority=0):
    return LabelledRequest(prompt_tokens=tokens, user=user, priority=priority)


# -- policies -------------------------------------------------------------------------------
def test_fcfs_sjf_csjf_orders():
    for policy, want in [("fcfs", ["a", "b", "c"]), ("sjf", ["b", "c", "a"]), ("csjf", ["b", "c", "a"])]:
        s, clock, _ = make(policy)
        for name, n in [("a", 3000), ("b", 100), ("c", 1000)]:
            s.add(req(n, user=name))
            clock.t += 0.001
        assert [pick(s).user for _ in range(3)] == want, policy
        assert pick(s) is None


def test_queued_work_is_the_waiting_requests_estimates_against_the_cache_now():
    """What a replica publishes to the fleet picker: the sum of its waiting requests' own
    estimates, each on its uncached tokens as the cache is at the time of asking."""
    s, _, cached = make("csjf")
    assert s.queued_work_s() == 0.0
    for name, n in [("a", 3000), ("b", 100), ("c", 1000)]:
        s.add(req(n, user=name))
    est = s.estimator
    assert s.queued_work_s() == pytest.approx(est.predict(3000, 0) + est.predict(100, 0) + est.predict(1000, 0))
    cached["a"] = 2900  # a's prefix lands in the cache: less work left
    assert s.queued_work_s() == pytest.approx(est.predict(100, 2900) + est.predict(100, 0) + est.predict(1000, 0))
    pick(s)
    assert s.queued_work_s() < est.predict(100, 0) + est.predict(1000, 0) + est.predict(100, 2900)


def test_priority_classes_come_first():
    s, _, _ = make("csjf")
    s.add(req(100, "small"))
    s.add(req(5000, "big-urgent", priority=1))
    assert pick(s).user == "big-urgent"


def test_csjf_sees_cache_changes_and_sjf_does_not():
    for policy in ("sjf", "csjf"):
        s, clock, cached = make(policy)
        s.add(req(2000, "u1"))  # 2000 uncached now
        s.add(req(1200, "u2"))
        cached["u1"] = 1900  # u1's profile lands in the cache after both arrived
        first = pick(s).user
        assert first == ("u1" if policy == "csjf" else "u2"), policy
        cached["u1"] = 0  # and evicted again before the next decision
        s2, _, cached2 = make(policy)
        s2.add(req(2000, "u1")); s2.add(req(1200, "u2"))
        assert pick(s2).user == "u2"


def test_csjf_long_request_is_not_starved():
    """A steady stream of short requests (one arrives per pick) would always win on size; the
    long one's credit grows at lambda tokens per second waited, so it is picked within
    (its extra tokens / lambda) seconds."""
    s, clock, _ = make("csjf", lambda_tokens_per_s=500)
    s.add(req(6000, "long"))
    est = s.estimator
    gap_tokens = est.predict(6000, 0) / est.seconds_per_token - est.predict(100, 0) / est.seconds_per_token
    bound_s = gap_tokens / 500 + 1.0
    picked_at = None
    while clock.t < 3 * bound_s:
        s.add(req(100, "short"))
        if pick(s).user == "long":
            picked_at = clock.t
            break
        clock.t += 0.2
    assert picked_at is not None and picked_at <= bound_s


def test_overload_is_refused_at_once():
    s, _, _ = make("fcfs", max_waiting=2)
    s.add(req(10)); s.add(req(10))
    with pytest.raises(OverloadedError, match="overloaded: 2 requests already waiting"):
        s.add(req(10))


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler("lifo", JctEstimator())


# -- tenants: turns within a priority class --------------------------------------------------------
def treq(tokens, tenant, user=None, priority=0, **kw):
    return LabelledRequest(prompt_tokens=tokens, user=user, tenant=tenant, priority=priority, **kw)


def indexed(policy):
    """A scheduler over a real prefix index (block size 16): csjf takes order()'s grouped branch."""
    from prefillonly.cache.index import PrefixIndex
    from prefillonly.scheduler import IndexPrefixView

    clock = FakeClock()
    index = PrefixIndex(1 << 12, block_size=16)
    return Scheduler(policy, fitted_estimator(), IndexPrefixView(index), clock=clock), clock, index


def blocks(name, tokens):
    return [f"{name}-{i}".encode() for i in range(tokens // 16)]


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "csjf", "csjf-independent", "csjf-indexed"])
def test_one_tenants_flood_does_not_starve_another(policy):
    """50 short requests of tenant a queued first, then one long request of tenant b: b's runs
    second (a's best first: both are in round one, and a's is cheaper or older), not 51st."""
    if policy == "csjf-indexed":
        s, clock, index = indexed("csjf")
        new = lambda n, tenant, name: treq(n, tenant, name, block_hashes=blocks(name, n), kept_blocks=n // 16)
    else:
        (s, clock, _), index = make(policy), None
        new = lambda n, tenant, name: treq(n, tenant, name)
    for i in range(50):
        s.add(new(100, "a", f"a{i}"))
        clock.t += 0.001
    s.add(new(4000, "b", "b"))
    picked = []
    for _ in range(4):
        plan = s.schedule()
        picked.append(plan.members[0].request.user)
        if index is not None:
            index.commit(plan.members[0].ticket)
    assert picked[:2] == ["a0", "b"] and picked[2:] == ["a1", "a2"], picked


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "csjf", "csjf-independent", "csjf-indexed"])
@pytest.mark.parametrize("seed", range(5))
def test_one_tenant_orders_as_the_policy_alone(policy, seed):
    """With one tenant (keyed or not) every request's rank follows (cost, seq): order() is the
    policy's own order by (-priority, cost, seq), whatever turns the tenant has taken (the costs
    order() ranks by are captured: on the indexed csjf branch, group costs lower some leaders')."""
    rng = random.Random(seed)
    if policy == "csjf-indexed":
        s, clock, index = indexed("csjf")
    else:
        (s, clock, _), index = make(policy), None
    tenant = rng.choice([None, "solo"])
    for i in range(40):
        n, kw = rng.randrange(20, 3000), {}
        if index is not None:  # shared profiles, partly kept: dependency groups take part
            hashes = blocks(f"p{rng.randrange(3)}", 320)[: rng.randrange(0, 20)] + blocks(f"r{i}", n)
            kw = dict(block_hashes=hashes, kept_blocks=rng.randrange(0, len(hashes) + 1))
            n = len(hashes) * 16 + rng.randrange(0, 16)
        s.add(treq(n, tenant, f"r{i}", priority=rng.randrange(3), **kw))
        clock.t += rng.random() * 0.05
        if rng.random() < 0.2:  # some turns taken between arrivals
            plan = s.schedule()
            if index is not None:
                index.commit(plan.members[0].ticket)
    seen = {}
    ranked = s._tenant_turns
    s._tenant_turns = lambda costs: seen.setdefault("costs", costs) and ranked(costs)
    got = s.order()
    costs, now = seen["costs"], clock()
    assert got == sorted(s._waiting, key=lambda r: (-r.priority, costs[r], r.seq))
    if index is None:
        assert got == sorted(s._waiting, key=lambda r: (-r.priority, s.cost(r, now), r.seq))


def test_three_tenants_interleave_by_rank():
    """Tenants with 5, 3 and 1 waiting (all alike in size): one request of each per round, CSJF
    (here: the older first) within a round; the first three picks are one of each tenant."""
    s, clock, _ = make("csjf")
    for tenant, count in (("a", 5), ("b", 3), ("c", 1)):
        for i in range(count):
            s.add(treq(500, tenant, f"{tenant}{i}"))
    assert [r.user for r in s.order()] == ["a0", "b0", "c0", "a1", "b1", "a2", "b2", "a3", "a4"]
    picked = [pick(s) for _ in range(9)]
    assert {r.tenant for r in picked[:3]} == {"a", "b", "c"}
    assert [r.user for r in picked] == ["a0", "b0", "c0", "a1", "b1", "a2", "b2", "a3", "a4"]


def test_a_step_is_filled_in_turns():
    """A step of several requests takes them in the tenants' turns too."""
    from prefillonly.scheduler import StepBudget

    s, _, _ = make("csjf", budget=StepBudget(250))
    for i in range(5):
        s.add(treq(50, "a", f"a{i}"))
    s.add(treq(100, "b", "b0"))
    assert [m.request.user for m in s.schedule().members] == ["a0", "b0", "a1", "a2"]


def test_priority_comes_before_tenant_turns():
    s, _, _ = make("csjf")
    for i in range(3):
        s.add(treq(100, "a", f"a{i}"))
    s.add(treq(3000, "b", "b-urgent", priority=1))
    s.add(treq(100, "b", "b-low"))
    assert [r.user for r in s.order()] == ["b-urgent", "a0", "b-low", "a1", "a2"]
    assert [pick(s).user for _ in range(5)] == ["b-urgent", "a0", "b-low", "a1", "a2"]


def test_a_returning_tenant_starts_level_with_the_others():
    """A tenant that had nothing waiting starts with the fewest turns of those waiting: no credit
    for the time it was away (it does not take every pick until it catches up), no debt for the
    turns it took before."""
    s, _, _ = make("fcfs")
    for i in range(20):
        s.add(treq(100, "a", f"a{i}"))
    s.add(treq(100, "b", "b0"))
    assert [pick(s).user for _ in range(12)] == ["a0", "b0"] + [f"a{i}" for i in range(1, 11)]
    s.add(treq(100, "b", "b1"))  # b is back after a took 10 turns alone
    s.add(treq(100, "b", "b2"))
    assert [pick(s).user for _ in range(4)] == ["a11", "b1", "a12", "b2"]


# -- estimator --------------------------------------------------------------------------------
def test_estimator_recovers_coefficients_and_is_monotone():
    est = fitted_estimator(per_token=2e-4, attention=3e-9, fixed=0.02)
    c = est.coefficients
    assert c.per_token_s == pytest.approx(2e-4, rel=1e-3)
    assert c.attention_s == pytest.approx(3e-9, rel=1e-3)
    assert c.fixed_s == pytest.approx(0.02, rel=1e-2)
    preds = [est.predict(u, 1000) for u in range(1, 5000, 97)]
    assert all(p > 0 for p in preds) and preds == sorted(preds)
    assert est.mean_abs_relative_error() is not None


def test_estimator_with_noise_and_fallback():
    est = JctEstimator(fallback_s_per_token=1e-3)
    assert est.predict(500, 0) == pytest.approx(0.5)  # proxy before any fit
    rng = np.random.default_rng(1)
    for _ in range(200):
        u = int(rng.integers(50, 3000))
        est.observe(u, 0, 1e-3 * u * float(rng.normal(1, 0.05)))
    # with c = 0 the linear and attention terms are correlated: check predictions, not each coefficient
    for u in (100, 1000, 2900):
        assert est.predict(u, 0) == pytest.approx(1e-3 * u, rel=0.05)
    assert est.mean_abs_relative_error() < 0.3


# -- the engine's request loop ------------------------------------------------------------------
@pytest.fixture()
def engine(family_folders):
    e = Engine(EngineConfig(model=family_folders["llama_gqa_llama3rope_untied"], dtype="float32", threads=2,
                            cache_budget_bytes=1 << 20, cache_block_size=8, max_waiting=16))
    yield e
    e.close()


def hold_worker(engine):
    """Occupy the worker: its next step (a 3-token request) waits for the returned event."""
    release, started = threading.Event(), threading.Event()
    real_run = engine.runner.execute

    def held_run(step):
        engine.runner.execute = real_run  # only this step is held
        started.set()
        release.wait(10)
        return real_run(step)

    engine.runner.execute = held_run
    fut = engine.submit([1, 2, 3], [5])
    assert started.wait(10)
    return release, fut


def ids(seed, n=40):
    r = random.Random(seed)
    return [r.randrange(0, 300) for _ in range(n)]


def test_concurrent_submits_all_complete_once_and_match(engine):
    expected = {i: engine.score(ids(i), [5, 17]) for i in range(12)}
    results, errors = {}, []

    def client(k):
        try:
            futs = {i: engine.submit(ids(i), [5, 17]) for i in range(k, 12, 3)}
            for i, f in futs.items():
                results.setdefault(i, []).append(f.result(30))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(results) == list(range(12)) and all(len(v) == 1 for v in results.values())
    for i, (r,) in results.items():
        assert [t.logprob for t in r.tokens] == pytest.approx([t.logprob for t in expected[i].tokens], abs=1e-4)


def test_cancel_waiting_request(engine):
    release, held = hold_worker(engine)
    fut = engine.submit(ids(1), [5])
    assert fut.cancel()
    assert len(engine.scheduler) == 0 and engine.stats().counters.cancelled == 1
    release.set()
    assert held.result(10).prompt_tokens == 3
    with pytest.raises(CancelledError):
        fut.result()
    assert engine.score(ids(2), [5]).prompt_tokens == 40


def test_deadline_expires_while_waiting(engine):
    release, _ = hold_worker(engine)
    fut = engine.submit(ids(3), [5], deadline_s=0.05)
    time.sleep(0.1)
    release.set()
    with pytest.raises(DeadlineExceededError, match="deadline passed"):
        fut.result(10)
    assert engine.submit(ids(3), [5], deadline_s=30).result(10).prompt_tokens == 40


def test_overload_fails_fast(engine):
    release, _ = hold_worker(engine)
    futs = [engine.submit(ids(i), [5]) for i in range(16)]
    t0 = time.perf_counter()
    with pytest.raises(OverloadedError, match="max_waiting 16"):
        engine.submit(ids(99), [5])
    assert time.perf_counter() - t0 < 1.0
    release.set()
    assert all(f.result(30).prompt_tokens == 40 for f in futs)
    assert engine.stats().counters.rejected["overloaded"] == 1


def test_close_answers_every_pending_request(family_folders):
    e = Engine(EngineConfig(model=family_folders["llama_mha_tied"], dtype="float32", threads=2))
    release, held = hold_worker(e)
    futs = [e.submit(ids(i), [5]) for i in range(5)]
    threading.Timer(0.2, release.set).start()
    e.close()
    assert held.result(10).prompt_tokens == 3  # the running request finished
    for f in futs:
        with pytest.raises(EngineClosedError):
            f.result(1)
    with pytest.raises(EngineClosedError):
        e.submit(ids(0), [5])
    assert not e._worker.is_alive()


@pytest.mark.parametrize("kwargs,match", [(dict(priority="high"), "priority must be an integer"),
                                          (dict(deadline_s=0), "deadline_s must be a positive"),
                                          (dict(user=3), "user must be a string")])
def test_bad_scheduling_arguments(engine, kwargs, match):
    from prefillonly import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=match):
        engine.submit(ids(0), [5], **kwargs)


def test_answers_are_delivered_off_the_worker_and_a_slow_callback_does_not_delay_the_next_step(engine):
    """A Future's callbacks (the Triton model's: metrics round trips, sending the response) run on
    the completion thread: the worker starts the next step while a slow one is still running,
    and its idle gap before that step stays small."""
    release, held = hold_worker(engine)
    callback = {}

    def slow_callback(_future):
        callback["thread"] = threading.current_thread()
        callback["start"] = time.monotonic()
        time.sleep(1.5)
        callback["end"] = time.monotonic()

    held.add_done_callback(slow_callback)
    following = engine.submit(ids(5), [5])
    release.set()
    assert following.result(30).prompt_tokens == 40
    assert callback["thread"] is not engine._worker
    assert following.started_at < callback["end"]  # the next step did not wait for the callback
    last = engine.stats().recent_steps[-1]
    assert last.requests == 1 and last.idle_gap_s < 0.5, last
