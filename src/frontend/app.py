"""Builds the frontend from a model repository, and runs it:

    python -m prefillonly.frontend --model-repository model_repository --triton-grpc 127.0.0.1:8001 --port 8010

The engine model's config.pbtxt says which checkpoint is served (its `model` parameter; empty:
the embedded default) and the request limits; the frontend loads that checkpoint's tokenizer
(so its token ids are the engine's) and `scoring_presets.json` beside config.pbtxt. A preset
whose labels are not single tokens stops the start with a ConfigError naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..errors import ConfigError
from ..serving.host.model_settings import engine_settings
from .presets import PRESETS_FILE, TemplateTokenizer, load_presets
from .scoring import Limits, Scoring
from .upstream import TritonUpstream

log = logging.getLogger("prefillonly.frontend")
# on SIGTERM, calls in flight get this long to finish (the supervisor has drained the engine by then)
GRACEFUL_SHUTDOWN_S = 5
def build_scoring(model_repository: str | Path, triton_grpc: str, model_name: str = "prefillonly",
                  presets_path: str | Path | None = None) -> Scoring:
    from transformers import AutoTokenizer

    from ..config import EngineConfig
    from ..default_model import ensure_default_model
    from ..model_spec import ModelSpec

    model_dir = Path(model_repository) / model_name
    config = EngineConfig.from_strings(engine_settings(model_dir))
    checkpoint = config.model or ensure_default_model(config.cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except Exception as e:
        raise ConfigError(f"the scoring frontend needs the model's tokenizer: cannot load it from {checkpoint}: {e}") from e
    max_input_len = config.max_input_len or ModelSpec.from_folder(checkpoint).context_length
    tokens = TemplateTokenizer(tokenizer, max_input_len)
    presets = load_presets(presets_path or model_dir / PRESETS_FILE, tokens)
    limits = Limits(max_documents=config.max_items, max_prompts=config.max_prompts_per_request)
    return Scoring(tokens, presets, TritonUpstream(triton_grpc, model_name), base_model=model_name, limits=limits)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefillonly.frontend", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-repository", required=True)
    p.add_argument("--triton-grpc", required=True, help="host:port of Triton's gRPC (or the front door's in a fleet)")
    p.add_argument("--model-name", default="prefillonly", help="the engine model in the repository")
    p.add_argument("--presets", default=None, help=f"scoring presets (default: {PRESETS_FILE} beside its config.pbtxt)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--check", action="store_true", help="load the tokenizer and presets, print them, exit")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        scoring = build_scoring(a.model_repository, a.triton_grpc, a.model_name, a.presets)
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

    uvicorn.run(build_app(scoring), host=a.host, port=a.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
