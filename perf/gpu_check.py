"""One-shot GPU check of the hybrid-prefill engine (run by perf/gpu_check.sh on the H200 host).

Four steps, each recorded on its own so that one failure (an OOM, a missing SDPA backend)
does not lose the rest:

  1. correctness  tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints: our bf16 and fp32
                  next-token log-probs against transformers fp32 (and transformers bf16 as the
                  yardstick of bf16 noise), several prompt lengths and chunk sizes, plus the
                  cached-prefix path;
  2. performance  Llama-3.1-8B shape, random weights made on the GPU: prefill tokens/s and MFU
                  (docs/design.md §7) at 8K / 32K / 100K tokens, against the datasheet bf16 peak
                  and a bf16 matmul rate measured in the same run;
  3. memory       peak bytes per token of hybrid prefill, unchunked prefill and transformers on a
                  2-layer model of the 8B width (the peak is per layer), against the engine's own
                  prediction, and the max input length each implies on the card;
  4. attention    torch SDPA alone at those lengths, per backend (default, flash, cuDNN, ...).

Results are rewritten after every row to OUT/gpu_check.json and OUT/gpu_check.md, so a run
cut short by its time limit still leaves what it measured. `--smoke` runs everything on the
CPU with tiny shapes, to test this script on a host without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from perf import benchutil as bu
from prefillonly.worker.executor import ForwardBatch, HybridPrefillExecutor, Sequence
from prefillonly.kernels.backend import KernelBackend
from prefillonly.kernels import gpu_support
from prefillonly.worker.memory import PeakMemoryMeter, predict_peak_bytes
from prefillonly.model.spec import ModelSpec
from prefillonly.model.weights import ModelWeights

# dense bf16 datasheet peaks by the card's name (torch.cuda.get_device_name): the first key found in it
DATASHEET_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def datasheet_bf16_flops() -> float:
    """The card's dense bf16 peak (the MFU denominator); the H100 SXM's where the name is not known."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((flops for key, flops in DATASHEET_BF16_FLOPS.items() if key in name), 989e12)


def card_bytes() -> float:
    """The memory of the card this runs on (an H200's 141 GB where there is none: --smoke)."""
    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 141e9


def backends(device: torch.device) -> list[str]:
    """The attention backends compared side by side: the Triton kernels (where they run) and torch's SDPA."""
    return (["triton"] if gpu_support.runs_on(device) else []) + ["sdpa"]
USABLE_FRACTION = 0.9  # share of the card a deployment would give the engine


# --------------------------------------------------------------------------------------------
# What to run: the full GPU plan and its tiny CPU stand-in
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    device: torch.device
    budget_s: float  # the script stops starting new work when this is spent
    correctness_lengths: tuple[int, ...] = (1, 37, 300)
    correctness_chunks: tuple[int | None, ...] = (None, 7, 64)
    prefix_split: tuple[int, int] = (300, 129)  # prompt length, cached prefix length
    perf_shape: dict = field(default_factory=dict)  # overrides of the Llama-3.1-8B config
    perf_lengths: tuple[int, ...] = (8192, 32768, 100_000)
    perf_chunks: tuple[int, ...] = (2048, 4096)
    warm_shapes: tuple[tuple[int, int], ...] = ((14_000, 150), (16_384, 2048))  # (cached P, new S)
    warm_batch: int = 16  # warm requests of the first warm shape in one batched step (ForwardBatch)
    matmul_n: int = 8192
    memory_lengths: tuple[int, ...] = (8192, 32768, 100_000)
    memory_chunk: int = 2048
    reserve_after_perf_s: float = 75.0  # kept for the memory and attention steps
    seconds_per_config: float = 30.0  # correctness of one tiny checkpoint, generously
    seconds_for_memory: float = 45.0  # the whole memory step


def gpu_plan(budget_s: float) -> Plan:
    return Plan(device=torch.device("cuda"), budget_s=budget_s)


def smoke_plan(budget_s: float) -> Plan:
    # the 8B shape scaled down (4:1 GQA kept); lengths short enough for two shared CPU cores
    shape = dict(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=1, vocab_size=4096, num_hidden_layers=2)
    return Plan(
        device=torch.device("cpu"),
        budget_s=budget_s,
        correctness_lengths=(1, 37, 150),
        prefix_split=(150, 61),
        perf_shape=shape,
        perf_lengths=(256, 512),
        warm_shapes=((256, 64),),
        warm_batch=4,
        perf_chunks=(128, 256),
        matmul_n=512,
        memory_lengths=(256, 512),
        memory_chunk=128,
        reserve_after_perf_s=10.0,
        seconds_per_config=10.0,
        seconds_for_memory=5.0,
    )


# --------------------------------------------------------------------------------------------
# Progress, time budget and the incrementally written report
# --------------------------------------------------------------------------------------------

_START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - _START


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def seconds_left(plan: Plan) -> float:
    return plan.budget_s - elapsed()


# section key -> (title, note shown under the title)
SECTIONS = {
    "env": ("Environment", ""),
    "rates": ("Measured hardware rates", "bf16 matmul, same run; the measured MFU column divides by this."),
    "correctness": (
        "Correctness: next-token log_softmax, max abs difference vs transformers fp32",
        "bf16 passes when ours <= 1.5 x transformers-bf16 + 1e-3; fp32 passes when <= 1e-3 (TF32 off).",
    ),
    "prefix": (
        "Correctness: cached-prefix path",
        "forward(ids[:P], capture=(0,P)) then forward(ids[P:], 64, prefix=captured); same limits as above.",
    ),
    "engine": (
        "Engine on the device: prefix cache, second tier, multi-item, concurrent submits",
        "fp32 (TF32 off), tiny random Llama; each row compares against a cache-less engine's logprobs; passes at <= 1e-3.",
    ),
    "warm": (
        "Cached-prefix speed, Llama-3.1-8B shape: S new tokens after P cached (what a warm post-rec request does)",
        "time of executor.forward(new S, prefix P) vs a cold forward of P+S; model FLOPs per docs/design.md §7 with the prefix. "
        "Rows with batch B: B such requests in one executor.forward_batch step (each loads the same P cached tokens into its own K/V), vs B forwards one by one.",
    ),
    "tuning": (
        "Triton attention tiles, Llama-3.1-8B heads (one layer, causal)",
        "each candidate timed over 5 runs; the fastest is cached in <cache dir>/triton_tiles.json and used by every row below.",
    ),
    "performance": (
        "Prefill speed, Llama-3.1-8B shape (random bf16 weights)",
        "model FLOPs = 2*N*S + 2*L*d*S^2 + 2*d*vocab (docs/design.md §7, no prefix); time = median of reps. "
        "Target (docs/design.md §9): MFU_datasheet >= 0.60 at 8K-32K.",
    ),
    "attention": (
        "Attention alone (torch SDPA, causal, one layer of the perf model's heads)",
        "FLOPs = 2*d*S^2 per layer (causal). gqa=expanded: backend rejected enable_gqa, K/V repeated to the query head count.",
    ),
    "memory": (
        "Peak memory per token, 2-layer model of the Llama-3.1-8B width (peak is per layer)",
        "Peak = allocator peak growth (CPU: RSS high-water growth). MIL = (141e9*0.9 - 8B bf16 weights) / bytes per token; "
        "quote the longest prompt's row (fixed costs amortised).",
    ),
    "errors": ("Errors", ""),
}


class Report:
    """Rows per section; rewrites OUT/gpu_check.json and OUT/gpu_check.md after every row."""

    def __init__(self, out_dir: str, header: dict):
        self.out_dir = out_dir
        self.data = {"header": header, **{key: [] for key in SECTIONS}}
        os.makedirs(out_dir, exist_ok=True)
        self.flush()

    def add(self, section: str, row: dict) -> None:
        self.data[section].append(row)
        log(f"{section}: " + ", ".join(f"{k}={_cell(v)}" for k, v in row.items()))
        self.flush()

    def flush(self) -> None:
        bu.write_atomic(os.path.join(self.out_dir, "gpu_check.json"), json.dumps(self.data, indent=1, default=str))
        bu.write_atomic(os.path.join(self.out_dir, "gpu_check.md"), self.markdown())

    def markdown(self) -> str:
        header = self.data["header"]
        lines = [f"# GPU check ({header['mode']}, {header['device_name']}, {header['date']})", ""]
        for key, (title, note) in SECTIONS.items():
            rows = self.data[key]
            if not rows:
                continue
            lines += [f"## {title}", ""]
            if note:
                lines += [note, ""]
            columns = list(dict.fromkeys(k for row in rows for k in row))  # every key any row has, first seen first
            lines += [bu.markdown_table(columns, [[_cell(row.get(c, "")) for c in columns] for row in rows]), ""]
        return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value).replace("|", "/").replace("\n", " ")


def run_step(report: Report, step: str, fn, *args, **kwargs):
    """Runs one step; an exception becomes a row of the errors table instead of ending the run."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, none is fatal
        report.add("errors", {"step": step, "error": f"{type(exc).__name__}: {exc}"[:400]})
        traceback.print_exc(limit=-3, file=sys.stdout)  # the innermost frames say enough
        free_device_memory()
        return None


def free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, reps: int) -> list[float]:
    """Wall seconds of `reps` calls of fn, each fenced by device synchronisation."""
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------------------------------------
# Step 1: correctness on tiny random checkpoints
# --------------------------------------------------------------------------------------------

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, initializer_range=0.08)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tiny_configs() -> list[tuple[str, object]]:
    """(label, transformers config): every supported family, tied and untied heads."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return [
        ("llama GQA llama3-rope untied", LlamaConfig(**TINY, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])),
        ("mistral tied", MistralConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=True, architectures=["MistralForCausalLM"])),
        ("qwen2 qkv-bias tied", Qwen2Config(**TINY, num_hidden_layers=3, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])),
        # head_dim 128 with hidden 256 and 4 heads: q width (512) differs from the hidden size
        ("qwen3 qk-norm hd128 untied", Qwen3Config(**TINY, num_hidden_layers=2, head_dim=128, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])),
    ]


def build_random_reference(config, seed: int):
    """transformers fp32 model with random weights; biases and norm weights made non-trivial
    (transformers initialises them to 0 and 1, which would hide a wrong bias or norm path)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def reference_logprobs(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(ids[None].to(device), logits_to_keep=1, use_cache=False).logits[0, -1]
    return F.log_softmax(logits.float(), dim=-1).cpu()


def engine_logprobs(executor: HybridPrefillExecutor, ids: torch.Tensor, chunk: int | None, **kwargs):
    out = executor.forward(ids, chunk, **kwargs)
    return F.log_softmax(out.logits.float(), dim=-1).cpu(), out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def bf16_limit(hf_bf16_error: float) -> float:
    return 1.5 * hf_bf16_error + 1e-3


FP32_LIMIT = 1e-3
# a tiny random model's next-token logprobs, bf16 Triton path vs bf16 torch path (two roundings of the same model)
BF16_ENGINE_LIMIT = 0.05


def check_correctness(report: Report, plan: Plan) -> None:
    for seed, (label, config) in enumerate(tiny_configs()):
        if seconds_left(plan) < plan.seconds_per_config:
            report.add("errors", {"step": f"correctness {label}", "error": "skipped: time budget"})
            continue
        run_step(report, f"correctness {label}", check_one_config, report, plan, label, config, seed)


def check_one_config(report: Report, plan: Plan, label: str, config, seed: int) -> None:
    dev = plan.device
    hf_fp32 = build_random_reference(config, seed)
    with tempfile.TemporaryDirectory() as folder:
        hf_fp32.save_pretrained(folder)
        spec = ModelSpec.from_folder(folder)
        ours = {dt: HybridPrefillExecutor(spec, ModelWeights.load(folder, spec, dt, dev), KernelBackend(dev, dt, spec.head_dim, "sdpa")) for dt in (torch.bfloat16, torch.float32)}
        if "triton" in backends(dev):  # bf16 on the Triton kernels (fp32 stays on the torch ops)
            ours["triton"] = HybridPrefillExecutor(spec, ModelWeights.load(folder, spec, torch.bfloat16, dev), KernelBackend(dev, torch.bfloat16, spec.head_dim, "triton"))
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16).to(dev)
    hf_fp32 = hf_fp32.to(dev)
    gen = torch.Generator().manual_seed(1000 + seed)
    max_len = max(max(plan.correctness_lengths), plan.prefix_split[0])
    prompt = torch.randint(0, spec.vocab_size, (max_len,), generator=gen, dtype=torch.long)

    for s in plan.correctness_lengths:
        ids = prompt[:s]
        ref = reference_logprobs(hf_fp32, ids, dev)
        hf_err = max_abs_diff(reference_logprobs(hf_bf16, ids, dev), ref)
        for chunk in plan.correctness_chunks:
            ours_bf16, _ = engine_logprobs(ours[torch.bfloat16], ids, chunk)
            ours_fp32, _ = engine_logprobs(ours[torch.float32], ids, chunk)
            err16, err32 = max_abs_diff(ours_bf16, ref), max_abs_diff(ours_fp32, ref)
            err_triton = max_abs_diff(engine_logprobs(ours["triton"], ids, chunk)[0], ref) if "triton" in ours else None
            report.add("correctness", {
                "model": label, "S": s, "chunk": chunk,
                "ref_logprob_std": float(ref.std()),  # spread of the reference: a flat one would test little
                "hf_bf16": hf_err, "ours_bf16": err16, "ours_bf16_triton": err_triton, "bf16_limit": bf16_limit(hf_err),
                "ours_fp32": err32,
                "pass": err16 <= bf16_limit(hf_err) and err32 <= FP32_LIMIT and (err_triton is None or err_triton <= bf16_limit(hf_err)),
            })

    s, p = plan.prefix_split
    ids = prompt[:s]
    ref = reference_logprobs(hf_fp32, ids, dev)
    hf_err = max_abs_diff(reference_logprobs(hf_bf16, ids, dev), ref)
    row = {"model": label, "S": s, "P": p, "chunk": 64}
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"), ("triton", "bf16_triton")):
        if dt not in ours:
            continue
        full, _ = engine_logprobs(ours[dt], ids, None)
        _, head = engine_logprobs(ours[dt], ids[:p], None, capture=(0, p))
        tail, _ = engine_logprobs(ours[dt], ids[p:], 64, prefix=head.captured)
        row[f"ours_{name}"] = max_abs_diff(tail, ref)
        row[f"{name}_prefix_vs_full"] = max_abs_diff(tail, full)
    row["bf16_limit"] = bf16_limit(hf_err)
    row["pass"] = (row["ours_bf16"] <= row["bf16_limit"] and row["ours_fp32"] <= FP32_LIMIT and row["fp32_prefix_vs_full"] <= FP32_LIMIT
                   and row.get("ours_bf16_triton", 0.0) <= row["bf16_limit"])
    report.add("prefix", row)
    del ours, hf_fp32, hf_bf16
    free_device_memory()


# --------------------------------------------------------------------------------------------
# Step 1b: the Engine on the device (cache tiers, multi-item, request loop)
# --------------------------------------------------------------------------------------------


def check_engine(report: Report, plan: Plan) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from prefillonly import Engine, EngineConfig
    from prefillonly.cache.prefix_cache import PrefixCache

    label, config = tiny_configs()[0]
    dev = plan.device
    gen = torch.Generator().manual_seed(7)
    with tempfile.TemporaryDirectory() as folder:
        build_random_reference(config, 0).save_pretrained(folder)
        common = dict(model=folder, device=str(dev), dtype="float32", cache_block_size=16, chunk_size=64)
        spec = ModelSpec.from_folder(folder)
        block = PrefixCache.bytes_per_block(spec, torch.float32, 16)
        plain = Engine(EngineConfig(**common, cache_budget_bytes=0))
        cached = Engine(EngineConfig(**common, cache_budget_bytes=64 * block))
        tiered = Engine(EngineConfig(**common, cache_budget_bytes=8 * block, cache_second_tier_bytes=64 * block))
    allowed = [1, 2, 3]

    def gap(a, b):
        return bu.max_logprob_gap([t.logprob for t in a.tokens], [t.logprob for t in b.tokens])

    def row(name, err, **extra):
        report.add("engine", {"check": name, "max_abs_diff": err, **extra, "pass": err <= FP32_LIMIT})

    profile = torch.randint(0, spec.vocab_size, (200,), generator=gen).tolist()
    posts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (37, 81, 5)]
    want = [plain.score(profile + p, allowed) for p in posts]
    got = [cached.score(profile + p, allowed, cache_prefix_len=len(profile)) for p in posts]
    row("prefix cache hits == no cache", max(gap(a, b) for a, b in zip(got, want)), cached_tokens=got[-1].cached_tokens)
    other = [torch.randint(0, spec.vocab_size, (200,), generator=gen).tolist() for _ in range(2)]
    tiered.score(profile + posts[0], allowed, cache_prefix_len=200)
    for o in other:  # push the profile's blocks to the pinned-host tier
        tiered.score(o, allowed)
    back = tiered.score(profile + posts[1], allowed, cache_prefix_len=200)
    tier2 = tiered.cache.pools.get(2)
    row("second tier (pinned host) restore", gap(back, want[1]), cached_tokens=back.cached_tokens,
        restored=tiered.cache.stats.blocks_restored,
        # what is really pinned against the tier's budget (equal where cudaHostRegister pinned it exactly)
        pinned_bytes=tier2.pinned_bytes if tier2 else None, tier2_bytes=tiered.cache.capacity_bytes().get(2))
    items = plain.score_items(profile, posts, allowed)
    row("score_items == separate requests", max(gap(a, b) for a, b in zip(items, want)))
    prompts = [torch.randint(0, spec.vocab_size, (int(n),), generator=gen).tolist() for n in torch.randint(1, 300, (32,), generator=gen)]
    sequential = [plain.score(p, allowed) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(lambda p: cached.submit(p, allowed), prompts))
    concurrent = [f.result(60) for f in futures]
    row("32 concurrent submits == sequential", max(gap(a, b) for a, b in zip(concurrent, sequential)))
    for e in (plain, cached, tiered):
        e.close()
    free_device_memory()


def check_default_engine(report: Report, plan: Plan) -> None:
    """The engine as users get it (dtype and kernels "auto": bf16 and the Triton kernels on CUDA),
    on the last GPU (Triton launches on the current device, so this proves the engine's device
    scope), against the same engine forced onto torch (PREFILLONLY_TRITON_KERNELS=0), cold and over
    a cached prefix. A kernel that fell back at start is a failure here: on a GPU none should."""
    from prefillonly import Engine, EngineConfig

    label, config = tiny_configs()[0]
    dev = plan.device if plan.device.type != "cuda" else torch.device("cuda", torch.cuda.device_count() - 1)
    gen = torch.Generator().manual_seed(8)
    with tempfile.TemporaryDirectory() as folder:
        build_random_reference(config, 0).save_pretrained(folder)
        common = dict(model=folder, device=str(dev), cache_block_size=16)
        default = Engine(EngineConfig(**common))
        os.environ["PREFILLONLY_TRITON_KERNELS"] = "0"
        try:
            torch_path = Engine(EngineConfig(**common, cache_budget_bytes=0))
        finally:
            del os.environ["PREFILLONLY_TRITON_KERNELS"]
    check = default.stats().kernel_check
    profile = torch.randint(0, default.spec.vocab_size, (300,), generator=gen).tolist()
    for name, tail in (("cold", 41), ("over a cached 300-token prefix", 57)):
        ids = profile + torch.randint(0, default.spec.vocab_size, (tail,), generator=gen).tolist()
        got, want = default.score(ids, [1, 2, 3], cache_prefix_len=len(profile)), torch_path.score(ids, [1, 2, 3])
        err = bu.max_logprob_gap([t.logprob for t in got.tokens], [t.logprob for t in want.tokens])
        report.add("engine", {"check": f"default config ({default.config.dtype}, attention {default.executor.kernels.attention}) "
                                        f"on {dev}, {name}, vs the torch path", "max_abs_diff": err, "kernel_check": check,
                              "cached_tokens": got.cached_tokens,
                              "pass": err is not None and err <= BF16_ENGINE_LIMIT and not check.startswith("fell back")})
    default.close()
    torch_path.close()
    free_device_memory()


def measure_warm_requests(report: Report, plan: Plan, matmul_rate: float | None) -> None:
    """The cached-prefix path at 8B scale: S new tokens over P tokens cached in a real PrefixCache
    (16-token blocks so that P is whole blocks), single and a batched step of warm requests, per
    backend: Triton reads the pool's blocks in place, SDPA gathers them into the workspace."""
    from prefillonly.cache.prefix_cache import PrefixCache

    spec = ModelSpec.from_hf_config(llama31_8b_config(**plan.perf_shape))
    dev = plan.device
    weights = ModelWeights.random(spec, torch.bfloat16, dev)
    chunk = plan.perf_chunks[0]
    for p, s in plan.warm_shapes:
        ids = torch.randint(0, spec.vocab_size, (p + s,))
        for backend in backends(dev):
            if seconds_left(plan) < 60:
                report.add("errors", {"step": f"warm P={p} S={s} {backend}", "error": "skipped: time budget"})
                continue
            executor = HybridPrefillExecutor(spec, weights, KernelBackend(dev, torch.bfloat16, spec.head_dim, backend))
            cache = PrefixCache(spec, torch.bfloat16, dev, block_size=16, budget_bytes=2 * p * spec.kv_width * spec.num_layers * 2 + (64 << 20))
            # as the engine does: the index begins a ticket, the cache executes its moves and gives the executor its view
            keep, moves = cache.index.begin(cache.hashes(ids[:p].tolist(), None), p + 1, p // cache.block_size)  # computes the profile's blocks
            cache.execute(moves)
            executor.forward(ids[: p + 1], chunk, sink=cache.access(keep).sink)
            cache.index.commit(keep)
            ticket, moves = cache.index.begin(cache.hashes(ids.tolist(), None), p + s, 0)
            cache.execute(moves)
            t = cache.access(ticket)
            new = ids[t.cached_tokens :]
            warm_fn = lambda: executor.forward(new, chunk, prefix=t.source)  # noqa: E731
            warm = time_call(warm_fn, dev, 3)
            cold = time_call(lambda: executor.forward(ids, chunk), dev, 2)
            gap = max_abs_diff(warm_fn().logits.float().log_softmax(-1), executor.forward(ids, chunk).logits.float().log_softmax(-1))
            flops = spec.flops(len(new), t.cached_tokens)
            w = statistics.median(warm)
            report.add("warm", {"backend": backend, "P": t.cached_tokens, "S": len(new), "batch": 1, "warm_ms": 1e3 * w,
                                "cold_ms": 1e3 * statistics.median(cold), "speedup": statistics.median(cold) / w,
                                "TFLOP/s": flops / w / 1e12, "MFU_datasheet": flops / w / datasheet_bf16_flops(),
                                "warm_vs_cold_logprob_gap": gap})
            if (p, s) == plan.warm_shapes[0] and plan.warm_batch > 1 and seconds_left(plan) >= 60:
                b = plan.warm_batch
                batch = ForwardBatch([Sequence(torch.randint(0, spec.vocab_size, (len(new),)), prefix=t.source) for _ in range(b)])
                step = statistics.median(time_call(lambda: executor.forward_batch(batch, chunk), dev, 3))
                report.add("warm", {"backend": backend, "P": t.cached_tokens, "S": len(new), "batch": b, "warm_ms": 1e3 * step,
                                    "one_by_one_ms": 1e3 * b * w, "speedup": b * w / step, "TFLOP/s": b * flops / step / 1e12,
                                    "MFU_datasheet": b * flops / step / datasheet_bf16_flops()})
                del batch
            cache.index.commit(ticket)
            free_device_memory()
    del weights
    free_device_memory()


def tune_attention_tiles(report: Report, plan: Plan) -> None:
    """Pick the Triton attention's tiles for this GPU on an 8K-token 8B-shape prompt, before
    anything is timed (the choice is cached on disk; see kernels/gpu_tuning.py)."""
    if "triton" not in backends(plan.device) or plan.device.type != "cuda":
        return
    from prefillonly.kernels.gpu_attention import BatchLayout, prefill_attention
    from prefillonly.kernels.gpu_tuning import tune_attention

    spec = ModelSpec.from_hf_config(llama31_8b_config(**plan.perf_shape))
    dev, n = plan.device, min(8192, max(plan.perf_lengths))
    q = torch.randn(spec.num_heads, n, spec.head_dim, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(spec.num_kv_heads, n, spec.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    layout = BatchLayout([0], [n], [0], [n], [0], dev)
    timings = tune_attention(lambda tiles: prefill_attention(q, k, v, out, layout, spec.head_dim ** -0.5, tiles=tiles),
                             spec.head_dim, torch.bfloat16, dev)
    flops = 2 * spec.num_heads * spec.head_dim * n * n  # causal: half of 4*H*D*n^2
    for tiles, t in timings.items():
        report.add("tuning", {"tiles (BM, BN, warps, stages)": str(tiles), "S": n, "ms": 1e3 * t if isinstance(t, float) else t,
                              "TFLOP/s": flops / t / 1e12 if isinstance(t, float) else None})


# --------------------------------------------------------------------------------------------
# Step 2: speed and MFU on the Llama-3.1-8B shape
# --------------------------------------------------------------------------------------------


def llama31_8b_config(**overrides):
    """transformers config with Llama-3.1-8B's real shape (random weights are made separately)."""
    from transformers import LlamaConfig

    values = dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )
    values.update(overrides)
    return LlamaConfig(**values)


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of a checkpoint of this shape: linear layers, embedding (+ lm_head unless tied), norms."""
    e = torch.tensor([], dtype=dtype).element_size()
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    return e * (spec.non_embedding_params() + embeddings + norms)


def measure_matmul_rate(report: Report, plan: Plan) -> float | None:
    n, dev = plan.matmul_n, plan.device
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    time_call(lambda: torch.matmul(a, b, out=c), dev, 3)  # warm-up
    reps = 20 if dev.type == "cuda" else 3
    seconds = statistics.median(time_call(lambda: torch.matmul(a, b, out=c), dev, reps))
    rate = 2 * n**3 / seconds
    report.add("rates", {"what": f"bf16 matmul {n}x{n}x{n}", "median_ms": seconds * 1e3, "TFLOP/s": rate / 1e12, "of_datasheet": rate / datasheet_bf16_flops()})
    return rate


def measure_performance(report: Report, plan: Plan, matmul_rate: float | None) -> None:
    dev = plan.device
    if seconds_left(plan) < plan.reserve_after_perf_s + plan.seconds_per_config:
        report.add("errors", {"step": "performance", "error": "skipped: time budget"})
        return
    spec = ModelSpec.from_hf_config(llama31_8b_config(**plan.perf_shape))
    shape = f"{spec.num_layers} layers, d={spec.hidden_size}, F={spec.intermediate_size}, {spec.num_heads}q/{spec.num_kv_heads}kv heads x {spec.head_dim}, vocab {spec.vocab_size}"
    report.add("env", {"key": "perf_model", "value": f"{shape}, N={spec.non_embedding_params() / 1e9:.3f}e9"})
    log(f"perf: making random weights ({weight_bytes(spec, torch.bfloat16) / 1e9:.2f} GB bf16)")
    weights = ModelWeights.random(spec, torch.bfloat16, dev)
    executors = {b: HybridPrefillExecutor(spec, weights, KernelBackend(dev, torch.bfloat16, spec.head_dim, b)) for b in backends(dev)}
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, spec.vocab_size, (max(plan.perf_lengths),), generator=gen, dtype=torch.long)

    smallest = min(plan.perf_lengths)
    log(f"perf: warm-up at {smallest} tokens")
    for executor in executors.values():
        warm_s = min(time_call(lambda: executor.forward(prompt[:smallest], plan.perf_chunks[0]), dev, 2))
    achieved = spec.flops(smallest) / warm_s  # first estimate of the rate, for the budget

    for s in plan.perf_lengths:
        # every chunk size on the default backend; the others beside it at the first chunk size
        runs = [(b, c) for b in executors for c in (plan.perf_chunks if b == next(iter(executors)) else plan.perf_chunks[:1])]
        for backend, chunk in runs:
            reps = 3 if s <= 8192 else (2 if s <= 32768 else 1)
            estimate = reps * spec.flops(s) / achieved
            if estimate > seconds_left(plan) - plan.reserve_after_perf_s:
                report.add("errors", {"step": f"perf S={s} chunk={chunk} {backend}", "error": f"skipped: ~{estimate:.0f}s needed, time budget"})
                continue
            row = run_step(report, f"perf S={s} chunk={chunk} {backend}", time_prefill, executors[backend], spec, prompt[:s], chunk,
                           reps, matmul_rate)
            if row:
                achieved = row["TFLOP/s"] * 1e12
                report.add("performance", {"backend": backend, **row})
    del executors, weights
    free_device_memory()


def time_prefill(executor, spec: ModelSpec, ids: torch.Tensor, chunk: int, reps: int, matmul_rate: float | None) -> dict:
    times = time_call(lambda: executor.forward(ids, chunk), executor.device, reps)
    seconds = statistics.median(times)
    flops = spec.flops(len(ids))
    rate = flops / seconds
    return {
        "S": len(ids), "chunk": chunk, "reps": reps, "median_s": seconds, "min_s": min(times),
        "tok/s": len(ids) / seconds, "model_TFLOP": flops / 1e12, "TFLOP/s": rate / 1e12,
        "MFU_datasheet": rate / datasheet_bf16_flops(),
        "MFU_measured_matmul": rate / matmul_rate if matmul_rate else None,
    }


# --------------------------------------------------------------------------------------------
# Step 3: peak memory per token
# --------------------------------------------------------------------------------------------


def measure_memory(report: Report, plan: Plan) -> None:
    dev = plan.device
    if seconds_left(plan) < plan.seconds_for_memory:
        report.add("errors", {"step": "memory", "error": "skipped: time budget"})
        return
    spec_full = ModelSpec.from_hf_config(llama31_8b_config())  # the real 8B, for the weights term
    card_left = card_bytes() * USABLE_FRACTION - weight_bytes(spec_full, torch.bfloat16)
    shape = {**plan.perf_shape, "num_hidden_layers": 2}
    config = llama31_8b_config(**shape)
    spec = ModelSpec.from_hf_config(config)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, spec.vocab_size, (max(plan.memory_lengths),), generator=gen, dtype=torch.long)

    weights = ModelWeights.random(spec, torch.bfloat16, dev)
    for backend in backends(dev):
        executor = HybridPrefillExecutor(spec, weights, KernelBackend(dev, torch.bfloat16, spec.head_dim, backend))
        ours = [(f"hybrid {backend}", plan.memory_chunk)] + ([(f"unchunked {backend}", None)] if backend == "sdpa" else [])
        for method, chunk in ours:
            for s in plan.memory_lengths:
                run_step(report, f"memory {method} S={s}", measure_engine_peak, report, plan, executor, spec, prompt[:s], method, chunk, card_left)
        del executor
    del weights
    free_device_memory()

    model = run_step(report, "memory: build transformers model", build_transformers_model, config, dev)
    if model is not None:
        for s in plan.memory_lengths:
            run_step(report, f"memory transformers S={s}", measure_transformers_peak, report, plan, model, prompt[:s], card_left)
        del model
        free_device_memory()


def measure_engine_peak(report, plan, executor, spec, ids, method, chunk, card_left) -> None:
    meter = PeakMemoryMeter(plan.device)
    meter.start()
    executor.forward(ids, chunk)
    peak = meter.peak_growth()
    predicted = predict_peak_bytes(spec, len(ids), chunk, torch.bfloat16, attention_backend=executor.kernels.attention, device=plan.device)
    report.add("memory", memory_row(method, len(ids), chunk, peak, predicted, card_left))


def build_transformers_model(config, device: torch.device):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def measure_transformers_peak(report, plan, model, ids, card_left) -> None:
    batch = ids[None].to(plan.device)
    meter = PeakMemoryMeter(plan.device)
    meter.start()
    with torch.inference_mode():
        model(batch, logits_to_keep=1, use_cache=False)
    peak = meter.peak_growth()
    method = f"transformers ({model.config._attn_implementation})"
    report.add("memory", memory_row(method, len(ids), None, peak, None, card_left))


def memory_row(method: str, s: int, chunk, peak: int | None, predicted: int | None, card_left: float) -> dict:
    per_token = peak / s if peak else None
    return {
        "method": method, "S": s, "chunk": chunk, "layers": 2,
        "peak_MB": peak / 1e6 if peak is not None else None,
        "bytes/token": per_token,
        "predicted_MB": predicted / 1e6 if predicted else None,
        "measured/predicted": peak / predicted if peak and predicted else None,
        "implied_MIL_tokens": int(card_left / per_token) if per_token else None,
    }


# --------------------------------------------------------------------------------------------
# Step 4: attention alone, per SDPA backend
# --------------------------------------------------------------------------------------------


def sdpa_backends() -> list[tuple[str, object]]:
    """(label, backend or None for torch's own choice); the executor runs the default."""
    from torch.nn.attention import SDPBackend

    return [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def measure_attention(report: Report, plan: Plan) -> None:
    spec = ModelSpec.from_hf_config(llama31_8b_config(**plan.perf_shape))
    for s in plan.perf_lengths:
        if seconds_left(plan) < 30:
            report.add("errors", {"step": f"attention S={s}", "error": "skipped: time budget"})
            continue
        for label, backend in sdpa_backends():
            run_step(report, f"attention S={s} {label}", time_attention, report, plan, spec, s, label, backend)
        free_device_memory()


def time_attention(report: Report, plan: Plan, spec: ModelSpec, s: int, label: str, backend) -> None:
    from torch.nn.attention import sdpa_kernel

    dev, hq, hkv, hd = plan.device, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(1, hq, s, hd, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, s, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, s, hd, device=dev, dtype=torch.bfloat16)

    def attend_gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def attend_expanded():
        return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)

    def timed(fn):
        if backend is None:
            return time_call(fn, dev, 1 + reps)[1:]  # first call is the warm-up
        with sdpa_kernel(backend):
            return time_call(fn, dev, 1 + reps)[1:]

    reps = 3 if dev.type == "cuda" else 1
    k_rep = v_rep = None
    try:
        times, gqa = timed(attend_gqa), "native"
    except RuntimeError:  # backend without enable_gqa support: give it K/V at full head count
        k_rep, v_rep = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        times, gqa = timed(attend_expanded), "expanded"
    seconds = statistics.median(times)
    flops = 2 * hq * hd * s * s  # docs/design.md §7's causal attention term, one layer
    report.add("attention", {"S": s, "heads": f"{hq}q/{hkv}kv x {hd}", "backend": label, "gqa": gqa, "median_ms": seconds * 1e3, "TFLOP/s": flops / seconds / 1e12})


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def environment(plan: Plan, smoke: bool) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from prefillonly.kernels import score_head
    from prefillonly.kernels.attention import flash_attn_available

    cuda = plan.device.type == "cuda"
    return {
        "mode": "smoke (CPU, tiny shapes)" if smoke else "full (CUDA)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "flash_attn_package": flash_attn_available(),
        # the bf16 engines' score head (docs/design.md §19): out_dtype where cuBLAS's float32-output mm passed its
        # self-check on this device, else upcast (exact, slower): never run on a GPU before 2026-12-06
        "score_head_bf16": score_head.choose(plan.device, torch.bfloat16),
        "device_name": torch.cuda.get_device_name(plan.device) if cuda else platform.processor() or "cpu",
        "device_memory_GB": torch.cuda.get_device_properties(plan.device).total_memory / 1e9 if cuda else None,
        "budget_s": plan.budget_s,
        "command": bu.command_line(),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json / gpu_check.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new work after this many seconds (default 420, smoke 90)")
    parser.add_argument("--skip", default="", help="comma list of steps to skip: correctness,perf,attention,memory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    budget = args.budget_s or (90.0 if args.smoke else 420.0)
    plan = smoke_plan(budget) if args.smoke else gpu_plan(budget)
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --smoke to run on the CPU", flush=True)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    # fp32 comparisons must be true fp32 (TF32 would add ~1e-3 noise); bf16 matmuls are unaffected
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    header = environment(plan, args.smoke)
    report = Report(args.out, header)
    for key, value in header.items():
        report.add("env", {"key": key, "value": value})

    if "correctness" not in skip:
        log("step 1: correctness")
        check_correctness(report, plan)
    if "engine" not in skip:
        log("step 1b: engine on the device")
        run_step(report, "engine", check_engine, report, plan)
        run_step(report, "default engine", check_default_engine, report, plan)
    matmul_rate = run_step(report, "matmul rate", measure_matmul_rate, report, plan)
    if "perf" not in skip:
        log("step 2: performance")
        run_step(report, "attention tiles", tune_attention_tiles, report, plan)
        run_step(report, "performance", measure_performance, report, plan, matmul_rate)
        run_step(report, "warm requests", measure_warm_requests, report, plan, matmul_rate)
    if "memory" not in skip:
        log("step 3: memory")
        run_step(report, "memory", measure_memory, report, plan)
    if "attention" not in skip:
        log("step 4: attention")
        run_step(report, "attention", measure_attention, report, plan)

    failed = [r for key in ("correctness", "prefix", "engine") for r in report.data[key] if not r["pass"]]
    # listed, not failures: steps skipped for the time budget, and torch SDPA backends this card or
    # torch lacks (step 4 times torch's own backends as a yardstick, not ours)
    errors = [e for e in report.data["errors"] if not (e["error"].startswith("skipped") or e["step"].startswith("attention S="))]
    log(f"done: {len(failed)} failed correctness rows, {len(errors)} errors")
    print("\n" + report.markdown(), flush=True)
    return 1 if failed or errors else 0  # an exception in any step is a failure too


if __name__ == "__main__":
    sys.exit(main())
