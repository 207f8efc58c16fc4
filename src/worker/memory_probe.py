"""Measures one forward's peak memory growth in a fresh process (docs/design.md §7).

    python -m prefillonly.worker.memory_probe --tokens 8192 --chunk-size 512 [--model DIR | --random-config JSON]
        [--dtype bfloat16] [--system prefillonly|transformers] [--members N [--shared-prefix P]] [--logprob-rows N [--logprob-top-k K]]

Prints one JSON line: measured growth (VmHWM after - VmRSS before, high-water mark reset
first), the engine's prediction, and the bytes per token. One length per process, so that
nothing a previous run left in the allocator hides or inflates the peak. `--members N` runs the
tokens as one batched step of N sequences of (nearly) equal length, with `--shared-prefix P` each
after one captured P-token prompt (a multi-item step's items). Used by the memory tests and
by perf/ benchmarks.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from ..config import DTYPES
from ..kernels.attention import BACKENDS, resolve_backend
from ..kernels.backend import KernelBackend
from ..kernels.linear import LINEAR_BACKENDS, resolve_linear_backend
from .memory import PeakMemoryMeter, batch_peak_components
from .workspace import LOGPROB_ROWS
from ..model.spec import ModelSpec


def _spec(args) -> ModelSpec:
    if args.random_config:
        import transformers

        raw = json.loads(args.random_config)
        cfg_cls = getattr(transformers, raw.pop("config_class", "LlamaConfig"))
        architecture = raw.pop("architecture", None) or cfg_cls.__name__.replace("Config", "ForCausalLM")
        cfg = cfg_cls(**raw)
        cfg.architectures = [architecture]
        return ModelSpec.from_hf_config(cfg)
    return ModelSpec.from_folder(args.model)


def measure(args) -> dict:
    mmap_pinned = pin_mmap_threshold()  # before the weights: the whole process runs under it
    torch.set_num_threads(args.threads)
    dtype, device = DTYPES[args.dtype], torch.device("cpu")
    spec = _spec(args)
    ids = torch.randint(0, spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    if args.system == "transformers":
        run = _transformers_runner(args, spec, dtype)
    else:
        run = _prefillonly_runner(args, spec, dtype, device)
    # warm-up over the measured run's call shapes: one-time allocations (thread pools, the BLAS
    # library's packing buffers, kernels) belong to the process, not to the request
    run(ids[: warm_up_tokens(args)])
    meter = PeakMemoryMeter(device)
    if not meter.available:
        raise SystemExit("cannot reset the RSS high-water mark (/proc/self/clear_refs not writable)")
    # what a 16-token forward costs beyond its (tiny) buffers: Python objects, per-call library
    # buffers; the prediction's `unseen` allowance must cover it
    gc.collect()
    release_free_heap()
    meter.start()
    run(ids[:16])
    small_forward = meter.peak_growth()
    gc.collect()
    heap_trimmed = release_free_heap()
    heap_free = heap_free_bytes()
    meter.start()
    t0 = time.perf_counter()
    run(ids)
    seconds = time.perf_counter() - t0
    measured = meter.peak_growth()
    chunk = args.chunk_size or None
    members = [(len(part), args.shared_prefix) for part in split_members(ids, args.members)]
    spans = member_spans(ids, args) if args.logprob_rows else None
    parts = (batch_peak_components(spec, members, chunk, args.kernels, inplace_attention=args.inplace_attention,
                                   logprob_spans=spans)
             if args.system == "prefillonly" else None)
    predicted = sum(parts.values()) if parts else None
    return dict(system=args.system, tokens=args.tokens, members=args.members, chunk_size=chunk, dtype=args.dtype,
                inplace_attention=args.inplace_attention, attention_backend=args.backend, linear_backend=args.linear, measured_bytes=measured,
                predicted_bytes=predicted, predicted_parts=parts, heap_trimmed=heap_trimmed, heap_free_bytes=heap_free, mmap_pinned=mmap_pinned, small_forward_bytes=small_forward, bytes_per_token=measured / args.tokens, seconds=seconds)


def pin_mmap_threshold(nbytes: int = 128 << 10) -> bool:
    """Fix glibc's mmap threshold (mallopt M_MMAP_THRESHOLD), which also turns its dynamic
    growth off: every buffer of 128 KiB or more is then its own mapping, given back when freed.

    Under the default policy the threshold grows to the largest block freed so far (up to
    32 MiB), later buffers come from the heap, and the heap's holes make the RSS peak depend on
    the order of earlier frees (measured: +-1-2 MiB run to run at 68 MiB). Pinned, the measured
    peak is the request's own buffers, which is what the prediction is checked against.
    Also one malloc arena for every thread (M_ARENA_MAX 1): with one arena per thread, the second
    torch thread's arena grew and kept pages depending on timing (measured: the same 16K-token
    bf16 forward peaked anywhere in 35.6-38.4 MiB; with one arena 35.6-35.8).
    Returns False where the allocator is not glibc's."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        one_arena = bool(libc.mallopt(-8, 1))  # -8 = M_ARENA_MAX, before any thread allocates
        return bool(libc.mallopt(-3, nbytes)) and one_arena  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc malloc_trim) before measuring.

    Memory freed earlier (the warm-up, weight conversion temporaries) stays resident in glibc's
    arenas once its dynamic mmap threshold has grown; the request then reuses it without any RSS
    growth, and the measured peak comes out lower than what the request really needs by however
    much happened to be free. Trimming first makes the measurement see the request's own pages.
    Returns False where the allocator has no malloc_trim (not glibc)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def heap_free_bytes() -> int | None:
    """Bytes free inside the C heap's chunks now (glibc mallinfo2: fordblks), None where the
    allocator is not glibc's. After the trim these may still be resident (a page shared with a live
    block): a forward that reuses them allocates without the RSS growing, so the measured growth
    can fall short of the request's buffers by up to this much."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    return int(fn().fordblks)


def warm_up_tokens(args) -> int:
    """Tokens of the warm-up run: one full chunk and, with logprob spans, enough that every member's
    span fills whole LOGPROB_ROWS blocks, so the LM head runs at the measured run's row count too (a
    BLAS library sizes its kept packing buffers by the call's shape: a 64-row head first met in the
    measured run counted them as the request's)."""
    tokens = args.chunk_size or 2048
    if args.logprob_rows:
        tokens = max(tokens, args.members * (LOGPROB_ROWS + 2))
    return min(args.tokens, tokens)


def split_members(ids: torch.Tensor, members: int) -> list[torch.Tensor]:
    """`ids` as `members` sequences of nearly equal length (at most one fewer than members if
    there are fewer tokens)."""
    return [part for part in torch.tensor_split(ids, min(members, len(ids))) if len(part)]


def _prefillonly_runner(args, spec, dtype, device):
    from .executor import ForwardBatch, HybridPrefillExecutor, Sequence
    from ..model.weights import ModelWeights

    if args.random_config:
        weights = ModelWeights.random(spec, dtype, device)
    else:
        weights = ModelWeights.load(args.model, spec, dtype, device)
    args.linear = resolve_linear_backend(args.linear_backend, device, dtype, weights.layers[0].projections())
    args.kernels = KernelBackend(device, dtype, spec.head_dim, args.backend, args.linear)  # what the prediction counts by too
    executor = HybridPrefillExecutor(spec, weights, args.kernels)
    if args.shared_prefix:  # the items of a multi-item step: one captured prompt, then every member over it
        shared = executor.forward(torch.randint(0, spec.vocab_size, (args.shared_prefix,)), None,
                                  capture=(0, args.shared_prefix)).captured
        return lambda ids: executor.forward_batch(
            ForwardBatch([Sequence(x, prefix=shared) for x in split_members(ids, args.members)]), args.chunk_size or None)
    if args.members > 1 or args.logprob_rows:  # each member with a logprob span over its last rows (at most all but its last)
        return lambda ids: executor.forward_batch(
            ForwardBatch([Sequence(x, logprob_rows=rows, logprob_top_k=k) for x, (rows, k) in
                          zip(split_members(ids, args.members), member_spans(ids, args))]),
            args.chunk_size or None, args.inplace_attention)
    return lambda ids: executor.forward(ids, args.chunk_size or None, inplace_attention=args.inplace_attention)


def member_spans(ids: torch.Tensor, args) -> list[tuple[int, int]]:
    """Per member of split_members(ids, args.members): its logprob span's (rows, top k)."""
    return [(min(args.logprob_rows, len(x) - 1), args.logprob_top_k if args.logprob_rows else 0)
            for x in split_members(ids, args.members)]


def _transformers_runner(args, spec, dtype):
    from transformers import AutoModelForCausalLM

    if args.random_config:
        model = AutoModelForCausalLM.from_config(spec.hf_config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()

    @torch.inference_mode()
    def run(ids):
        return model(ids[None], logits_to_keep=1, use_cache=False).logits

    return run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefillonly.worker.memory_probe")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=2048, help="0 = no chunking")
    p.add_argument("--model", help="checkpoint folder")
    p.add_argument("--random-config", help="JSON of a transformers config (random weights); key config_class picks the "
                   "class, key architecture the model class where it is not the config's name with ForCausalLM")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--system", default="prefillonly", choices=["prefillonly", "transformers"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--inplace-attention", action="store_true", help="write attention over Q block by block (CPU)")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="attention backend (auto: as the engine picks)")
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS, help="linear backend (auto: as the engine picks)")
    p.add_argument("--members", type=int, default=1, help="run the tokens as one step of this many sequences (prefillonly)")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="each member after one captured prefix of this many tokens, computed before the measured run "
                        "(prefillonly: multi-item items, attention over it read once)")
    p.add_argument("--logprob-rows", type=int, default=0, help="also a logprob span over this many rows before the last (prefillonly; each member its own)")
    p.add_argument("--logprob-top-k", type=int, default=0, help="top tokens per row of that span")
    args = p.parse_args(argv)
    args.linear = None  # resolved with the weights (prefillonly)
    args.backend = resolve_backend(args.attention_backend, torch.device("cpu")) if args.system == "prefillonly" else None
    if not (args.model or args.random_config):
        from ..contract.paths import default_cache_dir
        from ..model.default_model import ensure_default_model

        args.model = ensure_default_model(default_cache_dir())
    return args


def measure_argv(argv: list[str]) -> dict:
    """One measurement from a command line's arguments, in this process (which must be fresh)."""
    return measure(parse_args(argv))


def forked_probes(workers: int = 1):
    """An executor whose every `submit(measure_argv, argv)` runs in a process of its own, forked from
    one that imported torch, transformers and this module once (multiprocessing's forkserver): as
    fresh for the allocator as `python -m` (nothing has run a forward or allocated a tensor, the
    mallopt settings are made in the child), without paying the ~6 s of imports per measurement.
    Environment variables a library reads at import (ONEDNN_MAX_CPU_ISA) need `python -m` instead."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers.models.llama.configuration_llama", "transformers.modeling_rope_utils", __name__])
    return ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1)


def main(argv=None) -> int:
    print(json.dumps(measure_argv(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
