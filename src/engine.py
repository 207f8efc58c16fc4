"""Engine: the public entry point. Loads a model once, scores prompts one forward pass each.

    with Engine(EngineConfig()) as engine:
        r = engine.score("Is the sky blue? Answer:", [" Yes", " No"])
        r.chosen.text, r.chosen.prob

Request path: validate + tokenize (prompts.py) -> admission (length, memory budget) ->
HybridPrefillExecutor.forward (executor.py) -> ScoreResult (scoring.py).
"""

from __future__ import annotations

import logging
import numbers
import threading
import time

import torch

from .config import EngineConfig
from .default_model import ensure_default_model
from .errors import ConfigError, InvalidRequestError, OverBudgetError, PromptTooLongError
from .executor import HybridPrefillExecutor
from .kernels.attention import resolve_backend
from .memory import PeakMemoryMeter, available_memory_bytes, predict_peak_bytes
from .model_spec import ModelSpec
from .prompts import PromptEncoder
from .result import ScoreResult
from .scoring import build_result
from .weights import ModelWeights

log = logging.getLogger("prefillonly")

# Fraction of the memory free at start-up that the default activation budget may use.
_DEFAULT_BUDGET_FRACTION = 0.9


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        t0 = time.perf_counter()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model_path = config.model or ensure_default_model(config.cache_dir)
        self.spec = ModelSpec.from_folder(self.model_path)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        weights = ModelWeights.load(self.model_path, self.spec, self.dtype, self.device)
        backend = resolve_backend(config.attention_backend, self.device)
        self.executor = HybridPrefillExecutor(self.spec, weights, self.dtype, self.device, backend)
        self.encoder = PromptEncoder(_load_tokenizer(self.model_path), self.spec.vocab_size)
        self.max_input_len = config.max_input_len or self.spec.context_length
        if self.max_input_len > self.spec.context_length:
            log.warning(
                "max_input_len %d exceeds the model's context length %d (explicit override)",
                self.max_input_len, self.spec.context_length,
            )
        self.activation_budget_bytes = config.activation_budget_bytes or int(
            _DEFAULT_BUDGET_FRACTION * available_memory_bytes(self.device)
        )
        self._meter = PeakMemoryMeter(self.device)
        self._lock = threading.Lock()  # one forward at a time: prefill is compute-bound
        self._closed = False
        self.executor.forward(torch.zeros(8, dtype=torch.long), config.chunk_size)  # warm-up
        log.info(
            "engine ready: %s (%s, %d layers) %s on %s, chunk %s, attention %s, max input %d, budget %.1f MiB, %.1f s",
            self.model_path, self.spec.architecture, self.spec.num_layers, config.dtype, self.device,
            config.chunk_size or "none", backend, self.max_input_len, self.activation_budget_bytes / 2**20,
            time.perf_counter() - t0,
        )

    # -- public API -------------------------------------------------------------------
    def score(self, prompt, allowed_tokens, *, top_k: int = 0, apply_chat_template: bool = False) -> ScoreResult:
        """Probability of each allowed token at the position after `prompt` (one forward pass).

        prompt: text, UTF-8 bytes, or a sequence of token ids. allowed_tokens: strings (each
        exactly one token, e.g. " Yes") and/or token ids. top_k: also return the k most likely
        tokens of the full vocabulary.
        """
        if self._closed:
            raise InvalidRequestError("engine is closed")
        allowed_ids = self.encoder.resolve_allowed(allowed_tokens)
        top_k = self._check_top_k(top_k)
        ids = self.encoder.encode_prompt(prompt, apply_chat_template=apply_chat_template)
        self._admit(len(ids))
        token_ids = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            self._meter.start()
            out = self.executor.forward(token_ids, self.config.chunk_size)
            peak = self._meter.peak_growth()
        return build_result(out.logits, allowed_ids, top_k, self.encoder.token_text, len(ids), 0, peak)

    def predict_peak_bytes(self, prompt_tokens: int) -> int:
        """Predicted peak extra memory of a request of `prompt_tokens` tokens."""
        return predict_peak_bytes(self.spec, prompt_tokens, self.config.chunk_size, self.dtype)

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- admission ----------------------------------------------------------------------
    def _admit(self, n: int) -> None:
        if n > self.max_input_len:
            raise PromptTooLongError(f"prompt has {n} tokens, over the max input length {self.max_input_len}")
        need = self.predict_peak_bytes(n)
        if need > self.activation_budget_bytes:
            raise OverBudgetError(
                f"a {n}-token prompt needs ~{need / 2**20:.1f} MiB of activation memory, over the budget of "
                f"{self.activation_budget_bytes / 2**20:.1f} MiB (raise activation_budget_bytes or lower chunk_size)"
            )

    def _check_top_k(self, top_k) -> int:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise InvalidRequestError(f"top_k must be an integer, got {top_k!r}")
        if not 0 <= top_k <= self.spec.vocab_size:
            raise InvalidRequestError(f"top_k {top_k} must be between 0 and the vocabulary size {self.spec.vocab_size}")
        return int(top_k)


def _load_tokenizer(folder: str):
    import os

    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        log.info("no tokenizer in %s: the engine takes token ids only", folder)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a broken tokenizer is a config problem, not a crash
        raise ConfigError(f"cannot load the tokenizer of {folder}: {e}") from e
