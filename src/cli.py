"""Command line: `prefillonly score --prompt "..." --allowed " Yes" " No"` prints JSON.

`prefillonly prepare` converts the embedded default model once and builds the compiled CPU
kernels (set-up scripts call it so the first request does not pay either).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import EngineConfig, default_cache_dir
from .errors import PrefillOnlyError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (CUDA)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-size", default="2048", help="tokens per chunk; 0 = no chunking")
    p.add_argument("--max-input-len", default=None)
    p.add_argument("--activation-budget-bytes", default=None)
    p.add_argument("--threads", default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cache-dir", default=default_cache_dir())


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, chunk_size=a.chunk_size, max_input_len=a.max_input_len,
        activation_budget_bytes=a.activation_budget_bytes, threads=a.threads,
        attention_backend=a.attention_backend, cache_dir=a.cache_dir,
    )


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
    p.add_argument("--cache-dir", default=default_cache_dir())
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    try:
        if a.command == "prepare":
            from .default_model import ensure_default_model

            print(ensure_default_model(a.cache_dir))
            from .kernels import cpu_ext

            # build the compiled CPU kernels now, not in the first request (or the server's load)
            print("compiled CPU kernels:", "ready" if cpu_ext.load() is not None else f"unavailable ({cpu_ext.why_unavailable()})")
            attention = cpu_ext.load_attention()
            print("CPU flash attention:", f"ready ({', '.join(attention.supported_isas())} on this CPU)" if attention is not None
                  else f"unavailable, attention runs on torch SDPA ({cpu_ext.why_attention_unavailable()})")
            return 0
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
