"""Builds the frontend from a model repository, and runs it:

    python -m prefillonly.frontend --model-repository model_repository --triton-grpc 127.0.0.1:8001 --port 8010

The engine model's config.pbtxt says which checkpoint is served (its `model` parameter; empty:
the embedded default) and the request limits; the frontend reads them (ServedSettings, by
EngineConfig's rules for string settings but without building one, which would load torch),
loads that checkpoint's tokenizer (its tokenizer.json by the `tokenizers` library, giving
transformers' ids without loading torch: contract/tokenizer_file.py), what its config.json and
sentence-transformers files say of its head, hidden size and named prompts (pooling.PooledModel)
and `scoring_presets.json` beside config.pbtxt. A preset whose labels are not single tokens stops the start with a
ConfigError naming it, as does a tokenizer whose ids the file alone cannot promise.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import ConfigError
from ..contract.limits import DEFAULT_MAX_ITEMS, DEFAULT_MAX_WAITING, default_max_prompts, resolve_max_input_len
from ..contract.paths import default_cache_dir
from ..serving.host.model_settings import engine_settings
from ..contract.setting_strings import is_unset, optional_int
from ..contract.tokenizer_file import NotAsWritten, load_tokenizer
from ..contract.wire import MODEL
from .pooling import PooledModel
from .presets import PRESETS_FILE, TemplateTokenizer, load_presets
from .scoring import DEFAULT_MAX_PROMPTS_PER_CALL, Limits, Scoring
from .upstream import TritonUpstream

log = logging.getLogger("prefillonly.frontend")
# on SIGTERM, calls in flight get this long to finish (the supervisor has drained the engine by then)
GRACEFUL_SHUTDOWN_S = 5


@dataclass(frozen=True)
class ServedSettings:
    """What the frontend needs of the engine model's settings, with EngineConfig's defaults."""
    model: str | None  # the checkpoint folder; None: the embedded default, kept under cache_dir
    cache_dir: str
    max_input_len: int | None  # None: the checkpoint's context length
    max_items: int
    max_prompts: int  # max_prompts_per_request
    max_waiting: int = DEFAULT_MAX_WAITING

    @classmethod
    def read(cls, model_dir: str | Path) -> "ServedSettings":
        """From `model_dir`/config.pbtxt's parameters; ConfigError for one that is not a number."""
        values = {k: v for k, v in engine_settings(model_dir).items() if not is_unset(v)}

        def number(name: str, default: int | None) -> int | None:
            try:
                value = optional_int(name, values.get(name), minimum=1)
            except ConfigError as e:
                raise ConfigError(f"{model_dir}/config.pbtxt: {e}") from None
            return default if value is None else value

        return cls(model=values.get("model"), cache_dir=values.get("cache_dir") or default_cache_dir(),
                   max_input_len=number("max_input_len", None), max_items=number("max_items", DEFAULT_MAX_ITEMS),
                   max_prompts=number("max_prompts_per_request",
                                      default_max_prompts(number("max_waiting", DEFAULT_MAX_WAITING))),
                   max_waiting=number("max_waiting", DEFAULT_MAX_WAITING))


def build_scoring(model_repository: str | Path, triton_grpc: str, model_name: str = MODEL,
                  presets_path: str | Path | None = None, max_prompts_per_call: int = DEFAULT_MAX_PROMPTS_PER_CALL) -> Scoring:
    """The scoring frontend over the engine model of `model_repository`. max_prompts_per_call: the
    most prompts one completions (or item_first score) call may carry; each is its own engine
    request, so it is capped at the engine's max_waiting (the queue must take the call whole)."""
    from ..model.default_model import ensure_default_model
    from ..contract.checkpoint import context_length_of

    model_dir = Path(model_repository) / model_name
    settings = ServedSettings.read(model_dir)
    checkpoint = settings.model or ensure_default_model(settings.cache_dir)
    tokenizer = _tokenizer(checkpoint)
    max_input_len = resolve_max_input_len(settings.max_input_len, context_length_of(checkpoint))
    tokens = TemplateTokenizer(tokenizer, max_input_len)
    presets = load_presets(presets_path or model_dir / PRESETS_FILE, tokens)
    if max_prompts_per_call > settings.max_waiting:
        log.warning("--max-prompts-per-call %d is over the engine's max_waiting %d: capped at it", max_prompts_per_call,
                    settings.max_waiting)
    limits = Limits(max_documents=settings.max_items, max_prompts=min(max_prompts_per_call, settings.max_waiting))
    return Scoring(tokens, presets, TritonUpstream(triton_grpc, model_name), base_model=model_name, limits=limits,
                   pooled=PooledModel.read(checkpoint))


def _tokenizer(checkpoint):
    """The checkpoint's tokenizer.json without transformers (no torch in this process), or, where
    that alone would not give transformers' ids (Qwen's and Gemma's own classes, code of its own,
    no tokenizer.json), transformers' AutoTokenizer: the engine's ids, at torch's start-up cost."""
    try:
        return load_tokenizer(checkpoint)
    except NotAsWritten as e:
        log.warning("%s; loading transformers' AutoTokenizer instead (this process then loads torch)", e)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except Exception as e:
        raise ConfigError(f"the scoring frontend needs the model's tokenizer: cannot load it from {checkpoint}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefillonly.frontend", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-repository", required=True)
    p.add_argument("--triton-grpc", required=True, help="host:port of Triton's gRPC (or the front door's in a fleet)")
    p.add_argument("--model-name", default=MODEL, help="the engine model in the repository")
    p.add_argument("--presets", default=None, help=f"scoring presets (default: {PRESETS_FILE} beside its config.pbtxt)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--max-prompts-per-call", type=int, default=DEFAULT_MAX_PROMPTS_PER_CALL,
                   help="most prompts one /v1/completions call may carry (each its own engine request; capped at the "
                        f"engine's max_waiting; default {DEFAULT_MAX_PROMPTS_PER_CALL}, lm-evaluation-harness's batch sizes)")
    p.add_argument("--triton-http", default=None, metavar="HOST:PORT",
                   help="Triton's HTTP port: serve its generate endpoints here too, with the caller's tenant (the serve "
                        "command sets it when API keys are on)")
    p.add_argument("--check", action="store_true", help="load the tokenizer and presets, print them, exit")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if a.max_prompts_per_call < 1:
            raise ConfigError(f"--max-prompts-per-call must be at least 1, got {a.max_prompts_per_call}")
        scoring = build_scoring(a.model_repository, a.triton_grpc, a.model_name, a.presets, a.max_prompts_per_call)
    except ConfigError as e:
        print(f"prefillonly.frontend: {e}", file=sys.stderr)
        return 2
    summary = {name: {"labels": list(p.labels), "label_ids": list(p.label_ids)} for name, p in scoring.presets.items()}
    log.info("scoring presets %s; max input %d tokens; engine at %s", json.dumps(summary), scoring.tokens.max_input_len,
             a.triton_grpc)
    if a.check:
        return 0
    import uvicorn

    from .routes import build_app

    uvicorn.run(build_app(scoring, a.triton_http), host=a.host, port=a.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
