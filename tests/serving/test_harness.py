"""perf/harness.py (the one client harness of the load runs) and perf/eval.py's trace files.

Fast: a fake in-process backend stands in for a server (this tests the harness, not a system);
no model, no server, no vLLM.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from perf import eval as perf_eval
from perf import harness
from perf import workloads as wl
from prefillonly.serving.host.prometheus import parse as parse_prometheus

SCALE = wl.PostRecScale(users=4, posts_per_user=3, profile_mean=40, post_mean=10, post_std=2, post_clip=(6, 14))


def small_trace(seed: int = 0) -> wl.Trace:
    return wl.generate("post_rec", SCALE, seed)


class FakeBackend:
    """Fails the requests in `fail`, sleeps `delay[id]` seconds before answering the others,
    and counts how often each request reached it."""

    def __init__(self, fail=(), delay=None, default_delay=0.0):
        self.fail, self.delay, self.default_delay = set(fail), dict(delay or {}), default_delay
        self.calls: dict[str, int] = {}
        self.sent_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def score(self, request, allowed, timeout_s=600.0):
        with self._lock:
            self.calls[request.request_id] = self.calls.get(request.request_id, 0) + 1
            self.sent_at[request.request_id] = time.perf_counter()
        time.sleep(self.delay.get(request.request_id, self.default_delay))
        if request.request_id in self.fail:
            raise RuntimeError(f"refused {request.request_id}")
        return {"prompt_tokens": len(request.prompt_token_ids), "cached_tokens": request.cache_prefix_len,
                "logprobs": {str(t): -1.0 for t in allowed}}


def quiet(_msg):
    pass


def test_every_request_counted_once_errors_apart_from_latencies():
    trace = harness.poisson_schedule(small_trace(), qps=40.0, seed=1)
    ids = [r.request_id for r in trace.requests]
    fail = {ids[1], ids[5], ids[6]}
    backend = FakeBackend(fail=fail, delay={ids[0]: 0.3, ids[5]: 0.6, ids[7]: 0.05}, default_delay=0.01)
    result = harness.run_open_loop(backend, trace, label="fake", qps=40.0, log=quiet)

    assert backend.calls == {i: 1 for i in ids}  # each request sent exactly once
    assert [o.request_id for o in result.outcomes] == ids  # one outcome each, in trace order
    s = harness.summarize(result)
    assert (s["requests"], s["ok"], s["errors"]) == (len(ids), len(ids) - 3, 3)
    assert s["error_kinds"] == {f"RuntimeError: refused {i}": 1 for i in fail}
    for o in result.outcomes:
        if o.request_id in fail:
            assert not o.ok and o.latency_s is None and o.error.startswith("RuntimeError")
        else:
            assert o.ok and o.error is None
            assert o.latency_s == pytest.approx(o.done_s - o.arrival_s)  # from the SCHEDULED arrival
    ok_latencies = [o.latency_s for o in result.outcomes if o.ok]
    assert s["mean_latency_s"] == pytest.approx(sum(ok_latencies) / len(ok_latencies))
    assert s["max_latency_s"] == max(ok_latencies)
    assert s["p99_latency_s"] <= s["max_latency_s"]
    # the failed slow request (0.6 s) is in no latency statistic: the slowest is the 0.3 s ok one
    slowest = max((o for o in result.outcomes if o.ok), key=lambda o: o.latency_s)
    assert slowest.request_id == ids[0] and s["max_latency_s"] == slowest.latency_s >= 0.3
    assert s["reported_cached_tokens"] == sum(r.cache_prefix_len for r in trace.requests if r.request_id not in fail)


def test_open_loop_a_slow_answer_does_not_delay_later_arrivals():
    trace = harness.poisson_schedule(small_trace(), qps=60.0, seed=2)
    first = wl.arrival_order(trace)[0].request_id
    backend = FakeBackend(delay={first: 1.0})
    result = harness.run_open_loop(backend, trace, log=quiet)
    last_arrival = max(r.arrival_s for r in trace.requests)
    assert last_arrival < 0.6  # every other request arrives while the first is still running
    for o in result.outcomes:
        assert o.sent_s - o.arrival_s < 0.4, o  # sent on schedule, not after the slow one
    assert harness.summarize(result)["max_send_lag_s"] < 0.4


def test_harness_refuses_a_trace_without_arrivals_or_with_duplicate_ids():
    with pytest.raises(ValueError, match="arrival"):
        harness.run_open_loop(FakeBackend(), small_trace(), log=quiet)
    trace = harness.poisson_schedule(small_trace(), qps=50.0, seed=0)
    trace.requests[1].request_id = trace.requests[0].request_id
    with pytest.raises(ValueError, match="unique"):
        harness.run_open_loop(FakeBackend(), trace, log=quiet)


def test_same_arrival_times_for_every_system():
    """The scaling from a QPS level to arrival times is one function, applied identically."""
    trace = small_trace()
    a = harness.poisson_schedule(trace, qps=30.0, seed=7)
    b = harness.poisson_schedule(wl.trace_from_dict(wl.trace_to_dict(trace)), qps=30.0, seed=7)  # another copy
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert perf_eval.arrivals_digest(a) == perf_eval.arrivals_digest(b)
    # two different backends replaying it record the same scheduled arrivals
    r1 = harness.run_open_loop(FakeBackend(default_delay=0.01), a, log=quiet)
    r2 = harness.run_open_loop(FakeBackend(fail={a.requests[0].request_id}), b, log=quiet)
    assert [o.arrival_s for o in r1.outcomes] == [o.arrival_s for o in r2.outcomes]


def test_qps_scaling_scales_user_starts_and_keeps_the_request_gap():
    trace = small_trace()
    slow, fast = (harness.poisson_schedule(trace, qps=q, seed=3) for q in (10.0, 20.0))

    def starts(t):
        return {r.user: r.arrival_s for r in t.requests if r.index_in_user == 0}

    assert starts(fast) == pytest.approx({u: s / 2 for u, s in starts(slow).items()})
    for t in (slow, fast):
        for r in t.requests:
            assert r.arrival_s == pytest.approx(starts(t)[r.user] + wl.REQUEST_GAP_S * r.index_in_user)
    # other seed, other times
    assert starts(harness.poisson_schedule(trace, qps=10.0, seed=4)) != starts(slow)


def test_workload_files_round_trip_with_identical_ids(tmp_path, monkeypatch):
    """eval.py's `workloads` step writes the files every system replays; reading one back gives
    exactly the generator's token ids and boundaries."""
    monkeypatch.setattr(wl, "DEFAULT_TRACE_DIR", tmp_path)
    args = perf_eval.build_parser().parse_args(["workloads", "--scale", "tiny", "--seed", "5"])
    paths = perf_eval.cmd_workloads(args)
    for workload in perf_eval.WORKLOADS:
        assert Path(paths[workload]).parent == tmp_path
        fresh = wl.generate(workload, "tiny", 5)
        loaded, path = perf_eval.ensure_trace(workload, args)
        assert str(path) == paths[workload]
        assert [r.prompt_token_ids for r in loaded.requests] == [r.prompt_token_ids for r in fresh.requests]
        assert [r.cache_prefix_len for r in loaded.requests] == [r.cache_prefix_len for r in fresh.requests]
        assert loaded.allowed_token_ids == fresh.allowed_token_ids


def test_percentile_and_prefix_hit_counters_from_metrics_text():
    assert harness.percentile([], 99) is None
    assert harness.percentile([3.0], 99) == 3.0
    assert harness.percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    ours = parse_prometheus(
        '# HELP prefillonly_prompt_tokens_total x\n# TYPE prefillonly_prompt_tokens_total counter\n'
        'prefillonly_prompt_tokens_total{source="computed"} 300\nprefillonly_prompt_tokens_total{source="cache"} 700\n'
        'nv_inference_count{model="prefillonly",version="1"} 12\n')
    vllm = parse_prometheus(
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0\n'
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n')
    before = {"prompt_tokens": 0.0, "cached_tokens": 0.0}
    assert harness.prefix_hits_from_samples("ours", ours) == {"prompt_tokens": 1000.0, "cached_tokens": 700.0, "idle_gap_s": 0,
                                                              "steps": 0, "steps_gap_under_5ms": 0}
    assert harness.hit_fraction(before, harness.prefix_hits_from_samples("ours", ours)) == pytest.approx(0.7)
    assert harness.hit_fraction(before, harness.prefix_hits_from_samples("vllm", vllm)) == pytest.approx(0.6)
    assert harness.hit_fraction({"error": "x"}, before) is None
    gaps = parse_prometheus(
        'prefillonly_step_idle_gap_seconds_bucket{le="0.005"} 9\nprefillonly_step_idle_gap_seconds_bucket{le="+Inf"} 10\n'
        'prefillonly_step_idle_gap_seconds_sum 0.03\nprefillonly_step_idle_gap_seconds_count 10\n')
    after = harness.prefix_hits_from_samples("ours", gaps)
    got = harness.idle_gaps(harness.prefix_hits_from_samples("ours", []), after)
    assert got == {"steps": 10, "mean_idle_gap_ms": pytest.approx(3.0), "steps_within_5ms": pytest.approx(0.9)}
    assert harness.idle_gaps(before, harness.prefix_hits_from_samples("vllm", vllm)) is None
