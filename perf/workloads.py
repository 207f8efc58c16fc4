"""Seeded trace generators (docs/design.md §8), saved as JSON so every system replays identical ids.

Traces are tokenizer-free: profiles, posts and credit histories are random token ids in
[low_id, vocab_size) (SmolLM2: [100, 49152), clear of the special tokens), followed by a fixed
question suffix whose ids are a parameter (defaults: SmolLM2's encoding of the questions below).

* post recommendation: U users x K posts. Profile length ~N(mu, 0.2 mu) clipped to
  [0.7 mu, 1.3 mu], post length ~N(150, 30) clipped to [100, 200]; a request is
  profile + post + suffix, and all of a user's requests share the exact profile, whose length is
  the request's `cache_prefix_len` (the explicit cache boundary).
* credit verification: R requests, each a history of ~N(mu, mu/6) tokens clipped to
  [mu/2, 3 mu/2] + suffix; nothing shared (`cache_prefix_len` = 0), one request per user.

The distributions are those of the random parts; the suffix (10-11 tokens) comes on top.
Lengths come from their own random stream, so `post_rec_lengths` / `credit_lengths` give the same
lengths as the full generators without materialising any ids (the tests sample paper scale).

Arrivals (latency runs): users arrive as a Poisson process of `user_rate` users/s, the first at
t = 0; a user's requests follow each other REQUEST_GAP_S = 0.1 s apart. Offline traces carry no
arrival times (all requests are submitted at once, in trace order: user-major).

CLI, from the repository root:

    .venv/bin/python -m perf.workloads post-rec --scale cpu          # -> perf/out/traces/post_rec_cpu_s0.json
    .venv/bin/python -m perf.workloads credit --scale paper --seed 3 --out credit.json
    .venv/bin/python -m perf.workloads post-rec --scale tiny --user-rate 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_FORMAT = "prefillonly-trace/1"
PERF_DIR = Path(__file__).resolve().parent
DEFAULT_TRACE_DIR = PERF_DIR / "out" / "traces"

# SmolLM2 (the default model): vocabulary, lowest id drawn, the two answers scored.
SMOLLM2_VOCAB_SIZE = 49152
LOW_TOKEN_ID = 100
YES_ID, NO_ID = 9230, 2838  # " Yes", " No" (leading space: what follows "Answer:")
ALLOWED_TOKEN_IDS = [YES_ID, NO_ID]
# SmolLM2 ids of "\nWould the user engage with this post? Answer:"
POST_REC_SUFFIX_IDS = [198, 26001, 260, 2914, 4555, 351, 451, 1681, 47, 19842, 42]
# SmolLM2 ids of "\nShould this credit application be approved? Answer:"
CREDIT_SUFFIX_IDS = [198, 20646, 451, 5186, 3279, 325, 8159, 47, 19842, 42]

REQUEST_GAP_S = 0.1  # between consecutive requests of one user

# Random streams: one per (workload, purpose), so lengths can be drawn without the ids.
_WORKLOAD_KEYS = {"post_rec": 1, "credit": 2}
_STREAM_LENGTHS, _STREAM_IDS, _STREAM_ARRIVALS, _STREAM_POPULARITY = 0, 1, 2, 3


# -- scales ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PostRecScale:
    users: int
    posts_per_user: int
    profile_mean: float
    profile_rel_std: float = 0.2
    profile_clip: tuple[float, float] = (0.7, 1.3)  # x profile_mean
    post_mean: float = 150
    post_std: float = 30
    post_clip: tuple[int, int] = (100, 200)
    # 0: every user sends posts_per_user posts. s > 0: skewed users, the user of popularity rank r
    # sends a share proportional to r^-s of users x posts_per_user posts (at least one): post_counts
    posts_zipf: float = 0.0

    def profile_bounds(self) -> tuple[int, int]:
        lo, hi = self.profile_clip
        return round(lo * self.profile_mean), round(hi * self.profile_mean)


@dataclass(frozen=True)
class CreditScale:
    requests: int
    length_mean: float
    length_rel_std: float = 1 / 6
    length_clip: tuple[float, float] = (0.5, 1.5)  # x length_mean

    def length_bounds(self) -> tuple[int, int]:
        lo, hi = self.length_clip
        return round(lo * self.length_mean), round(hi * self.length_mean)


POST_REC_SCALES = {
    "tiny": PostRecScale(users=2, posts_per_user=2, profile_mean=300),  # smoke tests
    "cpu": PostRecScale(users=8, posts_per_user=10, profile_mean=2000),  # ~173K prompt tokens expected, 164-187K over seeds 0-5
    "paper": PostRecScale(users=20, posts_per_user=50, profile_mean=14000),
}
CREDIT_SCALES = {
    "tiny": CreditScale(requests=2, length_mean=600),
    "cpu": CreditScale(requests=4, length_mean=6000),
    "paper": CreditScale(requests=60, length_mean=50000),
}


def resolve_scale(scale, presets: dict):
    """A preset name ("tiny" | "cpu" | "paper") or a scale object, as the same generator takes both."""
    if isinstance(scale, str):
        if scale not in presets:
            raise ValueError(f"unknown scale {scale!r}; presets: {', '.join(presets)}")
        return presets[scale]
    return scale


# -- trace data ----------------------------------------------------------------------------------
@dataclass
class TraceRequest:
    request_id: str  # "u3/p7" (post rec), "c2" (credit)
    user: int
    index_in_user: int  # position among the user's requests (arrival order within the user)
    prompt_token_ids: list[int]
    cache_prefix_len: int  # leading tokens worth keeping for later requests; 0 = none shared
    arrival_s: float | None = None  # None in offline traces


@dataclass
class Trace:
    workload: str  # "post_rec" | "credit"
    scale: dict  # the scale's fields
    seed: int
    vocab_size: int
    low_id: int
    suffix_ids: list[int]
    allowed_token_ids: list[int]
    requests: list[TraceRequest]
    user_rate: float | None = None  # users/s of the stamped arrivals; None = offline
    arrival_seed: int | None = None
    format: str = field(default=TRACE_FORMAT)
    arrival_burst_mean: float = 1.0  # users per burst of the stamped arrivals (1: plain Poisson)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_users(self) -> int:
        return len({r.user for r in self.requests})

    def summary(self) -> str:
        lengths = [len(r.prompt_token_ids) for r in self.requests]
        shared = sum(r.cache_prefix_len for r in self.requests if r.index_in_user > 0)
        text = (
            f"{self.workload} seed {self.seed}: {len(self.requests)} requests from {self.num_users} users, "
            f"{self.prompt_tokens:,} prompt tokens (min {min(lengths):,} / mean {np.mean(lengths):,.0f} / max {max(lengths):,}), "
            f"{shared:,} of them in prefixes seen before"
        )
        if self.user_rate is not None:
            last = max(r.arrival_s for r in self.requests)
            text += f"; arrivals at {self.user_rate:g} users/s over {last:.1f} s"
        return text


# -- random streams -------------------------------------------------------------------------
def _rng(seed: int, workload: str, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, _WORKLOAD_KEYS[workload], stream]))


def clipped_normal_ints(rng: np.random.Generator, n: int, mean: float, std: float, lo: int, hi: int) -> np.ndarray:
    """n draws of N(mean, std), rounded to whole tokens and clipped (not resampled) to [lo, hi]."""
    return np.clip(np.rint(rng.normal(mean, std, size=n)), lo, hi).astype(np.int64)


def random_ids(rng: np.random.Generator, n: int, low_id: int, vocab_size: int) -> list[int]:
    return rng.integers(low_id, vocab_size, size=int(n), dtype=np.int64).tolist()


# -- post recommendation --------------------------------------------------------------------
def post_counts(scale="cpu", seed: int = 0) -> list[int]:
    """Posts per user: posts_per_user each, or (posts_zipf = s > 0) Zipf-skewed: popularity rank r
    gets round(users x posts_per_user x r^-s / sum of k^-s), at least one; which user holds which
    rank is a permutation from its own stream, so hot users are not all first to arrive."""
    s = resolve_scale(scale, POST_REC_SCALES)
    if not s.posts_zipf:
        return [s.posts_per_user] * s.users
    share = np.arange(1, s.users + 1, dtype=np.float64) ** -s.posts_zipf
    by_rank = np.maximum(1, np.round(s.users * s.posts_per_user * share / share.sum())).astype(int)
    counts = np.empty(s.users, dtype=int)
    counts[_rng(seed, "post_rec", _STREAM_POPULARITY).permutation(s.users)] = by_rank
    return counts.tolist()


def post_rec_lengths(scale="cpu", seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """(profile lengths [U], each user's post lengths [its post count]) exactly as
    generate_post_rec draws them (unskewed: the same draws as users x posts_per_user)."""
    s = resolve_scale(scale, POST_REC_SCALES)
    rng = _rng(seed, "post_rec", _STREAM_LENGTHS)
    profiles = clipped_normal_ints(rng, s.users, s.profile_mean, s.profile_rel_std * s.profile_mean, *s.profile_bounds())
    counts = post_counts(s, seed)
    posts = clipped_normal_ints(rng, sum(counts), s.post_mean, s.post_std, *s.post_clip)
    return profiles, np.split(posts, np.cumsum(counts)[:-1])


def generate_post_rec(scale="cpu", seed: int = 0, **ids) -> Trace:
    """`ids`: how the ids are drawn (suffix_ids, vocab_size, low_id, allowed_token_ids; see _trace)."""
    s = resolve_scale(scale, POST_REC_SCALES)
    profile_lens, post_lens = post_rec_lengths(s, seed)

    def requests(draw, suffix: list[int]) -> list[TraceRequest]:
        out = []
        for user in range(s.users):
            profile = draw(profile_lens[user])
            for k, post_len in enumerate(post_lens[user]):
                post = draw(post_len)
                out.append(TraceRequest(f"u{user}/p{k}", user, k, profile + post + suffix, cache_prefix_len=len(profile)))
        return out

    return _trace("post_rec", s, seed, POST_REC_SUFFIX_IDS, requests, **ids)


# -- credit verification --------------------------------------------------------------------
def credit_lengths(scale="cpu", seed: int = 0) -> np.ndarray:
    """History lengths [R] exactly as generate_credit draws them."""
    s = resolve_scale(scale, CREDIT_SCALES)
    rng = _rng(seed, "credit", _STREAM_LENGTHS)
    return clipped_normal_ints(rng, s.requests, s.length_mean, s.length_rel_std * s.length_mean, *s.length_bounds())


def generate_credit(scale="cpu", seed: int = 0, **ids) -> Trace:
    """`ids`: as generate_post_rec's."""
    s = resolve_scale(scale, CREDIT_SCALES)
    lengths = credit_lengths(s, seed)

    def requests(draw, suffix: list[int]) -> list[TraceRequest]:
        return [TraceRequest(f"c{i}", user=i, index_in_user=0, prompt_token_ids=draw(n) + suffix, cache_prefix_len=0)
                for i, n in enumerate(lengths)]

    return _trace("credit", s, seed, CREDIT_SUFFIX_IDS, requests, **ids)


def _trace(workload: str, scale, seed: int, default_suffix: list[int], requests, suffix_ids: list[int] | None = None,
           vocab_size: int = SMOLLM2_VOCAB_SIZE, low_id: int = LOW_TOKEN_ID, allowed_token_ids: list[int] | None = None) -> Trace:
    """The trace of `requests(draw, suffix)`, where draw(n) gives n random ids in [low_id, vocab_size)
    from the workload's id stream and `suffix` (default: the workload's question) ends every prompt."""
    if not 0 <= low_id < vocab_size:
        raise ValueError(f"need 0 <= low_id < vocab_size, got {low_id}, {vocab_size}")
    rng = _rng(seed, workload, _STREAM_IDS)
    suffix = list(default_suffix if suffix_ids is None else suffix_ids)
    reqs = requests(lambda n: random_ids(rng, n, low_id, vocab_size), suffix)
    allowed = list(ALLOWED_TOKEN_IDS if allowed_token_ids is None else allowed_token_ids)
    scale_fields = json.loads(json.dumps(dataclasses.asdict(scale)))  # JSON-native (tuples -> lists): round-trips exactly
    return Trace(workload, scale_fields, seed, vocab_size, low_id, suffix, allowed, reqs)


GENERATORS = {"post_rec": generate_post_rec, "credit": generate_credit}


def generate(workload: str, scale="cpu", seed: int = 0, **kwargs) -> Trace:
    if workload not in GENERATORS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[workload](scale, seed, **kwargs)


# -- arrivals -----------------------------------------------------------------------------------
def user_rate_for_qps(trace: Trace, qps: float) -> float:
    """Users/s that give `qps` requests/s on average."""
    return qps * trace.num_users / len(trace.requests)


def with_poisson_arrivals(trace: Trace, user_rate: float, seed: int | None = None, burst_mean: float = 1.0) -> Trace:
    """A copy of `trace` with arrival_s stamped: Poisson users (first at t = 0, in user order),
    each user's requests REQUEST_GAP_S apart. The same seed and rate give the same times.

    burst_mean > 1: bursts of users at the same mean rate: groups of consecutive users (sizes
    geometric with mean burst_mean) start together, the groups Poisson at user_rate / burst_mean."""
    if user_rate <= 0:
        raise ValueError(f"user_rate must be > 0, got {user_rate}")
    if burst_mean < 1:
        raise ValueError(f"burst_mean must be >= 1, got {burst_mean}")
    seed = trace.seed if seed is None else seed
    users = sorted({r.user for r in trace.requests})
    rng = _rng(seed, trace.workload, _STREAM_ARRIVALS)
    if burst_mean == 1:
        gaps = rng.exponential(1.0 / user_rate, size=len(users))
        times = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    else:
        sizes = rng.geometric(1.0 / burst_mean, size=len(users))  # enough groups for any draw
        group = np.repeat(np.arange(len(users)), sizes)[: len(users)]
        gaps = rng.exponential(burst_mean / user_rate, size=len(users))
        times = np.concatenate([[0.0], np.cumsum(gaps[1:])])[group]
    starts = dict(zip(users, times.tolist()))
    requests = [dataclasses.replace(r, arrival_s=starts[r.user] + REQUEST_GAP_S * r.index_in_user) for r in trace.requests]
    return dataclasses.replace(trace, requests=requests, user_rate=user_rate, arrival_seed=seed, arrival_burst_mean=burst_mean)


def arrival_order(trace: Trace) -> list[TraceRequest]:
    """Requests by arrival time (trace order breaks ties and stands for offline traces)."""
    if any(r.arrival_s is None for r in trace.requests):
        return list(trace.requests)
    return sorted(trace.requests, key=lambda r: r.arrival_s)


# -- JSON ---------------------------------------------------------------------------------------
def trace_to_dict(trace: Trace) -> dict:
    return dataclasses.asdict(trace)


def trace_from_dict(data: dict) -> Trace:
    if data.get("format") != TRACE_FORMAT:
        raise ValueError(f"not a {TRACE_FORMAT} trace (format = {data.get('format')!r})")
    fields = dict(data)
    fields["requests"] = [TraceRequest(**r) for r in data["requests"]]
    return Trace(**fields)


def save_trace(trace: Trace, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace_to_dict(trace), f, separators=(",", ":"))  # compact: paper scale is ~14M ids
    return path


def load_trace(path) -> Trace:
    with open(path) as f:
        return trace_from_dict(json.load(f))


# -- CLI -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Write a seeded trace (docs/design.md §8) as JSON.")
    parser.add_argument("workload", choices=["post-rec", "credit"])
    parser.add_argument("--scale", default="cpu", choices=["tiny", "cpu", "paper"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--user-rate", type=float, help="stamp Poisson arrivals at this many users/s")
    parser.add_argument("--qps", type=float, help="stamp Poisson arrivals giving this many requests/s")
    parser.add_argument("--out", type=Path, help="default: perf/out/traces/<workload>_<scale>_s<seed>[_r<rate>].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    workload = args.workload.replace("-", "_")
    trace = generate(workload, args.scale, args.seed)
    rate = args.user_rate if args.qps is None else user_rate_for_qps(trace, args.qps)
    if rate is not None:
        trace = with_poisson_arrivals(trace, rate)
    out = args.out or DEFAULT_TRACE_DIR / f"{workload}_{args.scale}_s{args.seed}{'' if rate is None else f'_r{rate:g}'}.json"
    save_trace(trace, out)
    print(trace.summary())
    print(f"written to {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
