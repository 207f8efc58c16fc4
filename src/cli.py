"""Command line: `prefillonly score --prompt "..." --allowed " Yes" " No"` prints JSON.

`prefillonly prepare` converts the embedded default model once and builds the compiled CPU
kernels (set-up scripts call it so the first request does not pay either).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from .config import EngineConfig
from .contract.errors import PrefillOnlyError

# The EngineConfig settings `score` takes as flags (--chunk-size for chunk_size), in --help order;
# each flag's default and help come from the field.
_ENGINE_FLAGS = ("model", "dtype", "device", "chunk_size", "max_input_len", "activation_budget_bytes", "threads",
                 "attention_backend", "linear_backend", "head_dtype", "cache_dir")


def _engine_flag(p: argparse.ArgumentParser, name: str) -> None:
    help_text = next(f.metadata.get("help") for f in fields(EngineConfig) if f.name == name)
    p.add_argument("--" + name.replace("_", "-"), default=EngineConfig.default_of(name), help=help_text)


def _engine_args(p: argparse.ArgumentParser) -> None:
    for name in _ENGINE_FLAGS:
        _engine_flag(p, name)


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(a, name) for name in _ENGINE_FLAGS})


def _prepare(cache_dir: str) -> int:
    """Convert the default model and build both compiled CPU kernels now, not in the first request (or
    the server's load): side by side, since each is one core's work (the conversion is Python, each
    build one compiler process, ~30 s apiece on a 2-core Xeon) and together they were half the set-up."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from .kernels import cpu_ext
    from .model.default_model import ensure_default_model

    with ThreadPoolExecutor(3) as pool:
        model, ops, attention = (pool.submit(ensure_default_model, cache_dir), pool.submit(cpu_ext.load),
                                 pool.submit(cpu_ext.load_attention))  # attention's load also self-checks its bf16 path
        model, ops, attention = model.result(), ops.result(), attention.result()
    print(model)
    print("compiled CPU kernels:", f"ready ({ops.active_isa()} on this CPU)" if ops is not None
          else f"unavailable ({cpu_ext.why_unavailable()})")
    if attention is not None:
        print(f"CPU flash attention: ready (bfloat16 on {cpu_ext.attention_isa(torch.bfloat16)}, float32 on "
              f"{cpu_ext.attention_isa(torch.float32)}; variants this CPU runs: {', '.join(attention.supported_isas())})")
    else:
        print(f"CPU flash attention: unavailable, attention runs on torch SDPA ({cpu_ext.why_attention_unavailable()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefillonly", description="Prefill-only scoring engine")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("score", help="score one prompt, print JSON")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--ids", type=int, nargs="+", help="prompt as token ids")
    s.add_argument("--allowed", nargs="+", required=True, help='allowed output tokens, e.g. " Yes" " No" (mind the space)')
    s.add_argument("--allowed-ids", action="store_true", help="--allowed values are token ids")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_args(s)
    p = sub.add_parser("prepare", help="convert the embedded default model and build the CPU kernels, once")
    _engine_flag(p, "cache_dir")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    try:
        if a.command == "prepare":
            return _prepare(a.cache_dir)
        from .engine import Engine

        allowed = [int(x) for x in a.allowed] if a.allowed_ids else a.allowed
        with Engine(_config(a)) as engine:
            result = engine.score(a.prompt if a.prompt is not None else a.ids, allowed, top_k=a.top_k, apply_chat_template=a.chat)
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
        return 0
    except (PrefillOnlyError, ValueError) as e:
        print(json.dumps({"error": str(e), "code": getattr(e, "code", "invalid_argument")}), file=sys.stdout)
        return 2


if __name__ == "__main__":
    sys.exit(main())
