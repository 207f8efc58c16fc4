"""perf/simulate.py: the discrete-event scheduler simulation. Fast; no model (the engine's
Scheduler and PrefixIndex with a cost model, batched steps through Scheduler.schedule and finish)."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest

from perf import simulate as sim
from perf import workloads as wl

SMALL_POST_REC = wl.PostRecScale(users=8, posts_per_user=10, profile_mean=2000)
SMALL_CREDIT = wl.CreditScale(requests=12, length_mean=6000)


def run(work, cost, load, policy, engines=1, cache_blocks=None, **kw):
    reqs = work.with_arrivals(load * sim.saturated_qps(work, cost, engines))
    return sim.simulate(reqs, cost, sim.SimConfig(policy=policy, engines=engines, cache_blocks=cache_blocks, **kw), work.block_size)


def numbers(res):
    s = res.summary()
    s.pop("sim_wall_s")
    return s, [(r.request_id, r.engine, r.start_s, r.done_s, r.cached) for r in res.records]


def steps_of(res):
    """{(engine, start, done): the step's records}: the records of one batched step share them."""
    steps = defaultdict(list)
    for r in res.records:
        steps[(r.engine, r.start_s, r.done_s)].append(r)
    return steps


# -- cost models ------------------------------------------------------------------------------
def test_gpu_cost_model_matches_design_md():
    gpu = sim.gpu_cost_model()  # Llama-3.1-8B at 50% of 989 TFLOP/s: ~30.7K tok/s at 8K, ~20.2K at 40K
    assert 8192 / gpu.seconds(8192, 0) == pytest.approx(30.7e3, rel=0.01)
    assert 40000 / gpu.seconds(40000, 0) == pytest.approx(20.2e3, rel=0.01)
    flops = 2 * 7.0e9 * 200 + 2 * 32 * 4096 * 200 * (2 * 14000 + 200)
    assert gpu.seconds(200, 14000) == pytest.approx(flops / (0.5 * 989e12))
    assert gpu.kv_bytes_per_token == 128 * 1024
    assert sim.default_step_tokens(gpu) == 8192 and sim.default_step_tokens(sim.cpu_cost_model()) == 2048


def test_a_step_pays_the_fixed_cost_once():
    cpu = sim.cpu_cost_model()
    splits = [(200, 2000), (150, 0), (1000, 64)]
    assert cpu.step_seconds(splits[:1]) == pytest.approx(cpu.seconds(200, 2000))
    assert cpu.step_seconds(splits) == pytest.approx(sum(cpu.seconds(u, c) for u, c in splits) - 2 * cpu.fixed_s)
    gpu = sim.gpu_cost_model()  # no fixed cost: a step costs exactly the sum of its members
    assert gpu.step_seconds(splits) == pytest.approx(sum(gpu.seconds(u, c) for u, c in splits))


def test_cpu_cost_model_defaults():
    cpu = sim.cpu_cost_model()
    assert 6.5 < cpu.seconds(8192, 0) < 7.5  # ~7 s for a cold 8K prompt (RESULTS.md: 1187 tok/s)
    assert cpu.seconds(200, 2000) < cpu.seconds(2200, 0) / 3  # a warm request is much cheaper
    free = sim.cpu_cost_model(context_factor=0)
    assert free.seconds(200, 2000) == free.seconds(200, 0)


# -- workloads ----------------------------------------------------------------------------------
def test_synthetic_keys_give_the_same_simulation_as_real_block_hashes():
    """Synthetic (user, i) / (request, i) keys must be equivalent to chained hashes of the ids."""
    scale = wl.PostRecScale(users=4, posts_per_user=6, profile_mean=700)
    trace = wl.generate_post_rec(scale, seed=2)
    real, synth = sim.trace_workload(trace, 64), sim.post_rec_workload(scale, seed=2, block_size=64)
    assert [(r.request_id, r.prompt_tokens, r.cache_prefix_len, len(r.block_keys)) for r in real.requests] == \
           [(r.request_id, r.prompt_tokens, r.cache_prefix_len, len(r.block_keys)) for r in synth.requests]
    cost = sim.gpu_cost_model()
    blocks = 20  # tight: evictions happen
    for policy in sim.POLICIES:
        a, b = (numbers(run(w, cost, 2.0, policy, cache_blocks=blocks)) for w in (real, synth))
        assert a == b


def test_arrivals_are_the_workload_generators():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=1)
    trace = wl.with_poisson_arrivals(wl.generate_post_rec(SMALL_POST_REC, seed=1), 0.7)
    qps = 0.7 * len(trace.requests) / trace.num_users
    assert [r.arrival_s for r in work.with_arrivals(qps)] == pytest.approx([r.arrival_s for r in trace.requests])


# -- the simulation --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sim.POLICIES)
def test_deterministic_for_a_seed(policy):
    work = sim.post_rec_workload(SMALL_POST_REC, seed=3)
    cost = sim.cpu_cost_model()
    a, b = (numbers(run(work, cost, 1.0, policy, cache_blocks=100, noise=0.1, seed=5)) for _ in range(2))
    assert a == b
    other = sim.post_rec_workload(SMALL_POST_REC, seed=4)
    assert numbers(run(other, cost, 1.0, policy, cache_blocks=100, noise=0.1, seed=5)) != a


@pytest.mark.parametrize("engines", [1, 3])
@pytest.mark.parametrize("policy", sim.POLICIES)
def test_every_request_completes_exactly_once(policy, engines):
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    res = run(work, sim.gpu_cost_model(), 3.0, policy, engines=engines, cache_blocks=60)
    assert not res.rejected
    assert Counter(r.request_id for r in res.records) == Counter(r.request_id for r in work.requests)
    for r in res.records:
        assert r.arrival_s <= r.start_s < r.done_s
        assert r.done_s == pytest.approx(r.start_s + r.service_s)
    steps = steps_of(res)
    assert len(steps) == res.summary()["picks"] < len(res.records)  # batched: fewer steps than requests
    for (e, _, _), members in steps.items():
        assert all(r.step_members == len(members) and r.step_tokens == sum(m.uncached for m in members) for r in members)
    for e in range(engines):  # one step at a time per engine
        mine = sorted((k for k in steps if k[0] == e), key=lambda k: k[1])
        assert all(x[2] <= y[1] + 1e-12 for x, y in zip(mine, mine[1:]))
    users = {}
    for r in res.records:  # user affinity: a user's requests all on one engine
        users.setdefault(r.request_id.split("/")[0], set()).add(r.engine)
    assert all(len(v) == 1 for v in users.values())
    if engines > 1:
        assert len({r.engine for r in res.records}) > 1


def test_overloaded_requests_are_refused_not_lost():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    res = run(work, sim.gpu_cost_model(), 4.0, "csjf", max_waiting=5)
    assert res.rejected
    assert sorted([r.request_id for r in res.records] + res.rejected) == sorted(r.request_id for r in work.requests)


@pytest.mark.parametrize("budget", [None, 1, 600])
def test_a_batched_step_holds_at_most_max_batch_tokens_unless_alone(budget):
    """StepBudget(tokens): a step's uncached tokens stay within the budget; only a step of one
    request may exceed it (a cold profile over the budget runs alone)."""
    work = sim.post_rec_workload(SMALL_POST_REC, seed=1)
    cost = sim.cpu_cost_model()
    res = run(work, cost, 2.0, "csjf", cache_blocks=150, max_batch_tokens=budget)
    limit = budget or sim.default_step_tokens(cost)
    steps = list(steps_of(res).values())
    assert all(sum(r.uncached for r in m) <= limit for m in steps if len(m) > 1)
    assert any(sum(r.uncached for r in m) > limit for m in steps if len(m) == 1)  # the profiles: over budget, alone
    if budget == 1:
        assert all(len(m) == 1 for m in steps)  # 1 = the unbatched engine: one request per step
    else:
        assert max(len(m) for m in steps) > 1
    assert Counter(r.request_id for r in res.records) == Counter(r.request_id for r in work.requests)


def test_batching_amortises_the_fixed_cost():
    """The CPU model's fixed cost is paid once per step: batched, the same trace takes less
    service time in all and finishes sooner."""
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    one, batched = (run(work, sim.cpu_cost_model(), 2.0, "fcfs", max_batch_tokens=b) for b in (1, None))
    busy = [sum(k[2] - k[1] for k in steps_of(res)) for res in (one, batched)]
    assert busy[1] < busy[0] - 10 * sim.cpu_cost_model().fixed_s
    assert batched.summary()["makespan_s"] < one.summary()["makespan_s"]
    assert one.summary()["mean_step_members"] == 1 < batched.summary()["mean_step_members"]


def test_low_load_latency_is_the_service_time():
    work = sim.credit_workload(SMALL_CREDIT, seed=0)
    for policy in sim.POLICIES:
        res = run(work, sim.cpu_cost_model(), 0.02, policy)
        s = res.summary()
        assert s["mean_latency_s"] == pytest.approx(s["mean_service_s"], rel=0.02)
        assert all(r.latency_s == pytest.approx(r.service_s) for r in res.records if r.start_s == r.arrival_s)


def test_fcfs_with_room_for_every_profile_costs_the_perfect_cache_total():
    """FCFS runs a user's requests in order, so with a large cache only first requests miss
    (one request per step: the perfect-cache total is a sum of one-request service times)."""
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    cost = sim.cpu_cost_model()
    res = run(work, cost, 2.0, "fcfs", max_batch_tokens=1)
    assert sum(r.service_s for r in res.records) == pytest.approx(sim.perfect_cache_service_s(work, cost))
    batched = run(work, cost, 2.0, "fcfs")  # batched: the same hits
    assert batched.summary()["hit_rate"] == pytest.approx(res.summary()["hit_rate"])
    assert res.summary()["hit_rate"] == pytest.approx(1 - sim.perfect_cache_tokens(work) / work.prompt_tokens)
    assert res.summary()["blocks_evicted"] == 0


def test_tight_cache_evicts_and_never_exceeds_capacity():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    res = run(work, sim.cpu_cost_model(), 2.0, "fcfs", cache_blocks=40)  # ~1.3 profiles of ~31 blocks
    s = res.summary()
    assert s["blocks_evicted"] > 0
    assert s["hit_rate"] < 1 - sim.perfect_cache_tokens(work) / work.prompt_tokens


@pytest.mark.parametrize("policy", ["csjf-independent", "csjf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_csjf_keeps_more_cache_hits_than_fcfs_near_saturation(seed, policy):
    """Zero-cost cache hits (cached tokens cost nothing) and a cache for ~3 of 8 profiles."""
    work = sim.post_rec_workload(SMALL_POST_REC, seed=seed)
    cost = sim.cpu_cost_model(context_factor=0)
    blocks = 3 * 2000 // 64
    fcfs, csjf = (run(work, cost, 1.0, p, cache_blocks=blocks).summary() for p in ("fcfs", policy))
    assert csjf["hit_rate"] >= fcfs["hit_rate"]
    assert csjf["mean_latency_s"] <= fcfs["mean_latency_s"]


@pytest.mark.parametrize("load", [0.5, 2.0])
def test_without_shared_blocks_groups_change_nothing(load):
    """Credit verification: every request has its own blocks, so there are no dependency groups
    and csjf is exactly csjf-independent (every record the same)."""
    work = sim.credit_workload(wl.CreditScale(requests=30, length_mean=6000), seed=0)
    for cost in (sim.cpu_cost_model(), sim.gpu_cost_model()):
        a, b = (numbers(run(work, cost, load, p, noise=0.1)) for p in ("csjf-independent", "csjf"))
        assert a == b
        assert a[0]["max_waiting"] > 1  # there was a queue to order


def _burst_of_new_users(seed: int) -> list[sim.SimRequest]:
    """Two heavy users (~12K-token profiles, 15 posts each) and four light ones (~6K-token
    profiles, one post each), every request submitted at t = 0 (a batch of candidate posts
    scored at once). Profiles are clipped to 0.7-1.3x their mean, so every light prompt is
    shorter than every heavy one, whatever the seed."""
    heavy = sim.post_rec_workload(wl.PostRecScale(users=2, posts_per_user=15, profile_mean=12_000), seed)
    light = sim.post_rec_workload(wl.PostRecScale(users=4, posts_per_user=1, profile_mean=6_000), seed + 100)
    reqs = [dataclasses.replace(r, arrival_s=0.0) for r in heavy.requests]
    reqs += [dataclasses.replace(r, request_id=f"light{r.user}", user=r.user + 2, arrival_s=0.0) for r in light.requests]
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("budget", [None, 1])
def test_dependency_groups_lower_the_mean_and_the_tail_of_a_burst_of_new_users(seed, budget):
    """Why groups win here (Smith's rule): everything is cold at t = 0 and every request arrived
    at the same time, so starvation credits are equal and only the estimates order the queue.
    CSJF ranks each cold request on its own: the four light profiles (~0.19 s each on the H200
    model) go first and the heavy users' 30 requests wait behind them, each heavy user's posts
    cold until its own ~0.42 s profile has run. CSJF+groups ranks a heavy profile for its group,
    (0.42 s + 14 warm posts x ~6 ms) / 15 ~ 0.03 s per request, below every light profile, so
    each heavy user's 15 requests finish first and only the four light ones wait: by the
    exchange argument the total (so the mean) latency falls, here by a third to a half. The tail: the
    total work is the same (same hits; the GPU model's step costs the sum of its members), so
    the last request finishes at the same time under both; under CSJF the last step is a heavy
    user's batch of warm posts (or, unbatched, warm posts ~7 ms apart), under CSJF+groups the
    last two requests are light profiles that never share a step (two never fit in 8192 tokens),
    so the second latest finishes ~0.19 s earlier and the P99 (between the two largest of 34)
    is lower. Against WARM competitors the rule cannot lower the mean (a group's average,
    (cold + n warm) / (n + 1), is always above one warm request's cost): there it only moves the
    group earlier by the shared starvation credit, which is the next test."""
    reqs = _burst_of_new_users(seed)
    cost = sim.gpu_cost_model()
    indep, groups = (sim.simulate(reqs, cost, sim.SimConfig(policy=p, max_batch_tokens=budget)).summary()
                     for p in ("csjf-independent", "csjf"))
    assert groups["hit_rate"] == pytest.approx(indep["hit_rate"])
    assert groups["makespan_s"] == pytest.approx(indep["makespan_s"])
    assert groups["mean_latency_s"] < 0.8 * indep["mean_latency_s"]
    assert groups["p99_latency_s"] < indep["p99_latency_s"] - 0.03


def test_dependency_groups_cut_the_tail_behind_warm_requests_at_paper_scale():
    """Post recommendation at paper scale (20 users x 50 posts, ~14K-token profiles), the H200
    model, room for every profile, 0.9x saturation: CSJF makes a new user's cold profile (and
    with it every post of that user) wait behind the warm backlog until its starvation credit
    covers ~0.5 s of cost, ~35 s at 500 tokens/s of credit; CSJF+groups shares the oldest
    member's credit over the group, so the profile runs after a fraction of that wait and the
    P99 falls (the table in perf/RESULTS.md: about half). The price is the mean: the warm
    requests the profile now overtakes each wait its ~0.5 s (Smith's rule prefers warm first
    here), so CSJF's mean stays lower at this load (FCFS's, which ignores the cache, is higher still)."""
    work = sim.post_rec_workload("paper")
    cost = sim.gpu_cost_model()
    reqs = work.with_arrivals(0.9 * sim.saturated_qps(work, cost))
    fcfs, indep, groups = (sim.simulate(reqs, cost, sim.SimConfig(policy=p)).summary() for p in ("fcfs", "csjf-independent", "csjf"))
    assert groups["hit_rate"] == pytest.approx(indep["hit_rate"]) == pytest.approx(fcfs["hit_rate"])
    assert groups["p99_latency_s"] < 0.7 * indep["p99_latency_s"]
    assert indep["mean_latency_s"] < groups["mean_latency_s"] < fcfs["mean_latency_s"]


def test_csjf_estimator_is_fitted_online():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    res = run(work, sim.gpu_cost_model(), 1.0, "csjf")
    # the true cost has the estimator's form, so the online fit recovers it (until then: the fallback proxy)
    cost, coef = sim.gpu_cost_model(), res.estimator_coefficients[0]
    assert coef is not None
    assert coef.per_token_s == pytest.approx(cost.per_token_s, rel=1e-3)
    assert coef.attention_s == pytest.approx(cost.attention_s, rel=1e-3)
    assert coef.fixed_s == pytest.approx(0, abs=1e-4)


@pytest.mark.parametrize("gap_s", [0.05, 0.06])
def test_a_cold_long_request_behind_a_saturating_stream_of_warm_ones_waits_about_its_starvation_bound(gap_s):
    """CSJF's guard is a credit of lambda (500) tokens per second waited, priced at the fitted cost
    of one token: a request whose estimate exceeds the warm ones' by D seconds runs after about
    D / (lambda x seconds per token) of waiting, then at once. With the CPU cost model a cold
    3,800-token request behind 4 users' warm 40-token posts (engine saturated) has D ~ 2.05 s and
    ~14 s of bound (issue 26 saw 20.6 s on a loaded 2-core host; the bound is not a wall-clock cap)."""
    cost = sim.cpu_cost_model()
    reqs = [sim.SimRequest(f"s{k}", k % 4, k // 4, 1024 + 40, 1024, [(k % 4, i) for i in range(16)] + [(f"r{k}", 16)],
                           arrival_s=k * gap_s) for k in range(500)]
    reqs.append(sim.SimRequest("long", 99, 0, 3800, 0, [("long", i) for i in range(3800 // 64)], arrival_s=5.0))
    res = sim.simulate(reqs, cost, sim.SimConfig(policy="csjf", engines=1), block_size=64)
    long = next(r for r in res.records if r.request_id == "long")
    waited = long.start_s - long.arrival_s
    bound = (cost.seconds(3800, 0) - cost.seconds(40, 1024)) / (500 * cost.per_token_s)
    longest_step = max(r.service_s for r in res.records if r.request_id != "long")
    assert 0.9 * bound <= waited <= bound + longest_step, (waited, bound)
    assert long.start_s < max(r.arrival_s for r in reqs) - 5  # started while the stream still ran


def test_pick_charge_delays_requests():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    free, charged = (run(work, sim.gpu_cost_model(), 2.0, "fcfs", pick_s_per_waiting=c).summary() for c in (0.0, 1e-3))
    assert charged["mean_pick_s"] > 0 and charged["mean_latency_s"] > free["mean_latency_s"]


def test_routing_is_stable_and_spreads_users():
    assert [sim.engine_of(u, 4) for u in range(20)] == [sim.engine_of(u, 4) for u in range(20)]
    assert len({sim.engine_of(u, 4) for u in range(20)}) == 4
    assert sim.engine_of(7, 1) == 0


@pytest.mark.parametrize("routing", ["maglev_bounded", "ring_hash_bounded"])
def test_hashed_routing_is_sticky_below_envoys_bound_and_spills_above_it(routing):
    import numpy as np

    r = sim.Router(routing, 8, np.random.default_rng(0), factor=1.5)
    idle = [0] * 8
    home = {u: r.route(u, idle) for u in range(200)}
    assert all(r.route(u, idle) == home[u] for u in range(200))  # same user, same engine
    assert len(set(home.values())) == 8  # and the users spread over every engine
    hot = home[0]
    loads = [1] * 8
    # Envoy: slots = ceil(ceil((11 active + 1) x 150 / 100) / 8) = ceil(18 / 8) = 3, and 4 > 3: overloaded
    loads[hot] = 4
    moved = r.route(0, loads)
    assert moved != hot and loads[moved] <= 3
    loads[hot] = 3  # slots ceil(ceil(11 x 1.5) / 8) = 3, and 3 is not above it
    assert r.route(0, loads) == hot


def test_the_simulators_fleet_moves_as_envoys_tables_do():
    users = [f"u{i}" for i in range(3000)]
    maglev, ring = (sim.routing_moves(r, 3, users) for r in ("maglev_bounded", "ring_hash_bounded"))
    # a failover must move the lost engine's users (about a third); Maglev moves almost no one else,
    # Envoy's ring hash (~1024/N points per engine, so every engine's points change) several percent
    for m in (maglev, ring):
        assert 0.2 < m["failover"]["forced"] < 0.5 and m["failover"]["to_new"] == 0
        assert m["scale-up"]["forced"] == 0 and 0.15 < m["scale-up"]["to_new"] < 0.35
    assert maglev["failover"]["between_kept"] < 0.005 and maglev["scale-up"]["between_kept"] < 0.005
    assert ring["failover"]["between_kept"] > 0.03 and ring["scale-up"]["between_kept"] > 0.03


def test_least_request_takes_the_less_loaded_of_two():
    import numpy as np

    r = sim.Router("least_request", 2, np.random.default_rng(0))
    assert {r.route(u, [5, 0]) for u in range(50)} == {1}
    with pytest.raises(ValueError, match="routing"):
        sim.Router("sticky", 2, np.random.default_rng(0))


@pytest.mark.heavy
def test_fleet_routing_affinity_keeps_the_hits_random_loses_them():
    out = sim.run_fleet(engines=8, users=200, posts_per_user=4, cache_gib=4, load=0.8, block_size=256, profile_mean=4000)
    by = {r["routing"]: r for r in out["runs"]}
    assert set(by) == set(sim.FLEET_ROUTINGS)
    for r in by.values():
        assert r["completed"] == out["requests"] and r["rejected"] == 0
    for hashed in ("maglev_bounded", "ring_hash_bounded"):
        assert by[hashed]["hit_rate"] > 2 * by["random"]["hit_rate"]
        assert by[hashed]["hit_rate"] > 2 * by["least_request"]["hit_rate"]
        assert by[hashed]["users_split"] < by["random"]["users_split"]
    # the picker (completion time on each engine, its cache as the picker sent it) keeps users
    # together at least as well as the hash and does not queue them behind a busy engine
    assert by["picker"]["hit_rate"] >= by["maglev_bounded"]["hit_rate"]
    assert by["picker"]["users_split"] <= by["maglev_bounded"]["users_split"]
    assert by["picker"]["p99_latency_s"] <= by["maglev_bounded"]["p99_latency_s"]
    assert {(m["routing"], m["engines"]) for m in out["moves"]} == {(r, n) for r in sim.HASHED for n in (3, 8)}
    assert all(r["load_imbalance"] >= 1.0 for r in by.values())
    out.update(command="python perf/simulate.py --fleet", date="2026-12-01",
               machine=dict(cpu="cpu", cores=2, memory_gib=1, torch="2", threads=1, python="3"))
    assert "| maglev_bounded |" in sim.render_fleet(out) and "| maglev_bounded | 8 | scale-up |" in sim.render_fleet(out)


def test_saturated_qps_scales_with_engines():
    work = sim.post_rec_workload(SMALL_POST_REC, seed=0)
    cost = sim.gpu_cost_model()
    assert sim.saturated_qps(work, cost, 4) == pytest.approx(4 * sim.saturated_qps(work, cost, 1))
    assert sim.saturated_qps(work, cost) == pytest.approx(len(work.requests) / sim.perfect_cache_service_s(work, cost))


def test_render_and_plot_smoke(tmp_path):
    sc = sim.Scenario("tiny", "post_rec", "tiny", "cpu", 1, 0.01)
    data = sim.run_scenario(sc, [0.5, 0.9], list(sim.POLICIES), 0, 64, 0.5, 0.0)
    assert len(data["runs"]) == 8 and data["requests"] == 4  # the tiny preset: 2 users x 2 posts
    doc = {"command": "x", "date": "d", "machine": {"cpu": "c", "cores": 1, "memory_gib": 1, "torch": "t", "threads": 1, "python": "p"},
           "seed": 0, "noise": 0.0, "cost_models": {"cpu": sim.cpu_cost_model().describe()}, "scenarios": [data],
           "pick_cost": [{"policy": "csjf", "waiting": 10, "profiles_cached": True, "median_ms": 1.0, "per_request_us": 100.0}]}
    text = sim.render(doc)
    assert "At 0.9× saturation" in text and "| CSJF mean |" in text and "CSJF+groups mean" in text and "SJF P99" in text
    assert sim.plot(doc, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000


def test_scenario_filter_and_merge():
    every = sim.default_scenarios(False)
    assert [sc.key for sc in sim.select_scenarios(every, "dependency")] == ["dependency-paper"]
    assert len(sim.select_scenarios(every, "CREDIT")) == 2 and sim.select_scenarios(every, None) == every
    assert len({sc.id for sc in every}) == len(every)
    dep = next(sc for sc in every if sc.key == "dependency-paper")
    assert dep.cache_gib is None and dep.policies == ("fcfs", "csjf-independent", "csjf") and max(dep.loads) == 2.0
    assert wl.POST_REC_SCALES[dep.scale] == wl.PostRecScale(users=20, posts_per_user=50, profile_mean=14000)

    def entry(sc, tag):
        return {"scenario": dataclasses.asdict(sc), "command": tag, "date": tag, "runs": []}

    old = {"format": sim.RESULTS_FORMAT, "command": "full", "date": "d0", "pick_cost": ["old"],
           "scenarios": [entry(sc, "full") for sc in every]}
    new = {"format": sim.RESULTS_FORMAT, "command": "part", "date": "d1", "pick_cost": [],
           "scenarios": [entry(every[3], "part")]}
    merged = sim.merge_results(old, new, every)
    assert [s["scenario"]["key"] for s in merged["scenarios"]] == [sc.key for sc in every]
    assert [s["command"] for s in merged["scenarios"]] == ["full"] * 3 + ["part"] + ["full"] * (len(every) - 4)
    assert merged["command"] == "full" and merged["pick_cost"] == ["old"] and merged["updates"][-1]["command"] == "part"
    assert sim.merge_results({"format": 1, "scenarios": old["scenarios"]}, new, every) is new  # another simulator's results


def test_sim_engine_caches_exactly_as_the_engines_prefix_cache():
    """SimEngine and PrefixCache run the same PrefixIndex.begin/commit: the same requests in the
    same order get the same cached tokens and leave the same statistics, evictions and overflow
    included (a tight cache, users interleaved)."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import torch

    from prefillonly.cache.prefix_cache import PrefixCache

    work = sim.post_rec_workload(SMALL_POST_REC, seed=3)
    reqs = list(work.requests)
    random.Random(0).shuffle(reqs)
    blocks = 30  # under one profile's blocks for some users: evictions and overflow happen
    spec = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1, hidden_size=1)
    block_bytes = PrefixCache.bytes_per_block(spec, torch.float32, work.block_size)
    cache = PrefixCache(spec, torch.float32, torch.device("cpu"), work.block_size, blocks * block_bytes)
    clock = sim._Clock()
    engine = sim.SimEngine(0, "fcfs", sim.gpu_cost_model(), work.block_size, blocks, clock, 500.0, 1e-4, len(reqs) + 1,
                           np.random.default_rng(0), 0.0)
    simulated, real = [], []
    for r in reqs:
        engine.add(r)
        clock.now = engine.start_next()
        [record] = engine.finish()
        simulated.append(record.cached)
        ticket, moves = cache.index.begin(r.block_keys, r.prompt_tokens, r.kept_blocks(work.block_size))  # the engine's path
        cache.execute(moves)
        real.append(cache.access(ticket).cached_tokens)
        cache.index.commit(ticket)
    assert simulated == real and sum(real) > 0
    assert vars(engine.index.stats) == vars(cache.stats)
    assert cache.stats.blocks_evicted > 0 and cache.stats.overflow_blocks > 0 and cache.stats.hit_tokens == sum(real)
    assert set(engine.index.blocks) == set(cache.index.blocks)
