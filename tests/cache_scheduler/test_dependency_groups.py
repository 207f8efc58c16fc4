"""Dependency groups (scheduler/groups.py): a cold request whose kept blocks other waiting requests
share is ranked for the whole group by Smith's rule. No model: a real PrefixIndex and a fitted
estimator, a fake clock."""

from __future__ import annotations

import random

import pytest

from prefillonly.cache.index import PrefixIndex
from prefillonly.scheduler import IndexPrefixView, Scheduler, StepBudget, TokenSplit, WaitingRequest
from prefillonly.scheduler.groups import shared_blocks

from .test_scheduler import FakeClock, fitted_estimator

BLOCK = 16


def make(policy, slots=1 << 14, **kw):
    clock = FakeClock()
    index = PrefixIndex(slots, block_size=BLOCK)
    return Scheduler(policy, fitted_estimator(), IndexPrefixView(index), clock=clock, **kw), index, clock


def keys(name, n):
    """n chained-looking block keys of one prompt prefix (distinct per name)."""
    return [f"{name}-{i}".encode() for i in range(n)]


def request(profile: list[bytes], own: str, new_tokens: int, keep_profile=True, **kw):
    """A post over a profile: the profile's blocks, then the post's own (never shared) blocks."""
    tokens = len(profile) * BLOCK + new_tokens
    hashes = profile + keys(own, tokens // BLOCK - len(profile))
    return WaitingRequest(prompt_tokens=tokens, block_hashes=hashes, kept_blocks=len(profile) if keep_profile else 0, **kw)


def run_alone(sched, index, clock=None, step_s=None):
    """Pick one request (a step of one), 'run' it (commit its ticket; advance the clock by its
    estimate), return it with its real split."""
    plan = sched.schedule()  # the default budget: one request per step
    (m,) = plan.members
    index.commit(m.ticket)
    if clock is not None:
        clock.t += step_s(m.split) if step_s else sched.estimator.predict(*m.split)
    return m.request, m.split


def cache_profile(sched, index, profile):
    """Put a profile into the cache (a request over it ran)."""
    sched.add(request(profile, "warmup", 5))
    run_alone(sched, index)


def total_completion_time(est, splits):
    t = total = 0.0
    for s in splits:
        t += est.predict(*s)
        total += t
    return total


# -- Smith's rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("followers", range(1, 10))
def test_a_cold_leader_goes_first_exactly_when_that_lowers_total_completion_time(followers):
    """A new user's 2K-token profile with `followers` more posts waiting on it, against 9 warm
    requests of other users (400 new tokens each over a cached profile). Running the group first
    costs the warm ones the leader's time; running the warm ones first costs the whole group
    theirs. The scheduler's order must have the lower total completion time of the two (Smith's
    rule on the group as one job), and that must flip as the group grows."""
    sched, index, _ = make("csjf")
    warm_profile = keys("warm-user", 125)
    cache_profile(sched, index, warm_profile)
    new_profile = keys("new-user", 125)  # 2,000 tokens, not cached
    group = [request(new_profile, f"post{i}", 50) for i in range(1 + followers)]
    warm = [request(warm_profile, f"w{i}", 400) for i in range(9)]
    for r in group + warm:
        sched.add(r)
    ran = [run_alone(sched, index) for _ in range(len(group) + len(warm))]
    assert not len(sched)
    est = sched.estimator
    # the two orders, with the splits each request really has in it
    leader_cold = TokenSplit(2050, 0)
    follower_warm = TokenSplit(50, 2000)
    warm_split = TokenSplit(400, 2000)
    group_first = total_completion_time(est, [leader_cold] + [follower_warm] * followers + [warm_split] * 9)
    warm_first = total_completion_time(est, [warm_split] * 9 + [leader_cold] + [follower_warm] * followers)
    got = total_completion_time(est, [split for _, split in ran])
    assert got == pytest.approx(min(group_first, warm_first), rel=1e-9), (followers, group_first, warm_first)
    leader_went_first = ran[0][0] in group
    assert leader_went_first == (group_first < warm_first)
    # a group's requests are never split around independent work
    positions = [i for i, (r, _) in enumerate(ran) if r in group]
    assert positions == list(range(positions[0], positions[0] + len(group)))


def test_the_decision_flips_with_the_number_of_followers():
    """The parametrized case above covers both outcomes: many followers lead, few do not."""
    est = fitted_estimator()
    c, f, w = est.predict(2050, 0), est.predict(50, 2000), est.predict(400, 2000)
    firsts = [(c + n * f) / (1 + n) < w for n in range(1, 10)]
    assert firsts[-1] and not firsts[0]


def test_independent_csjf_keeps_the_cold_leader_behind_warm_requests():
    sched, index, _ = make("csjf-independent")
    warm_profile = keys("warm-user", 125)
    cache_profile(sched, index, warm_profile)
    new_profile = keys("new-user", 125)
    group = [request(new_profile, f"post{i}", 50) for i in range(10)]
    warm = [request(warm_profile, f"w{i}", 400) for i in range(9)]
    for r in group + warm:
        sched.add(r)
    first_nine = [run_alone(sched, index)[0] for _ in range(9)]
    assert all(r in warm for r in first_nine)


def test_followers_join_the_step_after_the_leaders_as_warm_requests():
    sched, index, _ = make("csjf")
    profile = keys("u", 40)
    group = [request(profile, f"p{i}", 30) for i in range(6)]
    for r in group:
        sched.add(r)
    sched.budget = StepBudget(4096)
    first = sched.schedule()
    assert len(first) == 1 and first.members[0].split == TokenSplit(40 * BLOCK + 30, 0)  # the leader alone
    for m in first.members:
        index.commit(m.ticket)
    second = sched.schedule()
    assert len(second) == 5 and all(m.split == TokenSplit(30, 40 * BLOCK) for m in second.members)


# -- no shared blocks: plain CSJF -------------------------------------------------------------------
def test_without_shared_blocks_the_order_is_independent_csjfs():
    rng = random.Random(5)
    for trial in range(100):
        a, ia, clock_a = make("csjf")
        b, ib, clock_b = make("csjf-independent")
        keep_nothing = trial % 3 == 0  # shared blocks that nobody keeps make no group either
        for i in range(rng.randint(2, 40)):
            if keep_nothing:
                profile = keys(f"t{trial}-u{rng.randrange(3)}", rng.randint(1, 20))
                kwargs = dict(keep_profile=False)
            else:
                profile, kwargs = keys(f"t{trial}-r{i}", rng.randint(0, 20)), {}
            new = rng.randint(1, 500)
            for s in (a, b):
                s.add(request(profile, f"t{trial}-own{i}", new, priority=rng.choice([0, 0, 1]) if s is a else 0, **kwargs))
            b._waiting[-1].priority = a._waiting[-1].priority
            clock_a.t = clock_b.t = clock_a.t + rng.random() * 0.5
        ids_a = [(r.prompt_tokens, r.block_hashes, r.seq) for r in a.order()]
        ids_b = [(r.prompt_tokens, r.block_hashes, r.seq) for r in b.order()]
        assert ids_a == ids_b


# -- starvation: the lambda bound ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["csjf", "csjf-independent"])
def test_no_request_waits_beyond_its_lambda_bound(policy):
    """A stream of short warm requests (one arrives per step) against a cold group: every
    request starts within (its cold estimate - the shortest estimate) / (lambda's credit per
    second) + one step of the time it arrived. With groups the leader is picked after about
    1/(1 + followers) of the wait it gets without them."""
    lam = 500
    sched, index, clock = make(policy, lambda_tokens_per_s=lam)
    est = sched.estimator
    credit_per_s = lam * est.seconds_per_token
    warm_profile = keys("warm", 60)
    cache_profile(sched, index, warm_profile)
    cold_profile = keys("cold", 250)
    group = [request(cold_profile, f"c{i}", 40) for i in range(4)]
    for r in group:
        sched.add(r)
    short = est.predict(20, 60 * BLOCK)
    longest_step = est.predict(250 * BLOCK + 40, 0)
    started = {}
    n = 0
    while any(r not in started for r in group) and clock.t < 120:
        sched.add(request(warm_profile, f"s{n}", 20))
        n += 1
        t = clock.t
        r, _ = run_alone(sched, index, clock)
        started.setdefault(r, t)
    for r in group:
        bound = (est.predict(r.prompt_tokens, 0) - short) / credit_per_s + 2 * longest_step
        assert r in started and started[r] - r.arrived <= bound, (policy, started.get(r), bound)
    leader_wait = min(started[r] for r in group)
    plain_wait = (est.predict(250 * BLOCK + 40, 0) - short) / credit_per_s
    if policy == "csjf":
        assert leader_wait <= plain_wait / 2, (leader_wait, plain_wait)
    else:
        assert leader_wait >= plain_wait / 2, (leader_wait, plain_wait)


# -- helpers -----------------------------------------------------------------------------------------
def test_shared_blocks_counts_the_common_chained_prefix():
    a = keys("x", 10)
    b = keys("x", 6) + keys("y", 4)
    assert shared_blocks(a, b, 0, 10) == 6
    assert shared_blocks(a, b, 2, 10) == 4
    assert shared_blocks(a, b, 0, 3) == 3  # only up to what the leader keeps
    assert shared_blocks(a, keys("z", 5), 0, 5) == 0
    assert shared_blocks(a, a, 9, 10) == 1


# -- the queued work a replica publishes to the fleet's picker -------------------------------------
def test_queued_work_counts_a_users_queued_posts_warm_behind_the_one_computing_its_profile():
    """A burst of one user's posts over an uncached profile is one cold profile plus warm posts, not
    a cold profile per post; a profile that the running step is computing (its blocks reserved, not
    yet committed) makes every waiting post over it warm; another user's profile stays cold."""
    sched, index, _ = make("csjf")
    est = sched.estimator
    profile, other = keys("hot", 60), keys("other", 40)
    posts = [request(profile, f"p{i}", 150) for i in range(6)]
    for p in posts:
        sched.add(p)
    stranger = request(other, "s", 150)
    sched.add(stranger)
    cold = est.predict(60 * BLOCK + 150, 0)
    warm = est.predict(150, 60 * BLOCK)  # each post's own blocks: 150 // 16 = 9 whole ones, none shared
    alone = est.predict(40 * BLOCK + 150, 0)
    assert sched.queued_work_s() == pytest.approx(cold + 5 * warm + alone)
    # counted against the cache as it is now, every post would be cold: what the picker used to see
    assert sum(sched.estimate(p) for p in posts) + sched.estimate(stranger) == pytest.approx(6 * cold + alone)
    # the first post runs (its blocks reserved, the step not finished): the rest are warm behind it
    plan = sched.schedule()
    assert plan.members[0].request is posts[0]
    assert sched.queued_work_s() == pytest.approx(5 * warm + alone)
    index.commit(plan.members[0].ticket)
    assert sched.queued_work_s() == pytest.approx(5 * warm + alone)


def test_queued_work_without_shared_blocks_is_the_sum_of_the_estimates():
    sched, _, _ = make("csjf")
    rng = random.Random(3)
    reqs = [request(keys(f"u{i}", rng.randrange(1, 40)), f"p{i}", rng.randrange(1, 300)) for i in range(30)]
    for r in reqs:
        sched.add(r)
    assert sched.queued_work_s() == pytest.approx(sum(sched.estimate(r) for r in reqs))
