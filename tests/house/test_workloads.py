"""perf/workloads.py: seeded traces (docs/design.md §8). Fast; no model, no torch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perf import workloads as wl


def clipped_normal_std(std: float, a: float) -> float:
    """Std of N(m, std) clipped at m ± a·std: (2Φ(a)−1) − 2aφ(a) + 2a²(1−Φ(a)), times std²."""
    phi = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + math.erf(a / math.sqrt(2)))
    return std * math.sqrt((2 * cdf - 1) - 2 * a * phi + 2 * a * a * (1 - cdf))


def check_clipped_normal(x: np.ndarray, mean: float, std: float, lo: int, hi: int) -> None:
    assert x.min() == lo and x.max() == hi  # clipped, not resampled: the bounds are reached
    a = (hi - mean) / std  # symmetric bounds in every workload
    assert abs(x.mean() - mean) < 4 * std / math.sqrt(len(x))
    assert x.std() == pytest.approx(clipped_normal_std(std, a), rel=0.02)


# -- determinism ------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", ["post_rec", "credit"])
def test_same_seed_same_ids_other_seed_other_ids(workload):
    a, b, c = (wl.generate(workload, "tiny", seed) for seed in (7, 7, 8))
    assert a == b
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]


def test_lengths_match_the_full_generators():
    profiles, posts = wl.post_rec_lengths("cpu", seed=3)
    trace = wl.generate_post_rec("cpu", seed=3)
    suffix = len(wl.POST_REC_SUFFIX_IDS)
    for r in trace.requests:
        assert r.cache_prefix_len == profiles[r.user]
        assert len(r.prompt_token_ids) == profiles[r.user] + posts[r.user][r.index_in_user] + suffix
    credit = wl.generate_credit("cpu", seed=3)
    assert [len(r.prompt_token_ids) - len(wl.CREDIT_SUFFIX_IDS) for r in credit.requests] == wl.credit_lengths("cpu", 3).tolist()


# -- distributions (lengths only: no ids materialised) ----------------------------------------
def test_post_rec_length_distributions_paper_mu():
    scale = wl.PostRecScale(users=40_000, posts_per_user=2, profile_mean=14_000)
    profiles, posts = wl.post_rec_lengths(scale, seed=0)
    check_clipped_normal(profiles, 14_000, 2_800, 9_800, 18_200)  # N(μ, 0.2μ) in [0.7μ, 1.3μ]
    check_clipped_normal(np.concatenate(posts), 150, 30, 100, 200)


def test_credit_length_distribution_paper_mu():
    lengths = wl.credit_lengths(wl.CreditScale(requests=40_000, length_mean=50_000), seed=0)
    check_clipped_normal(lengths, 50_000, 50_000 / 6, 25_000, 75_000)  # N(μ, μ/6) in [μ/2, 3μ/2]


def test_presets_have_the_design_sizes():
    for name, (users, posts, mu) in {"cpu": (8, 10, 2000), "paper": (20, 50, 14000)}.items():
        s = wl.POST_REC_SCALES[name]
        assert (s.users, s.posts_per_user, s.profile_mean) == (users, posts, mu)
        profiles, post_lens = wl.post_rec_lengths(name, seed=0)
        assert profiles.shape == (users,) and [len(p) for p in post_lens] == [posts] * users
    for name, (r, mu) in {"cpu": (4, 6000), "paper": (60, 50000)}.items():
        s = wl.CREDIT_SCALES[name]
        assert (s.requests, s.length_mean) == (r, mu)
        assert len(wl.credit_lengths(name, seed=0)) == r


# -- content --------------------------------------------------------------------------------------
def test_post_rec_users_share_the_exact_profile_prefix():
    trace = wl.generate_post_rec("cpu", seed=1)
    assert len(trace.requests) == 80 and trace.num_users == 8
    by_user: dict[int, list] = {}
    for r in trace.requests:
        by_user.setdefault(r.user, []).append(r)
    first_profiles = []
    for user, requests in by_user.items():
        n = requests[0].cache_prefix_len
        profile = requests[0].prompt_token_ids[:n]
        assert [r.index_in_user for r in requests] == list(range(10))
        for r in requests:
            assert r.cache_prefix_len == n
            assert r.prompt_token_ids[:n] == profile
            assert r.prompt_token_ids[-len(trace.suffix_ids):] == wl.POST_REC_SUFFIX_IDS
        # the posts differ, so the shared prefix ends exactly at the profile
        assert len({r.prompt_token_ids[n] for r in requests}) > 1
        first_profiles.append(profile[:32])
    assert len({tuple(p) for p in first_profiles}) == 8  # users do not share profiles


def test_ids_in_range_and_allowed_tokens():
    for trace in (wl.generate_post_rec("tiny"), wl.generate_credit("tiny")):
        assert trace.allowed_token_ids == [9230, 2838]
        body = [t for r in trace.requests for t in r.prompt_token_ids[: -len(trace.suffix_ids)]]
        assert min(body) >= 100 and max(body) < 49152


def test_credit_has_no_shared_prefix():
    trace = wl.generate_credit("cpu", seed=0)
    assert len(trace.requests) == 4 and trace.num_users == 4
    assert all(r.cache_prefix_len == 0 for r in trace.requests)
    heads = {tuple(r.prompt_token_ids[:8]) for r in trace.requests}
    assert len(heads) == 4


def test_custom_suffix_and_vocab():
    trace = wl.generate_post_rec("tiny", seed=0, suffix_ids=[5, 6], vocab_size=300, low_id=10)
    for r in trace.requests:
        assert r.prompt_token_ids[-2:] == [5, 6]
        assert all(10 <= t < 300 for t in r.prompt_token_ids[:-2])


def test_unknown_scale_is_refused():
    with pytest.raises(ValueError, match="unknown scale"):
        wl.generate_post_rec("huge")


# -- arrivals ---------------------------------------------------------------------------------------
def test_poisson_arrivals():
    trace = wl.with_poisson_arrivals(wl.generate_post_rec("cpu", seed=0), user_rate=0.5)
    assert trace == wl.with_poisson_arrivals(wl.generate_post_rec("cpu", seed=0), user_rate=0.5)
    starts = {}
    for r in trace.requests:
        start = starts.setdefault(r.user, r.arrival_s - wl.REQUEST_GAP_S * r.index_in_user)
        assert r.arrival_s == pytest.approx(start + 0.1 * r.index_in_user)
    assert starts[0] == 0.0
    assert sorted(starts.values()) == [starts[u] for u in sorted(starts)]  # users arrive in order
    order = wl.arrival_order(trace)
    assert [r.arrival_s for r in order] == sorted(r.arrival_s for r in trace.requests)


def test_poisson_user_gaps_have_the_rate():
    trace = wl.generate_credit(wl.CreditScale(requests=20_000, length_mean=10), seed=0)
    stamped = wl.with_poisson_arrivals(trace, user_rate=4.0)
    gaps = np.diff([r.arrival_s for r in stamped.requests])
    assert gaps.min() > 0
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean


def test_user_rate_for_qps():
    trace = wl.generate_post_rec("cpu")
    assert wl.user_rate_for_qps(trace, 2.0) == pytest.approx(0.2)  # 10 requests per user


# -- JSON --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: wl.generate_post_rec("cpu", seed=2), lambda: wl.with_poisson_arrivals(wl.generate_credit("tiny"), 1.5)])
def test_json_round_trip_is_exact(tmp_path, make):
    trace = make()
    path = wl.save_trace(trace, tmp_path / "sub" / "trace.json")
    loaded = wl.load_trace(path)
    assert loaded == trace
    assert all(type(t) is int for r in loaded.requests for t in r.prompt_token_ids[:50])


def test_load_refuses_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"requests": []}')
    with pytest.raises(ValueError, match="not a prefillonly-trace"):
        wl.load_trace(path)


# -- skewed users and bursts (the fleet benchmark's and the fleet simulation's workload) ----------
@pytest.mark.parametrize("zipf", [0.8, 1.0, 1.2])
def test_zipf_post_counts_follow_the_ranks(zipf):
    scale = wl.PostRecScale(users=500, posts_per_user=6, profile_mean=300, posts_zipf=zipf)
    counts = wl.post_counts(scale, seed=2)
    assert len(counts) == 500 and min(counts) >= 1
    assert sum(counts) == pytest.approx(500 * 6, rel=0.1)  # the mean is kept (rounding, the floor of one)
    by_rank = sorted(counts, reverse=True)
    harmonic = sum(k ** -zipf for k in range(1, 501))
    for rank in (1, 2, 10):  # the hot users hold their Zipf share
        assert by_rank[rank - 1] == max(1, round(3000 * rank ** -zipf / harmonic))
    assert counts != sorted(counts, reverse=True)  # ranks are spread over user ids, not in arrival order
    assert wl.post_counts(scale, seed=2) == counts and wl.post_counts(scale, seed=3) != counts


def test_zipf_trace_has_the_counts_and_unskewed_is_unchanged():
    scale = wl.PostRecScale(users=12, posts_per_user=4, profile_mean=200, posts_zipf=1.0)
    trace = wl.generate_post_rec(scale, seed=1)
    per_user = [sum(1 for r in trace.requests if r.user == u) for u in range(12)]
    assert per_user == wl.post_counts(scale, seed=1)
    profiles, posts = wl.post_rec_lengths(scale, seed=1)
    for r in trace.requests:
        assert len(r.prompt_token_ids) == profiles[r.user] + posts[r.user][r.index_in_user] + len(wl.POST_REC_SUFFIX_IDS)
    plain = wl.PostRecScale(users=12, posts_per_user=4, profile_mean=200)
    assert wl.post_counts(plain) == [4] * 12
    # posts_zipf = 0 draws exactly what users x posts_per_user always drew
    _, flat = wl.post_rec_lengths(plain, seed=1)
    rng = wl._rng(1, "post_rec", wl._STREAM_LENGTHS)
    wl.clipped_normal_ints(rng, 12, 200, 40, *plain.profile_bounds())
    assert np.concatenate(flat).tolist() == wl.clipped_normal_ints(rng, 48, 150, 30, 100, 200).tolist()


def test_bursts_keep_the_rate_and_start_users_together():
    trace = wl.generate_credit(wl.CreditScale(requests=20_000, length_mean=10), seed=0)
    plain = wl.with_poisson_arrivals(trace, user_rate=4.0)
    bursty = wl.with_poisson_arrivals(trace, user_rate=4.0, burst_mean=5.0)
    assert bursty.arrival_burst_mean == 5.0 and plain.arrival_burst_mean == 1.0
    starts = np.array([r.arrival_s for r in bursty.requests])
    assert starts[0] == 0.0 and np.all(np.diff(starts) >= 0)  # users still arrive in order
    groups = np.split(starts, np.flatnonzero(np.diff(starts) > 0) + 1)
    sizes = np.array([len(g) for g in groups])
    assert sizes.mean() == pytest.approx(5.0, rel=0.05)  # geometric sizes, mean 5
    assert starts[-1] / len(starts) == pytest.approx(0.25, rel=0.05)  # the same users/s as without bursts
    assert starts[-1] / len(starts) == pytest.approx(plain.requests[-1].arrival_s / len(starts), rel=0.05)
    with pytest.raises(ValueError, match="burst_mean"):
        wl.with_poisson_arrivals(trace, user_rate=4.0, burst_mean=0.5)
