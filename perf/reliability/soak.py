"""The soak: mixed requests from many users (cache namespaces) against one stack, every request's
outcome, and the memory of every process of the stack sampled every second."""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clients.transport import MODEL, Answer, GrpcStream, generate_answer, stream_answer
from perf import benchutil as bu
from perf.reliability.stack import YES_NO, Stack


WORDS = """
hiking alpine trail summit river canyon forest camping tent backpack compass sunrise glacier meadow
cooking recipe garlic basil pasta risotto sourdough espresso bakery spice curry noodle dumpling
football striker goalkeeper league derby transfer tactics stadium marathon cycling tennis rowing
jazz saxophone vinyl concert orchestra guitar synth playlist festival opera drummer chorus
finance stocks bonds dividend inflation mortgage budget savings pension crypto index portfolio
science physics quantum telescope galaxy neutron enzyme genome fossil volcano climate satellite
travel airport passport ferry hostel museum cathedral bazaar harbor lighthouse vineyard island
gaming console strategy puzzle speedrun arcade pixel dungeon quest multiplayer tournament
gardening tulip compost orchard greenhouse seedling pruning lavender cactus irrigation
parenting toddler school homework bedtime picnic playground birthday lullaby stroller
fashion denim linen sneakers tailoring vintage scarf jacket boutique runway knitwear
photography lens aperture portrait landscape darkroom tripod exposure shutter film
history empire dynasty archive manuscript revolution medieval pharaoh treaty monument
technology laptop compiler database kernel router sensor robot drone battery startup
reading novel poetry library author thriller memoir essay paperback chapter sequel
likes enjoys follows reads watches shares prefers avoids dislikes collects visits bookmarks
often rarely weekly daily recently mostly usually sometimes never always eagerly quietly
new old local remote cheap premium quick slow rare popular classic modern indie handmade
""".split()
ITEM_TEMPLATE = "\nPost: {item}\nWould the user click on this post? Answer:"
KIND_SHARES = (("single", 0.70), ("multi_item", 0.10), ("multi_prompt", 0.10), ("bad", 0.10))
EXPECTED_RESULTS = {"single": 1, "multi_item": 4, "multi_prompt": 3, "bad": 0}


def token_counter():
    """Token count of a text with the default model's tokenizer (the converted model's folder)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(bu.default_model_dir()) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = rng.choices(WORDS, k=rng.randint(lo, hi))
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", ";"])


def text_of_tokens(rng: random.Random, count, target: int, lo: int = 6, hi: int = 16) -> str:
    """Sentences of varied words until about `target` tokens."""
    sentences, total = [], 0
    while total < target:
        s = sentence(rng, lo, hi)
        sentences.append(s)
        total += count(" " + s)
    return " ".join(sentences)


@dataclass
class User:
    namespace: str
    profile: str
    profile_tokens: int


def make_users(n: int, seed: int, count, profile_tokens=(300, 900)) -> list[User]:
    """n users, each a profile of profile_tokens (lo, hi) tokens, the same for the same seed."""
    users = []
    for u in range(n):
        rng = random.Random(seed * 1_000_003 + u)
        profile = f"User {u} profile: " + text_of_tokens(rng, count, rng.randint(*profile_tokens))
        users.append(User(f"soak-user-{u:04d}", profile, count(profile)))
    return users


def make_post(rng: random.Random, count) -> str:
    return text_of_tokens(rng, count, rng.randint(30, 60), 5, 12)


@dataclass
class Job:
    index: int
    kind: str  # single | multi_item | multi_prompt | bad
    transport: str  # http_generate | grpc_stream
    user: str
    fields: dict


BAD_VARIANTS = (
    ("duplicate allowed", lambda f: {**f, "allowed_tokens": [" Yes", " Yes"]}),
    ("two-token allowed", lambda f: {**f, "allowed_tokens": ["Yes please"]}),
    ("no allowed tokens", lambda f: {k: v for k, v in f.items() if k != "allowed_tokens"}),
    ("allowed id out of vocabulary", lambda f: {**{k: v for k, v in f.items() if k != "allowed_tokens"},
                                                "allowed_token_ids": [1_000_000]}),
    ("item_template without {item}", lambda f: {**f, "items": ["a post"], "item_template": "\nPost: none\nAnswer:"}),
)


def make_job(index: int, rng: random.Random, users: list[User], count) -> Job:
    user = rng.choice(users)
    r, kind = rng.random(), KIND_SHARES[-1][0]
    for name, share in KIND_SHARES:
        if r < share:
            kind = name
            break
        r -= share
    base = {"allowed_tokens": YES_NO, "user": user.namespace, "cache_prefix_len": user.profile_tokens}
    if kind == "multi_item":
        fields = {**base, "text_input": user.profile, "items": [make_post(rng, count) for _ in range(4)], "item_template": ITEM_TEMPLATE}
    elif kind == "multi_prompt":
        fields = {**base, "text_input": [user.profile + ITEM_TEMPLATE.replace("{item}", make_post(rng, count)) for _ in range(3)]}
    else:
        fields = {**base, "text_input": user.profile + ITEM_TEMPLATE.replace("{item}", make_post(rng, count))}
        if kind == "bad":
            fields = BAD_VARIANTS[index % len(BAD_VARIANTS)][1](fields)
    return Job(index, kind, rng.choice(("http_generate", "grpc_stream")), user.namespace, fields)


def make_jobs(n: int, users: list[User], seed: int, count) -> list[Job]:
    rng = random.Random(seed)
    return [make_job(i, rng, users, count) for i in range(n)]


# -- the load ----------------------------------------------------------------------------------
def outcome_of(job: Job, answer: Answer) -> str:
    """ok | expected_error | unexpected_error | unexpected_ok | wrong_answer | lost | transport."""
    if answer.kind in ("lost", "transport"):
        return answer.kind
    if job.kind == "bad":
        return "expected_error" if answer.kind == "error" else "unexpected_ok"
    if answer.kind == "error":
        return "unexpected_error"
    return "ok" if len(answer.results) == EXPECTED_RESULTS[job.kind] else "wrong_answer"


def record(job: Job, answer: Answer, t_sent: float) -> dict:
    peaks = [r.get("peak_bytes") for r in answer.results if r.get("peak_bytes") is not None]
    return {"index": job.index, "kind": job.kind, "transport": job.transport, "user": job.user, "t_sent": t_sent,
            "seconds": answer.seconds, "outcome": outcome_of(job, answer), "status": answer.status,
            "message": "" if answer.kind == "ok" else answer.message[:160],
            "results": len(answer.results), "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in answer.results),
            "cached_tokens": sum(r.get("cached_tokens", 0) for r in answer.results),
            "peak_bytes": max(peaks) if peaks else None}


def soak_worker(stack: Stack, jobs: queue.Queue, records: list, t0: float, timeout: float) -> None:
    """Takes jobs until none are left, one request in flight; its own gRPC stream, reopened when it ends."""
    stream = None
    try:
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            t_sent = time.monotonic() - t0
            try:
                if job.transport == "http_generate":
                    answer = generate_answer(stack.http_url, job.fields, timeout)
                else:
                    stream = stream or GrpcStream(stack.grpc_url)
                    answer = stream_answer(stream, job.fields, timeout)
                    if stream.broken:
                        stream.close()
                        stream = None
            except Exception as e:  # a client-side failure must not stop the worker (its jobs would never be sent)
                answer = Answer("transport", "EXC", f"client: {type(e).__name__}: {e}")
            records.append(record(job, answer, t_sent))  # list.append is atomic
    finally:
        if stream is not None:
            stream.close()


class Sampler(threading.Thread):
    """Every `interval` s: VmRSS of every process of the stack and the engine's metrics."""

    METRICS = {"cache_tier1_bytes": 'prefillonly_cache_bytes{tier="1"}', "cache_tier2_bytes": 'prefillonly_cache_bytes{tier="2"}',
               "waiting": "prefillonly_waiting_requests",
               "completed": 'prefillonly_requests_total{outcome="completed"}',
               "failed": 'prefillonly_requests_total{outcome="failed"}',
               "tokens_computed": 'prefillonly_prompt_tokens_total{source="computed"}',
               "tokens_cached": 'prefillonly_prompt_tokens_total{source="cache"}'}
    BUDGETS = ("weights", "activation", "cache_tier1", "cache_tier2")

    def __init__(self, stack: Stack, t0: float, interval: float = 1.0):
        super().__init__(name="reliability-sampler", daemon=True)
        self.stack, self.t0, self.interval = stack, t0, interval
        self.samples: list[dict] = []
        self.budgets: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.sample())
            except Exception as e:  # e.g. mid-restart; the next sample tries again
                bu.log(f"  sample failed: {type(e).__name__}: {e}")
            self.done.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def sample(self) -> dict:
        from prefillonly.serving.host.prometheus import scrape_metrics

        row = {"t_s": round(time.monotonic() - self.t0, 2)}
        for role, pids in self.stack.processes().items():
            sizes = [bu.rss_bytes(pid) for pid in pids]
            # several stubs of one model: their sum (shared pages counted once per process)
            row[f"rss {role}"] = sum(x for x in sizes if x is not None) if any(x is not None for x in sizes) else None
            row[f"n {role}"] = len(pids)
        try:
            values = scrape_metrics(self.stack.metrics_url, prefixes=("prefillonly_",))
        except Exception:  # server down: the RSS columns say more
            values = {}
        for column, key in self.METRICS.items():
            row[column] = values.get(key)
        for kind in self.BUDGETS:
            value = values.get(f'prefillonly_memory_budget_bytes{{kind="{kind}"}}')
            if value is not None:
                self.budgets[kind] = value
        return row


def run_soak(stack: Stack, jobs: list[Job], concurrency: int, timeout: float, interval: float) -> dict:
    t0 = time.monotonic()
    sampler = Sampler(stack, t0, interval)
    sampler.start()
    time.sleep(3 * interval + 0.5)  # the baseline: a few samples before any traffic
    work: queue.Queue = queue.Queue()
    for job in jobs:
        work.put(job)
    records: list[dict] = []
    t_traffic = time.monotonic() - t0
    workers = [threading.Thread(target=soak_worker, args=(stack, work, records, t0, timeout), daemon=True)
               for _ in range(concurrency)]
    for w in workers:
        w.start()
    progress_every = max(1, len(jobs) // 10)
    last_logged = 0
    while any(w.is_alive() for w in workers):
        time.sleep(1.0)
        if len(records) - last_logged >= progress_every:
            last_logged = len(records)
            s = sampler.samples[-1]
            bu.log(f"  {len(records)}/{len(jobs)} answered in {time.monotonic() - t0 - t_traffic:.0f} s; "
                   f"engine stub RSS {mib(engine_rss(s))} MiB, cache {mib(s.get('cache_tier1_bytes'))} MiB")
    t_end = time.monotonic() - t0
    time.sleep(2 * interval)  # a couple of samples after the last answer
    sampler.done.set()
    sampler.join(10)
    return {"t_traffic_s": t_traffic, "t_end_s": t_end, "records": sorted(records, key=lambda r: r["index"]),
            "samples": sampler.samples, "budgets": sampler.budgets, "health": stack.health()}


# -- the numbers -------------------------------------------------------------------------------
def mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def engine_rss(sample: dict):
    return sample.get(f"rss stub {MODEL}")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def column_values(samples: list[dict], column: str, lo: float = -1e12, hi: float = 1e12) -> list[float]:
    """The samples' values of `column` taken between lo and hi seconds."""
    return [s[column] for s in samples if lo <= s["t_s"] <= hi and s.get(column) is not None]


def windows(t_traffic: float, t_end: float) -> dict[str, tuple[float, float]]:
    """The parts of the run the plateau is judged on (seconds since the sampler started)."""
    span = max(t_end - t_traffic, 1e-9)
    return {"baseline": (-1e12, t_traffic), "first_30": (t_traffic, t_traffic + 0.3 * span),
            "first_70": (t_traffic, t_traffic + 0.7 * span), "last_30": (t_end - 0.3 * span, 1e12)}


def rss_table(samples: list[dict], t_traffic: float, t_end: float) -> dict[str, dict]:
    """Per process: baseline (median before traffic), max over the first 30% / 70% and the last
    30% of the traffic, max overall, final."""
    roles = sorted({k[4:] for s in samples for k in s if k.startswith("rss ")})
    w = windows(t_traffic, t_end)
    table = {}
    for role in roles:
        column = f"rss {role}"
        base, everything = column_values(samples, column, *w["baseline"]), column_values(samples, column)
        table[role] = {
            "baseline": statistics.median(base) if base else None,
            **{f"max_{name}": max(column_values(samples, column, *w[name]), default=None)
               for name in ("first_30", "first_70", "last_30")},
            "max": max(everything, default=None),
            "final": everything[-1] if everything else None,
            "processes": max((s.get(f"n {role}") or 0 for s in samples), default=0),
        }
    return table


def plateau(samples: list[dict], t_traffic: float, t_end: float) -> dict:
    """Engine RSS growth from the first 70% to the last 30% of the run, and how much of it the
    prefix cache's own growth explains (RSS rises with the cache until the cache is full)."""
    w = windows(t_traffic, t_end)
    column = f"rss stub {MODEL}"

    def growth(col):
        early, late = column_values(samples, col, *w["first_70"]), column_values(samples, col, *w["last_30"])
        return (max(late) - max(early)) if early and late else None

    rss, cache = growth(column), growth("cache_tier1_bytes")
    return {"rss_growth": rss, "cache_growth": cache,
            "unexplained_growth": None if rss is None or cache is None else rss - cache}


def summarise_soak(soak: dict, args) -> dict:
    records, samples, budgets = soak["records"], soak["samples"], soak["budgets"]
    outcomes = Counter(r["outcome"] for r in records)
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(f"{r['kind']} / {r['transport']}", Counter())[r["outcome"]] += 1
    latency = {}
    for kind, _ in KIND_SHARES:
        secs = [r["seconds"] for r in records if r["kind"] == kind and r["outcome"] in ("ok", "expected_error")]
        latency[kind] = {"p50_s": percentile(secs, 50), "p99_s": percentile(secs, 99), "max_s": max(secs, default=float("nan"))}
    unexpected = Counter(f"{r['outcome']}: {r['status']} {r['message'][:100]}" for r in records
                         if r["outcome"] not in ("ok", "expected_error"))
    peaks = [r["peak_bytes"] for r in records if r["peak_bytes"] is not None]
    table = rss_table(samples, soak["t_traffic_s"], soak["t_end_s"])
    engine = table.get(f"stub {MODEL}", {})
    activation_peak = max(peaks, default=0)
    cache_budget = budgets.get("cache_tier1", 0) + budgets.get("cache_tier2", 0)
    bound_baseline = (engine.get("baseline") or 0) + cache_budget + activation_peak
    bound_budget = budgets.get("weights", 0) + cache_budget + activation_peak
    max_cache = max((s.get("cache_tier1_bytes") or 0 for s in samples), default=0)
    traffic = [s for s in samples if s["t_s"] >= soak["t_traffic_s"]]
    first, last = (traffic[0] if traffic else {}), (samples[-1] if samples else {})

    def delta(key):
        return (last.get(key) or 0) - (first.get(key) or 0)

    computed, cached = delta("tokens_computed"), delta("tokens_cached")
    duration = soak["t_end_s"] - soak["t_traffic_s"]
    return {
        "requests": len(records), "duration_s": duration, "requests_per_s": len(records) / duration if duration else 0,
        "outcomes": outcomes, "by_kind": by_kind, "latency": latency, "unexpected": unexpected,
        "answered_ok": outcomes.get("ok", 0), "answered_error": outcomes.get("expected_error", 0) + outcomes.get("unexpected_error", 0),
        "lost": outcomes.get("lost", 0), "transport_failures": outcomes.get("transport", 0),
        "activation_peak_bytes": activation_peak, "budgets": budgets, "rss": table,
        "bound_baseline_bytes": bound_baseline, "bound_budget_bytes": bound_budget,
        "engine_max_rss": engine.get("max"),
        "within_bound": engine.get("max") is not None and engine["max"] <= bound_baseline,
        "within_budget_bound": engine.get("max") is not None and engine["max"] <= bound_budget,
        "max_cache_bytes": max_cache,
        "cache_fill": max_cache / budgets["cache_tier1"] if budgets.get("cache_tier1") else None,
        "plateau": plateau(samples, soak["t_traffic_s"], soak["t_end_s"]),
        "tokens_computed": computed, "tokens_cached": cached,
        "hit_rate": cached / (computed + cached) if computed + cached else 0.0,
        "computed_tokens_per_s": computed / duration if duration else 0.0,
        "users": args.users, "profile_tokens": list(args.profile_tokens), "concurrency": args.concurrency, "timeout_s": args.timeout,
        "health": soak["health"],
    }
