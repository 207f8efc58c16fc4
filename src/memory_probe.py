"""Measures one forward's peak memory growth in a fresh process (DESIGN.md §10).

    python -m prefillonly.memory_probe --tokens 8192 --chunk-size 512 [--model DIR | --random-config JSON]
        [--dtype bfloat16] [--system prefillonly|transformers]

Prints one JSON line: measured growth (VmHWM after - VmRSS before, high-water mark reset
first), the engine's prediction, and the bytes per token. One length per process, so that
nothing a previous run left in the allocator hides or inflates the peak. Used by the memory
tests and by perf/ benchmarks.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from .config import DTYPES
from .memory import PeakMemoryMeter, predict_peak_bytes
from .model_spec import ModelSpec


def _spec(args) -> ModelSpec:
    if args.random_config:
        import transformers

        raw = json.loads(args.random_config)
        cfg_cls = getattr(transformers, raw.pop("config_class", "LlamaConfig"))
        cfg = cfg_cls(**raw)
        cfg.architectures = [cfg_cls.__name__.replace("Config", "ForCausalLM")]
        return ModelSpec.from_hf_config(cfg)
    return ModelSpec.from_folder(args.model)


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    dtype, device = DTYPES[args.dtype], torch.device("cpu")
    spec = _spec(args)
    ids = torch.randint(0, spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    if args.system == "transformers":
        run = _transformers_runner(args, spec, dtype)
    else:
        run = _prefillonly_runner(args, spec, dtype, device)
    run(ids[:16])  # warm-up: one-time allocations (thread pools, kernels) are not the request's
    meter = PeakMemoryMeter(device)
    if not meter.available:
        raise SystemExit("cannot reset the RSS high-water mark (/proc/self/clear_refs not writable)")
    gc.collect()
    meter.start()
    t0 = time.perf_counter()
    run(ids)
    seconds = time.perf_counter() - t0
    measured = meter.peak_growth()
    chunk = args.chunk_size or None
    predicted = (predict_peak_bytes(spec, args.tokens, chunk, dtype, inplace_attention=args.inplace_attention)
                 if args.system == "prefillonly" else None)
    return dict(system=args.system, tokens=args.tokens, chunk_size=chunk, dtype=args.dtype,
                inplace_attention=args.inplace_attention, measured_bytes=measured,
                predicted_bytes=predicted, bytes_per_token=measured / args.tokens, seconds=seconds)


def _prefillonly_runner(args, spec, dtype, device):
    from .executor import HybridPrefillExecutor
    from .weights import ModelWeights

    if args.random_config:
        weights = ModelWeights.random(spec, dtype, device)
    else:
        weights = ModelWeights.load(args.model, spec, dtype, device)
    executor = HybridPrefillExecutor(spec, weights, dtype, device, "sdpa")
    return lambda ids: executor.forward(ids, args.chunk_size or None, inplace_attention=args.inplace_attention)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefillonly.memory_probe")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=2048, help="0 = no chunking")
    p.add_argument("--model", help="checkpoint folder")
    p.add_argument("--random-config", help="JSON of a transformers config (random weights); key config_class picks the class")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--system", default="prefillonly", choices=["prefillonly", "transformers"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--inplace-attention", action="store_true", help="write attention over Q block by block (CPU)")
    args = p.parse_args(argv)
    if not (args.model or args.random_config):
        from .config import default_cache_dir
        from .default_model import ensure_default_model

        args.model = ensure_default_model(default_cache_dir())
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
