"""Scheduler simulation: the engine's Scheduler and PrefixIndex, a cost model instead of a model.

    .venv/bin/python -m perf.simulate                       # the default sweep (~30 s of one core)
    .venv/bin/python -m perf.simulate --scenario dependency # only scenarios whose key or name contains it
    .venv/bin/python -m perf.simulate --quick               # fewer loads, cpu-scale traces, prints only
    .venv/bin/python -m perf.simulate --pick-cost-only

A discrete-event simulation of N engines behind user-affinity routing (user -> engine by a
stable hash). Each engine runs batched forward steps exactly as the engine's worker does: when
idle and requests wait, it asks its Scheduler (the engine's class, `clock=` the simulated clock,
`prefix=IndexPrefixView` over its own PrefixIndex) for `schedule()` with `StepBudget(max_batch_tokens)`
(default: the engine's device default, 8192 uncached tokens for the GPU model, 2048 for the CPU
one; 1 = one request per step). The plan's members come back already pinned in the index (cached
prefix matched and pinned, the keep boundary's uncached blocks reserved, LRU eviction; blocks that
find no room are overflow); the step then
  * runs for the TRUE cost model's step time: one fixed cost plus every member's linear and
    attention terms (CostModel.step_seconds; optionally times seeded log-normal noise);
  * on completion hands the step's time to `scheduler.finish`, which commits every member's ticket
    and feeds the step to the scheduler's JctEstimator (`observe_step(splits, seconds)`), so the estimate is fitted online as
    in the engine (seeded, as Engine._time_per_token does, with a cold 256-token forward's seconds
    per token); every member completes at the end of its step.
Policies: FCFS, SJF (estimate frozen at arrival), CSJF (`csjf-independent`: every request ranked
on its own estimate minus its starvation credit, the paper's) and CSJF+groups (`csjf`, the engine's
default): a cold request whose kept blocks other waiting requests would read (a new user's profile
and that user's queued posts) is ranked by Smith's rule for the whole group, its cost averaged over
the requests it makes warm, so it no longer waits behind every warm request.
Pick time is measured separately (wall time of one schedule() with 1000 / 5000 waiting requests)
and is not charged to the simulated clock, except in the scenario marked "pick time charged",
which adds (measured µs per waiting request) x (requests waiting) before every step.

Cost models, both  t = a + b*u + k*u*(u + 2c)  (u = computed tokens, c = cached tokens; a step:
a + the sum of the b and k terms of its members):
  cpu  SmolLM2-135M bf16 on the 2-core build host: a least-squares fit to perf/RESULTS.md's
       measured points (cold 512 / 2048 / 8192 tokens at 3284 / 2185 / 1187 tok/s, "Engine core";
       a warm post-rec request, ~190 new tokens over a ~1.9K cached profile, ~0.2 s, "Prefix
       cache"): a = 0.048 s, b = 2.9e-4 s/token, k = 6.7e-8 s -> 8K cold ~ 6.9 s.
  gpu  docs/design.md §7: Llama-3.1-8B model FLOPs 2*N*u + 2*L*d*u*(2c + u), N = 7.0e9, L = 32,
       d = 4096, at an MFU (default 50%) of a peak (default the H200's 989 TFLOP/s dense bf16),
       plus an optional fixed time per step (default 0: so a GPU step costs exactly the sum of its
       members, batching gains no throughput in this model and only moves completions to the end
       of the step). KV bytes/token 2*L*8*128*2 = 128 KiB.

Workloads (perf/workloads.py, same seeds and lengths as the id traces): post recommendation and
credit verification. Token ids are not generated: a request's block keys are synthetic but have
the same sharing structure as the chained hashes of its ids (a block lying entirely inside a
user's profile is keyed (user, i); any later block is keyed (request, i)), which is exactly what
the index sees (tests/cache_scheduler/test_simulator.py checks it against real block_hashes of a real trace).
Arrivals: perf/workloads.with_poisson_arrivals (Poisson users, a user's requests 0.1 s apart).

Load levels are multiples of the saturated throughput: N x (requests / total one-at-a-time
service time with perfect caching: every request but a user's first reads the whole profile
from the cache). The default sweep runs 8 loads (0.25-4x) on the older scenarios and 0.25-2x on
the dependency-rule one. Writes the "## Scheduler simulation" section of perf/RESULTS.md, a plot
(perf/results/simulate.png) and raw JSON (perf/results/simulate.json); a `--scenario` run
re-runs only the matching scenarios and merges them into the stored results (each scenario keeps
the command and date it was run with).
"""

from __future__ import annotations

import argparse
from collections import Counter
import dataclasses
import hashlib
import heapq
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from perf import benchutil as bu
from perf import workloads as wl
from perf.envoy_hashing import EnvoyPlacement, classify_moves
from prefillonly.cache.index import PrefixIndex, usable_cached_tokens
from prefillonly.config import DEFAULT_MAX_BATCH_TOKENS, EngineConfig
from prefillonly.contract.errors import OverloadedError
from prefillonly.serving.picker.choice import DEFAULT_WORK_WEIGHT, Picker
from prefillonly.scheduler import (DEFAULT_LAMBDA_TOKENS_PER_S, IndexPrefixView, JctEstimator, Scheduler, StepBudget, StepOutcome,
                                   WaitingRequest)

SECTION = "## Scheduler simulation"
RESULTS_FORMAT = 2  # 2: batched steps (Scheduler.schedule), csjf = CSJF+groups; a --scenario run merges only into this format
POLICIES = ("fcfs", "sjf", "csjf-independent", "csjf")
LABELS = {"fcfs": "FCFS", "sjf": "SJF", "csjf-independent": "CSJF", "csjf": "CSJF+groups"}
COLORS = {"fcfs": "tab:red", "sjf": "tab:orange", "csjf-independent": "tab:blue", "csjf": "tab:green"}
DEFAULT_BLOCK = EngineConfig.default_of("cache_block_size")
DEFAULT_LOADS = (0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 3.0, 4.0)
H200_PEAK_TFLOPS = 989.0
LLAMA8B = dict(n_params=7.0e9, layers=32, attn_dim=4096, kv_bytes_per_token=2 * 32 * 8 * 128 * 2)
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads x 64, bf16


# -- cost models -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """t = fixed_s + per_token_s * u + attention_s * u * (u + 2 * context_factor * c) for one
    request; a step of several: fixed_s once plus every member's other two terms.

    context_factor = 1 is the real cost of attending to the cached prefix; 0 makes cached tokens
    free (an idealised cache hit, used by the tests). device: the engine device whose defaults
    (max_batch_tokens) the simulated engine takes ("cpu" | "cuda")."""

    name: str
    fixed_s: float
    per_token_s: float
    attention_s: float
    context_factor: float = 1.0
    kv_bytes_per_token: int = 0
    source: str = ""
    device: str = "cpu"

    def seconds(self, uncached: int, cached: int) -> float:
        return self.step_seconds([(uncached, cached)])

    def step_seconds(self, splits) -> float:
        """One forward step computing every (uncached, cached) member at once."""
        b, k, cf = self.per_token_s, self.attention_s, 2.0 * self.context_factor
        return self.fixed_s + sum(b * u + k * u * (u + cf * c) for u, c in splits)

    def describe(self) -> str:
        return (f"{self.name}: t = {self.fixed_s:.3g} + {self.per_token_s:.3g}·u + {self.attention_s:.3g}·u·(u + 2"
                f"{'' if self.context_factor == 1 else f'·{self.context_factor:g}'}·c) s; {self.source}")


def cpu_cost_model(fixed_s: float = 0.048, per_token_s: float = 2.9e-4, attention_s: float = 6.7e-8,
                   context_factor: float = 1.0) -> CostModel:
    return CostModel("cpu", fixed_s, per_token_s, attention_s, context_factor, SMOLLM2_KV_BYTES_PER_TOKEN,
                     "SmolLM2-135M bf16 on the 2-core host, least squares over perf/RESULTS.md's cold 512/2K/8K "
                     "prefill rates and a warm post-rec request (~0.2 s)", device="cpu")


def gpu_cost_model(mfu: float = 0.5, peak_tflops: float = H200_PEAK_TFLOPS, fixed_s: float = 0.0,
                   n_params: float = LLAMA8B["n_params"], layers: int = LLAMA8B["layers"],
                   attn_dim: int = LLAMA8B["attn_dim"], context_factor: float = 1.0) -> CostModel:
    rate = mfu * peak_tflops * 1e12  # FLOP/s
    return CostModel("gpu", fixed_s, 2.0 * n_params / rate, 2.0 * layers * attn_dim / rate, context_factor,
                     LLAMA8B["kv_bytes_per_token"],
                     f"Llama-3.1-8B model FLOPs (docs/design.md §7) at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s", device="cuda")


def default_step_tokens(cost: CostModel) -> int:
    """The engine's max_batch_tokens default on the cost model's device."""
    return DEFAULT_MAX_BATCH_TOKENS[cost.device]


# -- requests --------------------------------------------------------------------------------
@dataclass
class SimRequest:
    request_id: str
    user: int
    index_in_user: int
    prompt_tokens: int
    cache_prefix_len: int  # the trace's (the API's, in tokens): whole blocks before it are kept after the forward
    block_keys: list  # one key per full block of the prompt (what PrefixIndex matches on)
    arrival_s: float = 0.0

    def kept_blocks(self, block_size: int) -> int:
        """The keep boundary in whole blocks, as Engine.submit_task converts cache_prefix_len
        (the scheduler, the index and the picker count it in blocks)."""
        return self.cache_prefix_len // block_size


@dataclass
class Workload:
    name: str  # post_rec | credit
    scale: str
    seed: int
    block_size: int
    requests: list[SimRequest]  # trace order (user-major), arrivals unset
    skeleton: wl.Trace  # same users / requests, empty ids: what with_poisson_arrivals stamps

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def with_arrivals(self, qps: float, burst_mean: float = 1.0) -> list[SimRequest]:
        rate = wl.user_rate_for_qps(self.skeleton, qps)
        stamped = wl.with_poisson_arrivals(self.skeleton, rate, burst_mean=burst_mean)
        return [dataclasses.replace(r, arrival_s=t.arrival_s) for r, t in zip(self.requests, stamped.requests)]

    def summary(self) -> str:
        shared = sum(r.cache_prefix_len for r in self.requests if r.index_in_user > 0)
        return (f"{self.name}/{self.scale} seed {self.seed}: {len(self.requests)} requests, {len({r.user for r in self.requests})} users, "
                f"{self.prompt_tokens:,} prompt tokens ({shared:,} in profiles seen before)")


def _key(*parts) -> bytes:
    return hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=16).digest()


def _workload(workload: str, scale, seed: int, block_size: int, reqs: list[SimRequest]) -> Workload:
    """`reqs` as a Workload, with a skeleton trace of the same users and requests (no ids)."""
    s = wl.resolve_scale(scale, wl.POST_REC_SCALES if workload == "post_rec" else wl.CREDIT_SCALES)
    tr = [wl.TraceRequest(r.request_id, r.user, r.index_in_user, [], r.cache_prefix_len) for r in reqs]
    skeleton = wl.Trace(workload, dataclasses.asdict(s), seed, wl.SMOLLM2_VOCAB_SIZE, wl.LOW_TOKEN_ID, [], [], tr)
    return Workload(workload, scale if isinstance(scale, str) else "custom", seed, block_size, reqs, skeleton)


def post_rec_workload(scale="paper", seed: int = 0, block_size: int = DEFAULT_BLOCK) -> Workload:
    """perf/workloads.generate_post_rec's lengths and sharing, without the ids."""
    profiles, posts = wl.post_rec_lengths(scale, seed)
    suffix = len(wl.POST_REC_SUFFIX_IDS)
    reqs = []
    for u, plen in enumerate(profiles.tolist()):
        profile_keys = [_key("post_rec", seed, f"u{u}", i) for i in range(plen // block_size)]
        for k, post in enumerate(posts[u].tolist()):
            n = plen + post + suffix
            rid = f"u{u}/p{k}"
            keys = profile_keys + [_key("post_rec", seed, rid, i) for i in range(plen // block_size, n // block_size)]
            reqs.append(SimRequest(rid, u, k, n, plen, keys))
    return _workload("post_rec", scale, seed, block_size, reqs)


def credit_workload(scale="paper", seed: int = 0, block_size: int = DEFAULT_BLOCK) -> Workload:
    suffix = len(wl.CREDIT_SUFFIX_IDS)
    reqs = []
    for i, n in enumerate(wl.credit_lengths(scale, seed).tolist()):
        rid = f"c{i}"
        reqs.append(SimRequest(rid, i, 0, n + suffix, 0, [_key("credit", seed, rid, j) for j in range((n + suffix) // block_size)]))
    return _workload("credit", scale, seed, block_size, reqs)


def trace_workload(trace: wl.Trace, block_size: int = DEFAULT_BLOCK, model_id: str = "sim") -> Workload:
    """The same from a real id trace, keyed by the engine's chained block hashes (slow at paper scale)."""
    from prefillonly.contract.block_keys import block_hashes, namespace_root

    root = namespace_root(model_id, None)
    reqs = [SimRequest(r.request_id, r.user, r.index_in_user, len(r.prompt_token_ids), r.cache_prefix_len,
                       block_hashes(r.prompt_token_ids, block_size, root)) for r in trace.requests]
    skeleton = dataclasses.replace(trace, requests=[dataclasses.replace(r, prompt_token_ids=[], arrival_s=None) for r in trace.requests],
                                   user_rate=None, arrival_seed=None)
    return Workload(trace.workload, "trace", trace.seed, block_size, reqs, skeleton)


WORKLOADS = {"post_rec": post_rec_workload, "credit": credit_workload}


def perfect_cache_hit(r: SimRequest, block_size: int) -> int:
    """The tokens a request finds cached when every request but a user's first finds the whole kept profile."""
    return usable_cached_tokens(r.kept_blocks(block_size) * block_size, r.prompt_tokens) if r.index_in_user > 0 else 0


def perfect_cache_service_s(workload: Workload, cost: CostModel) -> float:
    """Total one-at-a-time service time with perfect caching."""
    hits = [perfect_cache_hit(r, workload.block_size) for r in workload.requests]
    return sum(cost.seconds(r.prompt_tokens - c, c) for r, c in zip(workload.requests, hits))


def saturated_qps(workload: Workload, cost: CostModel, engines: int = 1) -> float:
    return engines * len(workload.requests) / perfect_cache_service_s(workload, cost)


def engine_of(user, engines: int) -> int:
    """Stable user -> engine routing (blake2b of the user id, not Python's salted hash)."""
    return _hash64(str(user)) % engines


# -- routing across engines (the fleet's Envoy policies) -----------------------------------------
ROUTINGS = ("user_hash", "maglev_bounded", "ring_hash_bounded", "least_request", "random", "picker")
HASHED = {"maglev_bounded": "MAGLEV", "ring_hash_bounded": "RING_HASH"}  # -> Envoy's lb_policy


def engine_key(engine: int) -> str:
    """The address an engine has in the simulated fleet: Envoy hashes a replica by its address."""
    return f"10.0.{engine // 256}.{engine % 256}:8000"


class Router:
    """Which engine a request goes to, given every engine's outstanding requests (waiting + running).

    user_hash          hash(user) % engines, never moved (the paper's user_id % N)
    maglev_bounded     Envoy's MAGLEV with hash_balance_factor (the fleet's default), and
    ring_hash_bounded  Envoy's RING_HASH with it: perf/envoy_hashing.py rebuilds Envoy's own table
                       over the engines' addresses, and when the user's engine is above the bound
                       (active > ceil(factor x (total active + 1) / engines)) probes the others in
                       Envoy's seeded order; what moves when engines leave or join (set_engines)
                       is therefore what the real Envoy moves (perf/bench_placement.py)
    least_request      Envoy's LEAST_REQUEST: the less loaded of two engines drawn at random
    random             uniform
    picker             the fleet's endpoint picker (prefillonly.serving.picker.choice, the live
                       picker's code): the engine predicted to complete the request first, from
                       each engine's backlog and JCT fit as reported every `report_interval_s`
                       (PickerRouter) and the blocks the picker sent it
    """

    def __init__(self, routing: str, engines: int, rng: np.random.Generator, factor: float = 1.5):
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} unknown; choose one of {', '.join(ROUTINGS)}")
        self.routing, self.engines, self.rng, self.factor = routing, engines, rng, factor
        self._sticky: dict = {}
        self.set_engines(list(range(engines)))

    def set_engines(self, members: list[int]) -> None:
        """The engines in rotation from now on (an engine lost, or one added); hashed routings
        rebuild Envoy's table over them. user_hash stays fixed (it is the paper's static rule)."""
        self.members = list(members)
        if self.routing in HASHED:
            self._keys = [engine_key(e) for e in self.members]
            self._placement = EnvoyPlacement(HASHED[self.routing], self._keys, round(100 * self.factor))
            self._engine_of_key = dict(zip(self._keys, self.members))

    def route(self, user, loads: list[int]) -> int:
        members = self.members
        if len(members) == 1:
            return members[0]
        if self.routing == "user_hash":
            return self._sticky.setdefault(user, engine_of(user, self.engines))
        if self.routing == "random":
            return members[int(self.rng.integers(len(members)))]
        if self.routing == "least_request":
            i, j = self.rng.choice(len(members), size=2, replace=False)  # indices: choice(list) converts it every call
            a, b = members[i], members[j]
            return a if loads[a] <= loads[b] else b
        active = dict(zip(self._keys, (loads[e] for e in members))) if any(loads[e] for e in members) else None
        return self._engine_of_key[self._placement.host_of(str(user), active)]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


# -- the simulation ----------------------------------------------------------------------------
@dataclass
class Record:
    request_id: str
    engine: int
    arrival_s: float
    start_s: float
    done_s: float
    service_s: float
    cached: int
    uncached: int
    pick_s: float = 0.0
    step_members: int = 1  # requests in the step it ran in (service_s is that step's time)
    step_tokens: int = 0  # uncached tokens of that step

    @property
    def latency_s(self) -> float:
        return self.done_s - self.arrival_s


class PickerRouter:
    """Routing "picker": prefillonly.serving.picker.choice.Picker over the simulated engines,
    which report their queued work (Scheduler.queued_work_s plus the running step's remaining
    time) and JCT coefficients every `report_interval_s` of simulated time, as the replicas
    publish them to the live picker (staleness included)."""

    def __init__(self, engines: list, block_size: int, capacity_blocks: int, fallback_s_per_token: float,
                 report_interval_s: float, work_weight: float = DEFAULT_WORK_WEIGHT):
        self.engines, self.report_interval_s = engines, report_interval_s
        self.picker = Picker(block_size, capacity_blocks, fallback_s_per_token, work_weight=work_weight)
        self.picker.set_members([e.eid for e in engines])
        self._next_report = 0.0

    def route(self, r: "SimRequest", now: float) -> int:
        if now >= self._next_report:
            for e in self.engines:
                self.picker.report(e.eid, e.queued_work_s(now), e.estimator.coefficients, now)
            self._next_report = now + self.report_interval_s
        return self.picker.pick(r.user, r.block_keys, r.prompt_tokens, now, r.kept_blocks(self.picker.block_size)).replica


class _Clock:
    __slots__ = ("now",)

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimEngine:
    """One engine: a PrefixIndex, a JctEstimator and a Scheduler, one batched step at a time."""

    def __init__(self, eid: int, policy: str, cost: CostModel, block_size: int, cache_blocks: int, clock: _Clock,
                 lambda_tokens_per_s: float, fallback_s_per_token: float, max_waiting: int, rng: np.random.Generator | None,
                 noise: float, pick_s_per_waiting: float = 0.0, step_tokens: int = 1):
        self.eid = eid
        self.cost = cost
        self.block_size = block_size
        self.index = PrefixIndex(cache_blocks, block_size=block_size)
        self.estimator = JctEstimator(fallback_s_per_token=fallback_s_per_token)
        # no memory check: the cost model has no activation budget
        self.scheduler = Scheduler(policy, self.estimator, IndexPrefixView(self.index), budget=StepBudget(step_tokens),
                                   max_waiting=max_waiting, lambda_tokens_per_s=lambda_tokens_per_s, clock=clock)
        self.clock = clock
        self.rng, self.noise = rng, noise
        self.pick_s_per_waiting = pick_s_per_waiting
        self.running = None  # (StepPlan, seconds, start, pick_s)
        self.picks = 0
        self.max_waiting_seen = 0

    def add(self, sr: SimRequest) -> None:
        """Queue a trace request as the engine queues its Request (raises OverloadedError)."""
        self.scheduler.add(_queued(sr, self.block_size))

    def queued_work_s(self, now: float) -> float:
        """What the engine publishes to the picker: its waiting requests' estimates plus what is
        left of the running step."""
        running = max(0.0, self.running[2] + self.running[3] + self.running[1] - now) if self.running else 0.0
        return self.scheduler.queued_work_s() + running

    @property
    def outstanding(self) -> int:
        """Waiting + running requests (what the routers balance)."""
        return len(self.scheduler) + (len(self.running[0]) if self.running else 0)

    def start_next(self) -> float | None:
        """Plan and start the next step; returns its completion time (None if nothing waits)."""
        waiting = len(self.scheduler)
        self.max_waiting_seen = max(self.max_waiting_seen, waiting)
        plan = self.scheduler.schedule()  # members pinned in the index (PrefixIndex.begin)
        if not plan:
            return None
        self.picks += 1
        # one tier, so plan.moves (tier restores / offloads) are empty; there is nothing to execute
        seconds = self.cost.step_seconds(plan.shape)
        if self.noise:
            seconds *= float(np.exp(self.rng.normal(-0.5 * self.noise**2, self.noise)))
        pick_s = self.pick_s_per_waiting * waiting  # the pick runs on the worker before the forward
        now = self.clock()
        self.running = (plan, seconds, now, pick_s)
        return now + pick_s + seconds

    def finish(self) -> list[Record]:
        """The step's end, as the engine's is: scheduler.finish commits every member's ticket and
        feeds the step's time to the estimator; one Record per member."""
        plan, seconds, start, pick_s = self.running
        self.running = None
        self.scheduler.finish(plan, StepOutcome([None] * len(plan), forward_s=seconds))
        done, n, tokens = self.clock(), len(plan), plan.tokens
        return [Record(m.request.trace.request_id, self.eid, m.request.trace.arrival_s, start, done, seconds,
                       m.split.cached, m.split.uncached, pick_s, n, tokens) for m in plan.members]


@dataclass(eq=False)
class QueuedTraceRequest(WaitingRequest):
    """A trace request as the scheduler queues it (the engine's Request, for the simulator)."""

    trace: SimRequest | None = None


def _queued(r: SimRequest, block_size: int) -> QueuedTraceRequest:
    return QueuedTraceRequest(prompt_tokens=r.prompt_tokens, block_hashes=r.block_keys, kept_blocks=r.kept_blocks(block_size),
                              trace=r)


@dataclass
class SimConfig:
    policy: str = "csjf"
    engines: int = 1
    cache_blocks: int | None = None  # per engine; None = room for every block the requests could keep
    lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S
    fallback_s_per_token: float | None = None  # the estimate until a fit exists; None = as the engine seeds it:
    # one cold 256-token forward's seconds per token (Engine._time_per_token), here from the cost model
    max_waiting: int | None = None  # None = unbounded (never refuse)
    noise: float = 0.0  # sigma of a mean-1 log-normal factor on every service time
    seed: int = 0  # the noise stream
    pick_s_per_waiting: float = 0.0  # simulated time charged per waiting request at every pick (0 = picks are free)
    max_batch_tokens: int | None = None  # a step's uncached-token budget; None = the engine's default on the cost
    # model's device (DEFAULT_MAX_BATCH_TOKENS: 8192 gpu, 2048 cpu); 1 = one request per step (unbatched)
    routing: str = "user_hash"  # across engines: see Router
    hash_balance_factor: float = 1.5  # the hashed routings' bound, Envoy's hash_balance_factor / 100
    report_interval_s: float = 0.05  # routing "picker": how often the engines report their backlog
    picker_work_weight: float = DEFAULT_WORK_WEIGHT  # routing "picker": the compute term's weight in its cost


@dataclass
class SimResult:
    records: list[Record]
    rejected: list[str]
    engines: list[dict]
    wall_s: float
    estimator_mare: list[float | None] = field(default_factory=list)
    estimator_coefficients: list = field(default_factory=list)  # each engine's last fit (JctCoefficients | None)

    def summary(self, qps: float | None = None) -> dict:
        lat = np.array([r.latency_s for r in self.records])
        svc = np.array([r.service_s for r in self.records])
        hit = sum(r.cached for r in self.records)
        total = hit + sum(r.uncached for r in self.records)
        first = min(r.arrival_s for r in self.records)
        last = max(r.done_s for r in self.records)
        return {
            "offered_qps": qps,
            "completed": len(self.records),
            "rejected": len(self.rejected),
            "mean_latency_s": float(lat.mean()),
            "p50_latency_s": float(np.percentile(lat, 50)),
            "p99_latency_s": float(np.percentile(lat, 99)),
            "max_latency_s": float(lat.max()),
            "mean_service_s": float(svc.mean()),
            "mean_pick_s": float(np.mean([r.pick_s for r in self.records])),
            "mean_wait_s": float(np.mean([r.start_s - r.arrival_s for r in self.records])),
            "throughput_qps": len(self.records) / (last - first) if last > first else float("inf"),
            "makespan_s": last - first,
            "hit_rate": hit / total if total else 0.0,
            "hit_tokens": hit,
            "computed_tokens": total - hit,
            "blocks_evicted": sum(e["blocks_evicted"] for e in self.engines),
            "overflow_blocks": sum(e["overflow_blocks"] for e in self.engines),
            "max_waiting": max(e["max_waiting"] for e in self.engines),
            "picks": sum(e["picks"] for e in self.engines),
            "mean_step_members": len(self.records) / max(1, sum(e["picks"] for e in self.engines)),
            "estimator_mare": _mean([m for m in self.estimator_mare if m is not None]),
            # requests per engine, the busiest over the mean (1 = perfectly even)
            "load_imbalance": _imbalance([r.engine for r in self.records], len(self.engines)),
            "sim_wall_s": self.wall_s,
        }


def _imbalance(engine_ids: list[int], engines: int) -> float:
    counts = np.bincount(np.asarray(engine_ids, dtype=int), minlength=engines)
    return float(counts.max() / counts.mean()) if counts.sum() else 1.0


def _mean(xs):
    return float(statistics.fmean(xs)) if xs else None


def simulate(requests: list[SimRequest], cost: CostModel, cfg: SimConfig, block_size: int = DEFAULT_BLOCK) -> SimResult:
    """Run `requests` (arrival_s set) to completion; returns one Record per completed request
    (records in completion order; a step's members in plan order)."""
    t0 = time.perf_counter()
    clock = _Clock()
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 4]))
    max_waiting = cfg.max_waiting or (len(requests) + 1)
    cache_blocks = cfg.cache_blocks
    if cache_blocks is None:  # PrefixIndex preallocates its free list: size it to what can be kept
        cache_blocks = max(1, sum(r.kept_blocks(block_size) for r in requests))
    fallback = cfg.fallback_s_per_token or cost.seconds(256, 0) / 256
    step_tokens = cfg.max_batch_tokens or default_step_tokens(cost)
    engines = [SimEngine(i, cfg.policy, cost, block_size, cache_blocks, clock, cfg.lambda_tokens_per_s,
                         fallback, max_waiting, rng, cfg.noise, cfg.pick_s_per_waiting, step_tokens) for i in range(cfg.engines)]
    # arrival order; trace order breaks ties (the workloads' arrival_order does the same)
    arrivals = sorted(enumerate(requests), key=lambda ir: (ir[1].arrival_s, ir[0]))
    router = Router(cfg.routing, cfg.engines, np.random.default_rng(np.random.SeedSequence([cfg.seed, 5])), cfg.hash_balance_factor)
    picker = (PickerRouter(engines, block_size, cache_blocks, fallback, cfg.report_interval_s, cfg.picker_work_weight)
              if cfg.routing == "picker" else None)
    routes: dict = {}  # user -> the engines it was sent to
    done: list[tuple[float, int]] = []  # heap of (completion time, engine id)
    records, rejected = [], []
    i, n = 0, len(arrivals)
    while i < n or done:
        t_arr = arrivals[i][1].arrival_s if i < n else math.inf
        t_done = done[0][0] if done else math.inf
        clock.now = min(t_arr, t_done)
        touched = set()
        while done and done[0][0] <= clock.now:  # completions first: a freed engine sees the arrivals of this instant
            _, eid = heapq.heappop(done)
            records.extend(engines[eid].finish())
            touched.add(eid)
        while i < n and arrivals[i][1].arrival_s <= clock.now:
            r = arrivals[i][1]
            i += 1
            if picker is not None:
                eid = picker.route(r, clock.now)
            else:
                eid = router.route(r.user, [e.outstanding for e in engines] if cfg.engines > 1 else [0])
            routes.setdefault(r.user, set()).add(eid)
            try:
                engines[eid].add(r)
            except OverloadedError:
                rejected.append(r.request_id)
                continue
            touched.add(eid)
        for eid in sorted(touched):
            e = engines[eid]
            if e.running is None:
                t = e.start_next()
                if t is not None:
                    heapq.heappush(done, (t, eid))
    engine_info = [{"engine": e.eid, "users": sorted({u for u, x in routes.items() if e.eid in x}), "picks": e.picks,
                    "max_waiting": e.max_waiting_seen, "blocks_evicted": e.index.stats.blocks_evicted,
                    "overflow_blocks": e.index.stats.overflow_blocks, "blocks_stored": e.index.stats.blocks_stored}
                   for e in engines]
    return SimResult(records, rejected, engine_info, time.perf_counter() - t0, [e.estimator.mean_abs_relative_error() for e in engines],
                     [e.estimator.coefficients for e in engines])


# -- sweeps ------------------------------------------------------------------------------------
@dataclass
class Scenario:
    name: str
    workload: str
    scale: str
    cost: str
    engines: int
    cache_gib: float | None  # per engine; None = room for every block the requests keep (every profile)
    charge_pick: bool = False  # charge the measured pick cost per waiting request to the clock
    key: str = ""  # a short id (--scenario matches it or the name; results merge by it)
    loads: tuple[float, ...] | None = None  # None = the sweep's loads
    policies: tuple[str, ...] | None = None  # None = every policy of the sweep

    @property
    def id(self) -> str:
        return self.key or self.name


DEPENDENCY_LOADS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.5, 2.0)


def default_scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario("post-rec cpu-scale, cpu model, 1 engine", "post_rec", "cpu", "cpu", 1, 0.125, key="quick-post-rec"),
                Scenario("credit cpu-scale, cpu model, 1 engine", "credit", "cpu", "cpu", 1, 0.125, key="quick-credit")]
    return [
        Scenario("dependency rule: post-rec paper, H200 8B model, 1 engine, room for every profile", "post_rec", "paper", "gpu",
                 1, None, key="dependency-paper", loads=DEPENDENCY_LOADS, policies=("fcfs", "csjf-independent", "csjf")),
        Scenario("post-rec paper, H200 8B model, 1 engine, 16 GiB cache", "post_rec", "paper", "gpu", 1, 16, key="post-rec-16g"),
        Scenario("post-rec paper, H200 8B model, 1 engine, 16 GiB cache, pick time charged", "post_rec", "paper", "gpu", 1, 16, True,
                 key="post-rec-16g-pick"),
        Scenario("post-rec paper, H200 8B model, 1 engine, 64 GiB cache", "post_rec", "paper", "gpu", 1, 64, key="post-rec-64g"),
        Scenario("post-rec paper, H200 8B model, 4 engines, 16 GiB cache each", "post_rec", "paper", "gpu", 4, 16, key="post-rec-4x16g"),
        Scenario("credit paper, H200 8B model, 1 engine", "credit", "paper", "gpu", 1, 16, key="credit-1"),
        Scenario("credit paper, H200 8B model, 4 engines", "credit", "paper", "gpu", 4, 16, key="credit-4"),
        Scenario("post-rec cpu-scale, CPU SmolLM2 model, 1 engine, 128 MiB cache", "post_rec", "cpu", "cpu", 1, 0.125, key="post-rec-cpu"),
    ]


def select_scenarios(scenarios: list[Scenario], pattern: str | None) -> list[Scenario]:
    """The scenarios whose key or name contains `pattern` (case-insensitive); all for None."""
    if not pattern:
        return list(scenarios)
    p = pattern.lower()
    return [sc for sc in scenarios if p in sc.key.lower() or p in sc.name.lower()]


def cache_blocks_for(gib: float, cost: CostModel, block_size: int) -> int:
    return int(gib * 2**30 // (cost.kv_bytes_per_token * block_size))


def run_scenario(sc: Scenario, loads: list[float], policies: list[str], seed: int, block_size: int, mfu: float,
                 noise: float, pick_s_per_waiting: dict[str, float] | None = None, max_batch_tokens: int | None = None) -> dict:
    cost = gpu_cost_model(mfu=mfu) if sc.cost == "gpu" else cpu_cost_model()
    work = WORKLOADS[sc.workload](sc.scale, seed, block_size)
    blocks = None if sc.cache_gib is None else cache_blocks_for(sc.cache_gib, cost, block_size)
    sat = saturated_qps(work, cost, sc.engines)
    step_tokens = max_batch_tokens or default_step_tokens(cost)
    profile_blocks = sum(r.kept_blocks(block_size) for r in work.requests if r.index_in_user == 0)
    bu.log(f"{sc.name}: {work.summary()}; saturated {sat:.3g} req/s; cache "
           f"{'room for every profile' if blocks is None else f'{blocks:,} blocks/engine'} (profiles need {profile_blocks:,} "
           f"in all); steps of <= {step_tokens} uncached tokens")
    runs = []
    for load in loads:
        qps = load * sat
        reqs = work.with_arrivals(qps)
        for policy in policies:
            charge = (pick_s_per_waiting or {}).get(policy, 0.0) if sc.charge_pick else 0.0
            res = simulate(reqs, cost, SimConfig(policy=policy, engines=sc.engines, cache_blocks=blocks, noise=noise, seed=seed,
                                                 pick_s_per_waiting=charge, max_batch_tokens=step_tokens), block_size)
            s = res.summary(qps)
            s.update(load=load, policy=policy)
            if load == loads[0] and policy == policies[0]:
                s["users_per_engine"] = [len(e["users"]) for e in res.engines]
            runs.append(s)
            bu.log(f"  load {load:g}x ({qps:.3g} req/s) {policy:16s}: mean {s['mean_latency_s']:.3g} s, P99 {s['p99_latency_s']:.3g} s, "
                   f"hit {s['hit_rate']:.1%}, thr {s['throughput_qps']:.3g} req/s, max waiting {s['max_waiting']}, "
                   f"{s['mean_step_members']:.1f} requests/step [{s['sim_wall_s']:.1f} s]")
    return {"scenario": dataclasses.asdict(sc), "cost_model": dataclasses.asdict(cost), "cost_formula": cost.describe(),
            "workload": work.summary(), "requests": len(work.requests), "prompt_tokens": work.prompt_tokens,
            "ideal_hit_rate": 1 - perfect_cache_tokens(work) / work.prompt_tokens,
            "saturated_qps": sat, "cache_blocks_per_engine": blocks, "max_batch_tokens": step_tokens,
            "pick_s_per_waiting": {p: (pick_s_per_waiting or {}).get(p, 0.0) for p in policies} if sc.charge_pick else None, "profile_blocks": profile_blocks,
            "block_size": block_size, "runs": runs}


def perfect_cache_tokens(work: Workload) -> int:
    """Tokens computed with perfect caching."""
    return sum(r.prompt_tokens - perfect_cache_hit(r, work.block_size) for r in work.requests)


# -- pick cost ----------------------------------------------------------------------------------
def measure_pick_cost(sizes=(1000, 5000), block_size: int = DEFAULT_BLOCK, reps: int = 5, policies=POLICIES) -> list[dict]:
    """Wall time of one Scheduler.schedule() with StepBudget(1) (the order of every waiting request,
    then the first one pinned) over `size` waiting requests of paper-scale post-rec hash lists
    (~220 profile blocks each), with every profile cached (match walks the whole profile: the
    worst case) and with an empty cache (match stops at the first block; csjf forms a dependency
    group per user). After each pick the member's ticket is aborted (its pins released, its
    reserved blocks forgotten) and the request re-queued, so every repetition sees the same index."""
    work = post_rec_workload("paper", 0, block_size)
    cost = gpu_cost_model()
    out = []
    for cached in (True, False):
        for policy in policies:
            for size in sizes:
                clock = _Clock()
                index = PrefixIndex(sum(r.kept_blocks(block_size) for r in work.requests if r.index_in_user == 0), block_size=block_size)
                if cached:  # each user's profile computed and kept, as the engine keeps it
                    for r in work.requests:
                        if r.index_in_user == 0:
                            index.commit(index.begin(r.block_keys, r.prompt_tokens, r.kept_blocks(block_size))[0])
                est = JctEstimator()
                for u, c in [(14000, 0), (200, 14000), (180, 12000), (16000, 0), (150, 16000)]:
                    est.observe(u, c, cost.seconds(u, c))
                sched = Scheduler(policy, est, IndexPrefixView(index), budget=StepBudget(1), max_waiting=size + 1, clock=clock)
                pool = work.requests
                for j in range(size):
                    r = pool[j % len(pool)]
                    clock.now = j * 1e-3
                    sched.add(_queued(r, block_size))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    plan = sched.schedule()
                    times.append(time.perf_counter() - t0)
                    for m in plan.members:
                        index.abort(m.ticket)
                        sched.add(m.request)
                row = {"policy": policy, "waiting": size, "profiles_cached": cached, "median_ms": 1e3 * statistics.median(times),
                       "per_request_us": 1e6 * statistics.median(times) / size}
                out.append(row)
                bu.log(f"  pick {policy:16s} {size:5d} waiting, profiles {'cached' if cached else 'not cached'}: "
                       f"{row['median_ms']:.2f} ms ({row['per_request_us']:.2f} us/request)")
    return out


# -- report ---------------------------------------------------------------------------------------
def _f(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}g}"


def _label(policy: str) -> str:
    return LABELS.get(policy, policy.upper())


def render(data: dict) -> str:
    lines = [f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Machine: {bu.machine_line(data['machine'])}", ""]
    lines += [
        "Discrete-event simulation (`perf/simulate.py`) of the engine's own `Scheduler` and `PrefixIndex` with a cost "
        "model in place of the model. Each engine runs batched forward steps as the engine's worker does: "
        "`Scheduler.schedule()` with `StepBudget(max_batch_tokens)` (the engine's device default: 8192 uncached tokens on the GPU "
        "model, 2048 on the CPU one) returns the step's members already pinned in the index; the step takes the cost "
        "model's time for all of them (one fixed cost per step), then every member's kept (profile) blocks are committed "
        "(LRU eviction) and the step is fed to the engine's online `JctEstimator` (seeded as the engine seeds it, with a "
        "cold 256-token forward's seconds per token). Every member completes at its step's end. Policies: FCFS; SJF "
        "(estimate frozen at arrival); CSJF = `csjf-independent` (every request ranked on its own: JCT estimate against "
        "the cache now minus the starvation credit; the paper's); CSJF+groups = `csjf`, the engine's default (a cold "
        "request whose kept blocks other waiting requests would read is ranked by Smith's rule for its whole dependency "
        "group). λ = 500 tokens/s, block 64 tokens, no second tier; pick time is not charged to the simulated clock "
        "except in the scenario marked \"pick time charged\" (measured µs per waiting request × requests waiting, "
        "added before every step). "
        "Load = offered QPS / saturated QPS, saturated = engines × requests / total one-at-a-time service time with "
        "perfect caching. Users arrive as a Poisson process (perf/workloads.py, seed "
        f"{data['seed']}), a user's requests 0.1 s apart; N engines route users by a stable hash. "
        f"Service-time noise σ = {data['noise']:g}.",
        "",
        "Cost models:",
    ]
    for name, formula in data["cost_models"].items():
        lines.append(f"- {formula}")
    lines.append("")
    # headline
    head = []
    for sc in data["scenarios"]:
        by = {r["policy"]: r for r in sc["runs"] if r["load"] == 0.9}
        if not all(p in by for p in ("fcfs", "csjf-independent", "csjf")):
            continue
        f, c, g = by["fcfs"], by["csjf-independent"], by["csjf"]
        head.append([sc["scenario"]["name"], _f(f["mean_latency_s"]), _f(c["mean_latency_s"]), _f(g["mean_latency_s"]),
                     f"{g['mean_latency_s'] / c['mean_latency_s']:.2f}", _f(f["p99_latency_s"]), _f(c["p99_latency_s"]),
                     _f(g["p99_latency_s"]), f"{g['p99_latency_s'] / c['p99_latency_s']:.2f}",
                     f"{f['hit_rate']:.1%}", f"{c['hit_rate']:.1%}", f"{g['hit_rate']:.1%}"])
    if head:
        lines += ["**At 0.9× saturation** (latencies in s; +groups/CSJF: CSJF+groups over CSJF):", "",
                  bu.markdown_table(["scenario", "FCFS mean", "CSJF mean", "CSJF+groups mean", "+groups/CSJF", "FCFS P99",
                                     "CSJF P99", "CSJF+groups P99", "+groups/CSJF", "FCFS hit", "CSJF hit", "CSJF+groups hit"],
                                    head), ""]
    for sc in data["scenarios"]:
        s = sc["scenario"]
        users = next((r.get("users_per_engine") for r in sc["runs"] if r.get("users_per_engine")), None)
        blocks = sc["cache_blocks_per_engine"]
        cache = "room for every profile" if blocks is None else f"{blocks:,} blocks/engine"
        ran = "" if sc.get("command", data["command"]) == data["command"] else f" Run by `{sc['command']}` ({sc.get('date', '?')})."
        lines += [f"**{s['name']}** — {sc['workload']}; saturated {sc['saturated_qps']:.3g} req/s; cache {cache} "
                  f"(all profiles: {sc['profile_blocks']:,}); steps of ≤ {sc.get('max_batch_tokens', '?')} uncached tokens; "
                  f"hit rate with perfect caching {sc['ideal_hit_rate']:.1%}"
                  + (f"; users per engine {users}" if users and len(users) > 1 else "")
                  + ("; pick charged per waiting request: " + ", ".join(f"{_label(p)} {v * 1e6:.2f} µs" for p, v in sc["pick_s_per_waiting"].items())
                     if sc.get("pick_s_per_waiting") else "") + "." + ran, ""]
        policies = [p for p in POLICIES if any(r["policy"] == p for r in sc["runs"])]
        header = ["load", "QPS"] + [f"{_label(p)} mean" for p in policies] + [f"{_label(p)} P99" for p in policies] \
            + [f"{_label(p)} hit" for p in policies] + [f"{_label(p)} thr" for p in policies]
        rows = []
        for load in sorted({r["load"] for r in sc["runs"]}):
            by = {r["policy"]: r for r in sc["runs"] if r["load"] == load}
            rows.append([f"{load:g}×", _f(next(iter(by.values()))["offered_qps"])]
                        + [_f(by[p]["mean_latency_s"]) for p in policies] + [_f(by[p]["p99_latency_s"]) for p in policies]
                        + [f"{by[p]['hit_rate']:.1%}" for p in policies] + [_f(by[p]["throughput_qps"]) for p in policies])
        lines += [bu.markdown_table(header, rows), ""]
    lines += ["mean / P99 = request latency (completion − arrival, s); hit = prompt tokens read from the cache; "
              "thr = completed requests / (last completion − first arrival): a finite trace, so above 1× it is "
              "bounded by saturation and the arrival spread, not sustained.", ""]
    if data.get("plot"):
        lines += [f"![latency vs QPS]({data['plot']})", ""]
    if data.get("pick_cost"):
        lines += ["**Scheduler.schedule cost** (wall time of one schedule() of one member: the policy's order of every waiting "
                  "request, then the first one pinned; median of several, this host, one thread; waiting requests are "
                  "paper-scale post-rec hash lists, ~220 profile blocks each; the estimator is fitted):", ""]
        rows = [[_label(r["policy"]), r["waiting"], "yes" if r["profiles_cached"] else "no", f"{r['median_ms']:.2f}", f"{r['per_request_us']:.2f}"]
                for r in data["pick_cost"]]
        lines += [bu.markdown_table(["policy", "waiting", "profiles cached", "ms / pick", "µs / waiting request"], rows), ""]
    if data.get("notes"):
        lines += [f"- {n}" for n in data["notes"]]
    return "\n".join(lines)


def notes(gpu: CostModel, pick_s_per_waiting: dict[str, float] | None, scenarios: list[dict] = ()) -> list[str]:
    """Reading aids computed from the cost model and the runs (the tables are the evidence)."""
    credit = 500.0 * gpu.per_token_s  # CSJF's starvation credit, s per s waited, once the fit matches the model
    cold, warm = gpu.seconds(14000 + 161, 0), gpu.seconds(200, 13952)
    out = [
        f"CSJF's starvation guard with the GPU model: λ · (fitted s/token) = 500 × {gpu.per_token_s:.3g} = {credit:.3g} s of "
        f"credit per s waited, while a cold 14K-token profile costs {cold:.2f} s against {warm * 1e3:.1f} ms for a warm post: "
        f"ranked on its own (CSJF), a cold request overtakes waiting warm ones only after ~{(cold - warm) / credit:.0f} s, and "
        "so does every queued post of the same user (cold too until the profile is cached). That is CSJF's P99 tail "
        "where the cache has room for everyone (there FCFS loses no hits and its P99 is lower). CSJF+groups ranks the "
        "profile for the group it makes warm, (its cost + the followers' warm costs) / (1 + followers), minus the oldest "
        "member's credit, so it runs after a fraction of that wait.",
        f"Per-user bursts: a user's requests come 0.1 s apart but its first (cold) one takes ~{cold:.1f} s on the GPU model, "
        "so the next few queue behind it even at low load: low-load latency is not the warm service time.",
        f"Batched steps: the GPU model has no fixed cost per step ({gpu.fixed_s:g} s), so a step costs exactly the sum of its "
        "members and batching adds no throughput; what it changes is that every member completes at its step's end (a "
        "warm post batched with others waits for their forward too). A cold 14K profile is over the 8192-token budget, so "
        "it always runs alone.",
    ]
    tight = next((sc for sc in scenarios if sc["scenario"].get("key") == "post-rec-16g"), None)
    if tight:
        by = {(r["load"], r["policy"]): r for r in tight["runs"]}
        top = max(r["load"] for r in tight["runs"])
        hit_thr = ", ".join(f"{_label(p)} {by[(top, p)]['hit_rate']:.1%} / {_f(by[(top, p)]['throughput_qps'])} req/s"
                            for p in POLICIES if (top, p) in by)
        out.append(f"With 16 GiB ({tight['cache_blocks_per_engine']:,} blocks for {tight['profile_blocks']:,} profile blocks) "
                   "the cache cannot hold every profile: whoever runs a profile while another user's posts still wait can "
                   "evict that user's profile, and every miss re-runs a ~0.5 s profile. FCFS interleaves users, and CSJF+groups "
                   "runs new profiles early (the dependency rule): both lose hits and throughput as load grows; CSJF and SJF "
                   f"defer cold profiles and keep them. At {top:g}× (hit rate / thr): {hit_thr} (the trace is finite, so thr "
                   "above 1× is bounded by the arrival spread).")
    dep = next((sc for sc in scenarios if sc["scenario"].get("key") == "dependency-paper"), None)
    if dep:
        by = {(r["load"], r["policy"]): r for r in dep["runs"]}
        loads = sorted({r["load"] for r in dep["runs"]})
        pairs = [(ld, by[(ld, "csjf")], by[(ld, "csjf-independent")]) for ld in loads
                 if (ld, "csjf") in by and (ld, "csjf-independent") in by]
        if pairs:
            mean_r = [g["mean_latency_s"] / c["mean_latency_s"] for _, g, c in pairs]
            p99_r = [g["p99_latency_s"] / c["p99_latency_s"] for _, g, c in pairs]
            same_hits = all(abs(g["hit_rate"] - c["hit_rate"]) < 5e-4 for _, g, c in pairs)
            worse = [ld for (ld, g, c) in pairs if g["mean_latency_s"] > 1.02 * c["mean_latency_s"]]
            text = (f"Dependency rule (the \"{dep['scenario']['name']}\" table): CSJF+groups / CSJF P99 "
                    f"{min(p99_r):.2f}-{max(p99_r):.2f}, mean {min(mean_r):.2f}-{max(mean_r):.2f} over loads "
                    f"{loads[0]:g}-{loads[-1]:g}× (same arrivals" + (", same hit rate" if same_hits else "") + "). ")
            if worse:
                text += (f"The tail is the gain; from {worse[0]:g}× on the mean is the price: the profile now runs ahead of warm "
                         "posts, and each waits its ~0.5 s. Smith's rule itself would keep warm requests first (a group's "
                         "average, (cold + n warm) / (n + 1), never falls below one warm request's cost); what moves the group "
                         "earlier is the oldest member's starvation credit, shared over the group. The rule lowers the mean where "
                         "a group competes with costlier requests: other cold profiles (tests/cache_scheduler/test_simulator.py, a burst of "
                         "new users).")
            out.append(text.strip())
    per = (pick_s_per_waiting or {}).get("csjf")
    if per:
        text = (f"CSJF's pick walks every waiting request's block list through PrefixIndex.match_length on every step "
                f"(CSJF+groups a second time to find the groups): ~{per * 1e6:.0f} µs per waiting request when its profile "
                f"is cached (~220 blocks; this shared host's Python, it drifts between runs), so ~{300 * per * 1e3:.0f} ms per "
                f"step at 300 waiting against a ~{warm * 1e3:.0f} ms warm forward")
        charged = next((sc for sc in scenarios if sc["scenario"].get("charge_pick")), None)
        free = next((sc for sc in scenarios if sc["scenario"].get("key") == "post-rec-16g"), None)
        if charged and free:
            base = {(r["load"], r["policy"]): r["mean_latency_s"] for r in free["runs"]}
            extra = [(r["mean_latency_s"] / base[(r["load"], r["policy"])] - 1, r["load"], r["policy"]) for r in charged["runs"]
                     if (r["load"], r["policy"]) in base]
            worst, load, policy = max(extra)
            text += (f"; charged to the clock (one pick per step), it adds at most {worst:.1%} to a mean latency "
                     f"({_label(policy)} at {load:g}×; the \"pick time charged\" table against the plain 16 GiB one)")
        out.append(text + ".")
    return out


def plot(data: dict, path: Path) -> bool:
    plt = bu.pyplot()
    if plt is None:
        return False
    scs = data["scenarios"]
    cols = min(3, len(scs))
    rows = math.ceil(len(scs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, sc in zip(axes.flat, scs):
        for p in POLICIES:
            runs = sorted((r for r in sc["runs"] if r["policy"] == p), key=lambda r: r["offered_qps"])
            if not runs:
                continue
            x = [r["offered_qps"] for r in runs]
            ax.plot(x, [r["mean_latency_s"] for r in runs], "-o", ms=3, color=COLORS[p], label=f"{_label(p)} mean")
            ax.plot(x, [r["p99_latency_s"] for r in runs], "--", color=COLORS[p], alpha=0.7, label=f"{_label(p)} P99")
        ax.axvline(sc["saturated_qps"], color="gray", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("offered QPS (req/s); dotted: saturation")
        ax.set_ylabel("latency (s)")
        ax.set_title(sc["scenario"]["name"], fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(scs):]:
        ax.axis("off")
    handles = {}  # every policy's lines, from whichever panels drew them, in POLICIES order
    for ax in axes.flat[: len(scs)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [f"{_label(p)} {m}" for p in POLICIES for m in ("mean", "P99") if f"{_label(p)} {m}" in handles]
    spare = axes.flat[len(scs)] if len(scs) < axes.size else axes.flat[0]
    spare.legend([handles[k] for k in order], order, fontsize=7, loc="center" if spare is not axes.flat[0] else "best")
    return bu.save_figure(plt, fig, path, dpi=80)


# -- the fleet: Envoy's routing policies at paper scale ---------------------------------------------
FLEET_SECTION = "## Fleet routing simulation"
FLEET_SKEWED_SECTION = "## Fleet routing simulation, skewed users in bursts"
FLEET_SKEWED_ROUTINGS = ("picker", "maglev_bounded", "least_request")  # the issue's comparison; the others are slow at this size


def fleet_is_skewed(data: dict) -> bool:
    return bool(data.get("posts_zipf")) or data.get("burst_mean", 1.0) != 1.0
FLEET_ROUTINGS = ("picker", "maglev_bounded", "ring_hash_bounded", "least_request", "random")


def routing_moves(routing: str, engines: int, users: list) -> dict:
    """Through the simulator's Router on an idle fleet: the fraction of `users` whose engine
    changes when engine engines // 2 leaves (failover) and when engine `engines` joins (scale-up),
    split by perf/envoy_hashing.classify_moves (as perf/bench_placement splits the real Envoy's)."""
    out = {}
    for event, after in (("failover", [e for e in range(engines) if e != engines // 2]), ("scale-up", list(range(engines + 1)))):
        router = Router(routing, engines, np.random.default_rng(0))
        idle = [0] * (engines + 1)
        before = {u: router.route(u, idle) for u in users}
        router.set_engines(after)
        out[event] = classify_moves(before, {u: router.route(u, idle) for u in users}, range(engines), after)
    return out


def run_fleet(engines: int = 64, users: int = 20_000, posts_per_user: int = 4, cache_gib: float = 16.0, load: float = 0.8,
              seed: int = 0, block_size: int = 256, mfu: float = 0.5, routings=FLEET_ROUTINGS, profile_mean: float = 14_000,
              posts_zipf: float = 0.0, burst_mean: float = 1.0, cost: "CostModel | None" = None,
              work_weight: float = DEFAULT_WORK_WEIGHT) -> dict:
    """The post-recommendation trace from `users` users over `engines` H200 engines (8B cost
    model, `cache_gib` of prefix cache each), Poisson user arrivals at `load` x the fleet's
    saturated rate, one run per routing policy on the same arrivals. `posts_zipf` > 0: skewed
    users (workloads.post_counts); `burst_mean` > 1: users arrive in bursts of that many on average.
    `cost`: another engine model (e.g. the real fleet's CPU replicas); `work_weight`: the picker's."""
    cost = cost or gpu_cost_model(mfu=mfu)
    scale = wl.PostRecScale(users=users, posts_per_user=posts_per_user, profile_mean=profile_mean, posts_zipf=posts_zipf)
    work = post_rec_workload(scale, seed, block_size)
    sat = saturated_qps(work, cost, engines)
    reqs = work.with_arrivals(load * sat, burst_mean)
    blocks = cache_blocks_for(cache_gib, cost, block_size)
    bu.log(f"fleet: {work.summary()}; {engines} engines, saturated {sat:.3g} req/s, offered {load:g}x; cache {blocks:,} blocks/engine")
    runs = []
    for routing in routings:
        res = simulate(reqs, cost, SimConfig(policy="csjf", engines=engines, cache_blocks=blocks, seed=seed, routing=routing,
                                             picker_work_weight=work_weight), block_size)
        out = res.summary(load * sat)
        out["routing"] = routing
        engines_per_user = Counter(u for e in res.engines for u in e["users"])
        out["users_split"] = sum(1 for n in engines_per_user.values() if n > 1) / users
        runs.append(out)
        bu.log(f"  {routing}: mean {out['mean_latency_s']:.3g} s, P99 {out['p99_latency_s']:.3g} s, hit {out['hit_rate']:.1%}, "
               f"imbalance {out['load_imbalance']:.2f} [{out['sim_wall_s']:.0f} s]")
    names = sorted({r.user for r in reqs})
    moves = [{"routing": routing, "engines": n, **routing_moves(routing, n, names)} for routing in HASHED for n in (3, engines)]
    return {"engines": engines, "users": users, "posts_per_user": posts_per_user, "requests": len(reqs), "cache_gib": cache_gib,
            "posts_zipf": posts_zipf, "burst_mean": burst_mean, "max_posts_per_user": max(wl.post_counts(scale, seed)),
            "arrival_span_s": max(r.arrival_s for r in reqs),
            "load": load, "saturated_qps": sat, "block_size": block_size, "cost_formula": cost.describe(),
            "ideal_hit_rate": 1 - perfect_cache_tokens(work) / work.prompt_tokens, "runs": runs, "moves": moves}


def sweep_work_weight(a) -> str:
    """The picker at each of --fleet-work-weights against Maglev-bounded on the same arrivals (a
    markdown table): how much of a fleet's gap the compute term's weight decides."""
    cost = cpu_cost_model(per_token_s=a.fleet_cpu_per_token_s) if a.fleet_cpu_per_token_s else None
    lines = [f"Command: `{bu.command_line()}` ({bu.now_iso()}).", "",
             "| work weight | picker mean s | P99 s | hit | Maglev-bounded mean s | P99 s | hit | mean ratio | P99 ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in (float(x) for x in a.fleet_work_weights.split(",")):
        d = run_fleet(engines=a.fleet_engines, users=a.fleet_users, posts_per_user=a.fleet_posts, load=a.fleet_load, seed=a.seed,
                      mfu=a.mfu, profile_mean=a.fleet_profile_mean, posts_zipf=a.fleet_zipf, burst_mean=a.fleet_burst,
                      routings=("picker", "maglev_bounded"), block_size=DEFAULT_BLOCK, cost=cost, work_weight=w)
        p, m = ({r["routing"]: r for r in d["runs"]}[k] for k in ("picker", "maglev_bounded"))
        lines.append(f"| {w:g} | {p['mean_latency_s']:.3g} | {p['p99_latency_s']:.3g} | {p['hit_rate']:.1%} | {m['mean_latency_s']:.3g} | "
                     f"{m['p99_latency_s']:.3g} | {m['hit_rate']:.1%} | {p['mean_latency_s'] / m['mean_latency_s']:.2f}x | "
                     f"{p['p99_latency_s'] / m['p99_latency_s']:.2f}x |")
    return "\n".join(lines)


def render_fleet(data: dict) -> str:
    skew = (f" Skewed users: post counts Zipf (s = {data['posts_zipf']:g}), the hottest user {data['max_posts_per_user']:,} posts; "
            f"users arrive in bursts of {data['burst_mean']:g} on average; arrivals span {data['arrival_span_s']:.0f} s."
            if fleet_is_skewed(data) else "")
    lines = [f"Command: `{data['command']}` ({data['date']}; {bu.machine_line(data['machine'])}). {data['users']:,} users x {data['posts_per_user']} posts "
             f"({data['requests']:,} requests), {data['engines']} engines ({data['cost_formula']}), "
             f"{data['cache_gib']:g} GiB prefix cache each, Poisson users at {data['load']:g}x the fleet's saturated "
             f"{data['saturated_qps']:.3g} req/s; hit rate with a perfect cache {data['ideal_hit_rate']:.1%}.{skew}", "",
             "| routing | hit rate | mean latency s | P99 s | throughput req/s | load imbalance (max/mean) | users split over engines |",
             "|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r['routing']} | {r['hit_rate']:.1%} | {_f(r['mean_latency_s'])} | {_f(r['p99_latency_s'])} | "
                     f"{_f(r['throughput_qps'])} | {r['load_imbalance']:.2f} | {r['users_split']:.1%} |")
    if data.get("moves"):
        lines += ["", f"Users moved when one engine leaves (failover) or one joins (scale-up), the trace's {data['users']:,} users "
                  "through the same Router on an idle fleet (Envoy's tables, as perf/bench_placement.py measures them):", "",
                  "| routing | engines | event | moved | forced (engine gone) | to the new engine | between kept engines |",
                  "|---|---|---|---|---|---|---|"]
        for m in data["moves"]:
            for event in ("failover", "scale-up"):
                e = m[event]
                lines.append(f"| {m['routing']} | {m['engines']} | {event} | {e['moved']:.1%} | {e['forced']:.1%} | "
                             f"{e['to_new']:.1%} | {e['between_kept']:.2%} |")
    return "\n".join(lines) + "\n"


def merge_results(previous: dict, new: dict, order: list[Scenario]) -> dict:
    """`new` (a --scenario run) merged into the stored results `previous`: its scenarios replace
    those with the same id, the others are kept (each with the command and date it was run with),
    in the default sweep's order; the pick-cost table is kept unless `new` measured one. Only
    results of this RESULTS_FORMAT are merged (older ones came from another simulator)."""
    if previous.get("format") != RESULTS_FORMAT or not previous.get("scenarios"):
        return new
    by_id = {sc["scenario"].get("key") or sc["scenario"]["name"]: sc for sc in previous["scenarios"]}
    for sc in previous["scenarios"]:
        sc.setdefault("command", previous["command"])
        sc.setdefault("date", previous["date"])
    by_id.update({sc["scenario"].get("key") or sc["scenario"]["name"]: sc for sc in new["scenarios"]})
    out = dict(previous)
    out["scenarios"] = [by_id[sc.id] for sc in order if sc.id in by_id]
    out["pick_cost"] = new.get("pick_cost") or previous.get("pick_cost")
    out["updates"] = previous.get("updates", []) + [{"command": new["command"], "date": new["date"],
                                                    "scenarios": [sc["scenario"]["name"] for sc in new["scenarios"]]}]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="cpu-scale traces, 4 loads, prints only (smoke run)")
    p.add_argument("--scenario", metavar="NAME_SUBSTRING",
                   help="run only the scenarios whose key or name contains this (case-insensitive); the results are "
                        "merged into the stored ones")
    p.add_argument("--loads", type=float, nargs="+",
                   help=f"multiples of saturation (default {' '.join(map(str, DEFAULT_LOADS))}; the dependency-rule scenario "
                        f"{' '.join(map(str, DEPENDENCY_LOADS))})")
    p.add_argument("--policies", nargs="+", choices=POLICIES, help="default: each scenario's (all but SJF in the dependency one)")
    p.add_argument("--max-batch-tokens", type=int, help="a step's uncached-token budget (default: the engine's device default; 1 = unbatched)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK)
    p.add_argument("--mfu", type=float, default=0.5, help="GPU cost model: fraction of 989 TFLOP/s")
    p.add_argument("--noise", type=float, default=0.0, help="sigma of log-normal service-time noise")
    p.add_argument("--pick-sizes", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--pick-cost-only", action="store_true")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and results/ alone")
    p.add_argument("--fleet", action="store_true", help="only the fleet routing comparison (Envoy policies, 64 engines, 20K users)")
    p.add_argument("--fleet-users", type=int, default=20_000)
    p.add_argument("--fleet-engines", type=int, default=64)
    p.add_argument("--fleet-zipf", type=float, default=0.0, help="--fleet with Zipf-skewed users (e.g. 1.0): its own section")
    p.add_argument("--fleet-burst", type=float, default=1.0, help="--fleet with users arriving in bursts of this many on average")
    p.add_argument("--fleet-posts", type=int, default=4, help="--fleet: posts per user (the mean, with --fleet-zipf)")
    p.add_argument("--fleet-profile-mean", type=float, default=14_000, help="--fleet: profile tokens, mean")
    p.add_argument("--fleet-load", type=float, default=0.8, help="--fleet: offered load, a multiple of the saturated rate")
    p.add_argument("--fleet-cpu-per-token-s", type=float, default=None,
                   help="--fleet on CPU replicas costing this many seconds a token (e.g. 3e-3: perf/bench_fleet.py's one-thread "
                        "float32 replicas) instead of H200 engines")
    p.add_argument("--fleet-work-weights", default=None,
                   help="--fleet: comma list of picker work weights, one picker run each against Maglev-bounded (printed only)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.fleet and a.fleet_work_weights:
        print(sweep_work_weight(a))
        return 0
    if a.fleet:
        skewed = bool(a.fleet_zipf) or a.fleet_burst != 1.0
        data = run_fleet(engines=a.fleet_engines, users=a.fleet_users, seed=a.seed, mfu=a.mfu, posts_zipf=a.fleet_zipf,
                         burst_mean=a.fleet_burst, routings=FLEET_SKEWED_ROUTINGS if skewed else FLEET_ROUTINGS)
        data.update(command=bu.command_line(), date=bu.now_iso(), machine=bu.machine_info(1))
        if not a.no_write:
            name, section = ("simulate_fleet_skewed.json", FLEET_SKEWED_SECTION) if skewed else ("simulate_fleet.json", FLEET_SECTION)
            bu.save_json(bu.PERF_DIR / "results" / name, data)
            bu.replace_section(bu.PERF_DIR / "RESULTS.md", section, render_fleet(data))
        return 0

    every = default_scenarios(a.quick)
    selected = [] if a.pick_cost_only else select_scenarios(every, a.scenario)
    if a.scenario and not selected:
        p.error(f"no scenario matches {a.scenario!r}; scenarios: " + "; ".join(f"{sc.key} ({sc.name})" for sc in every))
    t0 = time.perf_counter()
    pick, per_waiting = [], {}
    if a.pick_cost_only or not a.scenario or any(sc.charge_pick for sc in selected):
        bu.log("pick cost (paper-scale post-rec hash lists)")
        pick = measure_pick_cost(tuple(a.pick_sizes), a.block_size, reps=3 if a.quick else 5)
        # per waiting request, profiles cached, at the smallest size measured: what the charged scenario uses
        smallest = min(a.pick_sizes)
        per_waiting = {r["policy"]: r["per_request_us"] * 1e-6 for r in pick if r["profiles_cached"] and r["waiting"] == smallest}
    quick_loads = [0.25, 0.9, 2.0, 4.0]
    command, date = bu.command_line(), bu.now_iso()
    scenarios = []
    for sc in selected:
        loads = a.loads or (quick_loads if a.quick else list(sc.loads or DEFAULT_LOADS))
        policies = [q for q in POLICIES if q in (a.policies or sc.policies or POLICIES)]
        out = run_scenario(sc, loads, policies, a.seed, a.block_size, a.mfu, a.noise, per_waiting, a.max_batch_tokens)
        out.update(command=command, date=date, wall_s=sum(r["sim_wall_s"] for r in out["runs"]))
        scenarios.append(out)
        bu.log(f"  [{out['wall_s']:.0f} s of simulation]")
    bu.log(f"done in {time.perf_counter() - t0:.0f} s")
    if a.no_write or a.pick_cost_only or a.quick:
        return 0
    data = {"format": RESULTS_FORMAT, "command": command, "date": date, "machine": bu.machine_info(1), "seed": a.seed,
            "noise": a.noise, "cost_models": {"gpu": gpu_cost_model(mfu=a.mfu).describe(), "cpu": cpu_cost_model().describe()},
            "scenarios": scenarios, "pick_cost": pick, "total_wall_s": time.perf_counter() - t0}
    path = bu.PERF_DIR / "results" / "simulate.json"
    if a.scenario:
        data = merge_results(bu.load_json(path), data, every)
    data["notes"] = notes(gpu_cost_model(mfu=a.mfu), {r["policy"]: r["per_request_us"] * 1e-6 for r in data.get("pick_cost") or []
                                                       if r["profiles_cached"] and r["waiting"] == min(a.pick_sizes)},
                          data["scenarios"])
    png = bu.PERF_DIR / "results" / "simulate.png"
    data.pop("plot", None)
    if plot(data, png):
        data["plot"] = "results/simulate.png"
    bu.save_json(path, data)
    bu.replace_section(bu.PERF_DIR / "RESULTS.md", SECTION, render(data))
    bu.log("wrote perf/results/simulate.json, perf/results/simulate.png and the RESULTS.md section")
    return 0


if __name__ == "__main__":
    sys.exit(main())
