"""Engine: the public entry point. Loads a model once, scores prompts one forward pass each.

    with Engine(EngineConfig()) as engine:
        r = engine.score("Is the sky blue? Answer:", [" Yes", " No"])
        r.chosen.text, r.chosen.prob

Request path: submit() validates + tokenizes in the caller's thread (prompts.py) and puts
the request in the waiting set -> the worker thread asks the scheduler for the next request
(scheduler/: FCFS | SJF | CSJF, against the prefix cache's current state) -> prefix cache:
match/pin cached blocks, reserve blocks to keep (cache/) -> admission (memory budget) ->
HybridPrefillExecutor.forward over the uncached tokens (executor.py) -> commit the new blocks
-> ScoreResult (scoring.py) -> the request's Future.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .cache import PrefixCache
from .cache.prefix_kv import PrefixKV
from .config import EngineConfig
from .default_model import ensure_default_model
from .errors import (
    ConfigError,
    DeadlineExceededError,
    EngineClosedError,
    InvalidRequestError,
    OverBudgetError,
    PrefillOnlyError,
    PromptTooLongError,
)
from .executor import HybridPrefillExecutor
from .kernels.attention import inplace_attention_supported, resolve_backend
from .limits import RequestLimits, max_token_bytes
from .memory import PeakMemoryMeter, available_memory_bytes, predict_peak_bytes
from .model_spec import ModelSpec
from .prompts import PromptEncoder, decode_utf8
from .result import ScoreResult
from .scheduler import JctEstimator, Scheduler, WaitingRequest
from .scoring import build_result
from .weights import ModelWeights

log = logging.getLogger("prefillonly")

# Shares of the memory free at start-up that the defaults may use: the prefix-KV pool first,
# then the activation budget out of what is left.
_DEFAULT_CACHE_FRACTION = 0.2
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
        self.weight_bytes = weights.nbytes()
        backend = resolve_backend(config.attention_backend, self.device)
        self.executor = HybridPrefillExecutor(self.spec, weights, self.dtype, self.device, backend)
        tokenizer = _load_tokenizer(self.model_path)
        self.max_input_len = config.max_input_len or self.spec.context_length
        self.limits = _request_limits(config, self.max_input_len, tokenizer)
        self.encoder = PromptEncoder(tokenizer, self.spec.vocab_size, self.limits)
        if self.max_input_len > self.spec.context_length:
            log.warning(
                "max_input_len %d exceeds the model's context length %d (explicit override)",
                self.max_input_len, self.spec.context_length,
            )
        free = available_memory_bytes(self.device)
        cache_bytes = config.cache_budget_bytes
        if cache_bytes is None:
            cache_bytes = int(_DEFAULT_CACHE_FRACTION * free)
        # the pool's pages are counted now even where the OS maps them lazily (CPU)
        self.activation_budget_bytes = config.activation_budget_bytes or int(_DEFAULT_BUDGET_FRACTION * max(0, free - cache_bytes))
        self.cache = self._make_cache(cache_bytes)
        self._meter = PeakMemoryMeter(self.device)
        self.executor.forward(torch.zeros(8, dtype=torch.long), config.chunk_size)  # warm-up
        self.jct = JctEstimator(fallback_s_per_token=self._time_per_token())
        self.scheduler = Scheduler(config.scheduling_policy, self.jct, self._scheduler_cached_tokens,
                                   max_waiting=config.max_waiting, lambda_tokens_per_s=config.lambda_tokens_per_s)
        self.counters: Counter = Counter()  # completed, failed, rejected:<code>, cancelled
        self._cv = threading.Condition()  # guards the scheduler and _closed
        self._closed = False
        # one worker runs one request at a time (prefill is compute-bound); daemon: it never
        # keeps the process alive, and close() fails whatever still waits
        self._worker = threading.Thread(target=self._serve, name="prefillonly-engine", daemon=True)
        self._worker.start()
        log.info(
            "engine ready: %s (%s, %d layers) %s on %s, chunk %s, attention %s, max input %d, "
            "prefix cache %.1f MiB in blocks of %d (+%.1f MiB second tier), activation budget %.1f MiB, "
            "scheduling %s, %.1f s",
            self.model_path, self.spec.architecture, self.spec.num_layers, config.dtype, self.device,
            config.chunk_size or "none", backend, self.max_input_len,
            cache_bytes / 2**20, config.cache_block_size, config.cache_second_tier_bytes / 2**20,
            self.activation_budget_bytes / 2**20, config.scheduling_policy, time.perf_counter() - t0,
        )

    # -- public API -------------------------------------------------------------------
    def submit(self, prompt, allowed_tokens, *, top_k: int = 0, apply_chat_template: bool = False,
               cache_prefix_len: int | None = None, cache_namespace: str | None = None, user: str | None = None,
               priority: int = 0, deadline_s: float | None = None) -> "Future[ScoreResult]":
        """Queue one request; the Future gets its ScoreResult (or its error).

        prompt: text, UTF-8 bytes, or a sequence of token ids. allowed_tokens: strings (each
        exactly one token, e.g. " Yes") and/or token ids. top_k: also return the k most likely
        tokens of the full vocabulary. cache_prefix_len: keep at most this many leading tokens
        in the prefix cache (e.g. the shared user profile); default the whole prompt.
        cache_namespace: cache hits never cross namespaces (tenant isolation); `user` is the
        namespace when none is given. priority: higher runs first. deadline_s: seconds from now
        after which the request fails with DeadlineExceededError instead of starting.
        Bad input raises here, in the caller's thread; the Future never sees it.
        """
        allowed_ids = self.encoder.resolve_allowed(allowed_tokens)
        top_k = self._check_top_k(top_k)
        ids = self.encoder.encode_prompt(prompt, apply_chat_template=apply_chat_template)
        keep = self._check_cache_prefix_len(cache_prefix_len, len(ids))
        namespace = _check_namespace(cache_namespace, user)
        self._check_length(len(ids))
        run = lambda: self._run_single(ids, allowed_ids, top_k, keep, namespace)  # noqa: E731
        return self._enqueue(ids, namespace, run, priority, deadline_s, user)

    def submit_items(self, prompt, items, allowed_tokens, *, item_template: str | None = None, top_k: int = 0,
                     apply_chat_template: bool = False, cache_prefix_len: int | None = None,
                     cache_namespace: str | None = None, user: str | None = None, priority: int = 0,
                     deadline_s: float | None = None) -> "Future[list[ScoreResult]]":
        """Queue N items that share one prompt (e.g. a user profile and candidate posts).

        The shared prompt is computed once per request (its K/V held for the request, whatever
        the cache budget) and each item is scored as a suffix over it: result i is the
        distribution after `prompt + item_i`. Items are text (tokenized on their own, without
        special tokens; `item_template` such as "\\nPost: {item}\\nAnswer:" is applied first)
        or token ids. The shared prompt goes through the prefix cache like a plain request
        (cache_prefix_len defaults to the whole shared prompt).
        """
        allowed_ids = self.encoder.resolve_allowed(allowed_tokens)
        top_k = self._check_top_k(top_k)
        shared = self.encoder.encode_prompt(prompt, apply_chat_template=apply_chat_template)
        item_ids = self._encode_items(items, item_template)
        keep = self._check_cache_prefix_len(cache_prefix_len, len(shared))
        namespace = _check_namespace(cache_namespace, user)
        self._check_length(len(shared) + max(len(x) for x in item_ids))
        run = lambda: self._run_items(shared, item_ids, allowed_ids, top_k, keep, namespace)  # noqa: E731
        return self._enqueue(shared, namespace, run, priority, deadline_s, user, extra_tokens=sum(map(len, item_ids)))

    def score(self, prompt, allowed_tokens, **kwargs) -> ScoreResult:
        """submit(...).result(): the probabilities of the allowed tokens after `prompt`."""
        return self.submit(prompt, allowed_tokens, **kwargs).result()

    def score_items(self, prompt, items, allowed_tokens, **kwargs) -> list[ScoreResult]:
        """submit_items(...).result(): one ScoreResult per item, in item order."""
        return self.submit_items(prompt, items, allowed_tokens, **kwargs).result()

    def stats(self) -> dict:
        """Counters for metrics: requests by outcome, waiting, JCT error, prefix cache."""
        with self._cv:
            waiting = len(self.scheduler)
        out = {"waiting": waiting, **self.counters, "jct_mean_abs_rel_error": self.jct.mean_abs_relative_error(),
               "tokens_computed": self.executor.tokens_computed}
        out["budget_bytes"] = {"weights": self.weight_bytes, "activation": self.activation_budget_bytes,
                               **{f"cache_tier{t}": b for t, b in (self.cache.capacity_bytes() if self.cache else {}).items()}}
        if self.cache is not None:
            out["cache"] = vars(self.cache.stats).copy()
            out["cache_bytes_in_use"] = self.cache.bytes_in_use()
        return out

    def predict_peak_bytes(self, new_tokens: int, prefix_tokens: int = 0, inplace_attention: bool = False) -> int:
        """Predicted peak extra memory of computing `new_tokens` after `prefix_tokens` cached ones."""
        return predict_peak_bytes(self.spec, new_tokens, self.config.chunk_size, self.dtype, prefix_tokens,
                                  inplace_attention=inplace_attention, attention_backend=self.executor.attention_backend,
                                  device=self.device)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking work; fail every waiting request with EngineClosedError; let the running
        one finish; stop the worker. Idempotent."""
        with self._cv:
            already, self._closed = self._closed, True
            waiting = self.scheduler.drain()
            self._cv.notify_all()
        for req in waiting:
            self._fail(req, EngineClosedError("engine closed before the request ran"))
        if not already and threading.current_thread() is not self._worker:
            self._worker.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- request loop -------------------------------------------------------------------
    def _enqueue(self, ids, namespace, run: Callable, priority, deadline_s, user, extra_tokens: int = 0) -> Future:
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        deadline = _check_deadline(deadline_s)
        hashes = self.cache.hashes(ids, namespace) if self.cache else []
        fut = RequestFuture()
        req = WaitingRequest(prompt_tokens=len(ids) + extra_tokens, block_hashes=hashes, priority=int(priority),
                             user=user, payload=_Job(fut, run))
        with self._cv:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if deadline is not None:
                req.deadline = self.scheduler.clock() + deadline
            try:
                self.scheduler.add(req)
            except PrefillOnlyError as e:
                self.counters[f"rejected:{e.code}"] += 1
                raise
            self._cv.notify()
        fut.add_done_callback(lambda f: f.cancelled() and self._forget(req))
        return fut

    def _forget(self, req: WaitingRequest) -> None:
        """A waiting request's Future was cancelled: drop it from the waiting set."""
        with self._cv:
            if self.scheduler.remove(req):
                self.counters["cancelled"] += 1

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not len(self.scheduler):
                    self._cv.wait()
                if self._closed:
                    return
                expired = self.scheduler.take_expired()
                req = self.scheduler.pick()
            for r in expired:
                self._fail(r, DeadlineExceededError("deadline passed while the request waited; it was not run"))
            if req is None or not req.payload.future.set_running_or_notify_cancel():
                continue  # nothing left, or cancelled between pick and start
            req.payload.future.started_at = time.monotonic()
            # Counters move before the Future resolves: its callbacks answer the caller, who may
            # read stats() (or the metrics endpoint) the moment the answer arrives.
            try:
                result = req.payload.run()
            except BaseException as e:  # every request gets exactly one answer
                self.counters[f"failed:{getattr(e, 'code', type(e).__name__)}"] += 1
                req.payload.future.set_exception(e)
            else:
                self.counters["completed"] += 1
                req.payload.future.set_result(result)

    def _fail(self, req: WaitingRequest, error: PrefillOnlyError) -> None:
        fut = req.payload.future
        if fut.set_running_or_notify_cancel():
            self.counters[f"rejected:{error.code}"] += 1
            fut.set_exception(error)

    def _scheduler_cached_tokens(self, req: WaitingRequest) -> int:
        return self.cache.cached_tokens(req.block_hashes) if self.cache else 0

    def _time_per_token(self, n: int = 256) -> float:
        """Seed of the JCT estimate: one cold forward's seconds per token (the fit takes over
        after a few real requests)."""
        t0 = time.perf_counter()
        self.executor.forward(torch.zeros(n, dtype=torch.long), self.config.chunk_size)
        return (time.perf_counter() - t0) / n

    # -- running one request (worker thread) ---------------------------------------------
    def _run_single(self, ids, allowed_ids, top_k, keep, namespace) -> ScoreResult:
        with self._cached_prefix(ids, namespace, keep) as ticket:
            p = ticket.cached_tokens if ticket else 0
            inplace = self._memory_plan(len(ids) - p, p)
            t0 = time.perf_counter()
            self._meter.start()
            out = self._forward_uncached(ids, ticket, inplace_attention=inplace)
            peak = self._meter.peak_growth()
            self.jct.observe(len(ids) - p, p, time.perf_counter() - t0)
        return build_result(out.logits, allowed_ids, top_k, self.encoder.token_text, len(ids), p, peak)

    def _run_items(self, shared, item_ids, allowed_ids, top_k, keep, namespace) -> list[ScoreResult]:
        results = []
        with self._cached_prefix(shared, namespace, keep) as ticket:
            p = ticket.cached_tokens if ticket else 0
            inplace_shared = self._memory_plan(len(shared) - p, p, captured=len(shared))
            # the items run while the shared K/V is held: count it like a capture of that size
            inplace_items = self._memory_plan(max(len(x) for x in item_ids), len(shared), captured=len(shared))
            # the shared prompt's K/V for every layer, held for this request only
            shared_kv: PrefixKV = self._forward_uncached(shared, ticket, capture=(0, len(shared)),
                                                         inplace_attention=inplace_shared).captured
            for ids in item_ids:
                self._meter.start()
                out = self.executor.forward(torch.tensor(ids, dtype=torch.long), self.config.chunk_size, prefix=shared_kv,
                                            inplace_attention=inplace_items)
                peak = self._meter.peak_growth()
                results.append(build_result(out.logits, allowed_ids, top_k, self.encoder.token_text,
                                            len(shared) + len(ids), p, peak))
        return results

    def _forward_uncached(self, ids, ticket, **kwargs):
        """The forward over the tokens the cache did not hold, fed the cached prefix and keeping
        the ticket's blocks."""
        p = ticket.cached_tokens if ticket else 0
        return self.executor.forward(torch.tensor(ids[p:], dtype=torch.long), self.config.chunk_size,
                                     prefix=ticket.source if ticket else None, sink=ticket.sink if ticket else None,
                                     **kwargs)

    # -- prefix cache -------------------------------------------------------------------------
    def _make_cache(self, budget_bytes: int) -> PrefixCache | None:
        block = self.config.cache_block_size
        cache = PrefixCache(self.spec, self.dtype, self.device, block, budget_bytes,
                            self.config.cache_second_tier_bytes, model_id=f"{os.path.realpath(self.model_path)}|{self.dtype}")
        if cache.index.capacity[1] == 0:
            if budget_bytes:
                log.warning("cache_budget_bytes %d is smaller than one block (%d bytes): prefix cache off", budget_bytes, cache.block_bytes)
            return None
        return cache

    @contextmanager
    def _cached_prefix(self, ids, namespace, keep_len):
        """Pin the cached prefix and reserve blocks to keep; commit them if the body succeeds."""
        if self.cache is None:
            yield None
            return
        ticket = self.cache.begin(ids, namespace, keep_len)
        try:
            yield ticket
        except BaseException:
            self.cache.abort(ticket)
            raise
        self.cache.commit(ticket)

    # -- validation and admission -------------------------------------------------------
    def _check_length(self, n: int) -> None:
        if n > self.max_input_len:
            raise PromptTooLongError(f"prompt has {n} tokens, over the max input length {self.max_input_len}")

    def _memory_plan(self, new_tokens: int, prefix_tokens: int, captured: int = 0) -> bool:
        """Admit a forward against the activation budget. Returns whether it must write
        attention in place (CPU: slower, no second [S, q_width] tensor) to fit; raises
        OverBudgetError if it fits neither way."""

        def need(inplace: bool) -> int:
            return predict_peak_bytes(self.spec, new_tokens, self.config.chunk_size, self.dtype, prefix_tokens,
                                      captured, inplace_attention=inplace, attention_backend=self.executor.attention_backend,
                                      device=self.device)

        if need(False) <= self.activation_budget_bytes:
            return False
        if inplace_attention_supported(self.device) and need(True) <= self.activation_budget_bytes:
            self.counters["inplace_attention"] += 1
            return True
        raise OverBudgetError(
            f"a {new_tokens + prefix_tokens}-token prompt needs ~{need(inplace_attention_supported(self.device)) / 2**20:.1f} MiB "
            f"of activation memory, over the budget of {self.activation_budget_bytes / 2**20:.1f} MiB "
            f"(raise activation_budget_bytes or lower chunk_size)"
        )

    def _check_top_k(self, top_k) -> int:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise InvalidRequestError(f"top_k must be an integer, got {top_k!r}")
        if not 0 <= top_k <= self.spec.vocab_size:
            raise InvalidRequestError(f"top_k {top_k} must be between 0 and the vocabulary size {self.spec.vocab_size}")
        return int(top_k)

    @staticmethod
    def _check_cache_prefix_len(value, prompt_len: int) -> int:
        if value is None:
            return prompt_len
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidRequestError(f"cache_prefix_len must be an integer, got {value!r}")
        if not 0 <= value <= prompt_len:
            raise InvalidRequestError(f"cache_prefix_len {value} must be between 0 and the prompt length {prompt_len}")
        return int(value)

    def _encode_items(self, items, template: str | None) -> list[list[int]]:
        if items is None or isinstance(items, (str, bytes)) or not hasattr(items, "__len__"):
            raise InvalidRequestError("items must be a list of item texts or token-id lists")
        if len(items) == 0:
            raise InvalidRequestError("items is empty; give at least one item")
        self.limits.check_count(len(items), "items", "max_items")
        if template is not None:
            _check_item_template(template)
            self.limits.check_text(template, "item_template")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, (bytes, bytearray)):
                self.limits.check_text(item, f"item {i}")  # before decoding it
                item = decode_utf8(bytes(item), f"item {i}")
            if template is not None and isinstance(item, str):
                self.limits.check_text(item, f"item {i}")  # before the template copies it
                item = template.replace(ITEM_PLACEHOLDER, item)
            out.append(self.encoder.encode_prompt(item, what=f"item {i}", add_special_tokens=False))
        return out


class RequestFuture(Future):
    """The Future submit() returns. started_at: time.monotonic() when the worker started the
    request (None while it waits), so that a server can report queue wait."""

    started_at: float | None = None


@dataclass
class _Job:
    future: Future
    run: Callable[[], object]


ITEM_PLACEHOLDER = "{item}"


def _check_item_template(template) -> None:
    """Only the literal {item} is replaced; everything else is text (no format specs, no fields:
    str.format would let a client ask for `{item:>4000000}` or `{item.__class__}`)."""
    if not isinstance(template, str):
        raise InvalidRequestError(f"item_template must be a string, got {type(template).__name__}")
    if ITEM_PLACEHOLDER not in template:
        raise InvalidRequestError(f"item_template {template[:80]!r} has no {ITEM_PLACEHOLDER}: each item would be lost")


def _request_limits(config: EngineConfig, max_input_len: int, tokenizer) -> RequestLimits:
    token_bytes = max_token_bytes(tokenizer)
    # no tokenizer: prompts are token ids, and a text is refused anyway
    derived = max_input_len * token_bytes if token_bytes else max_input_len
    return RequestLimits(max_prompt_bytes=config.max_prompt_bytes or derived,
                         max_prompts_per_request=config.max_prompts_per_request, max_items=config.max_items,
                         max_allowed_tokens=config.max_allowed_tokens, max_token_bytes=token_bytes)


def _check_namespace(namespace, user) -> str | None:
    for name, value in (("cache_namespace", namespace), ("user", user)):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return namespace if namespace is not None else user


def _check_deadline(deadline_s) -> float | None:
    if deadline_s is None:
        return None
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, numbers.Real) or not deadline_s > 0:
        raise InvalidRequestError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    return float(deadline_s)


def _load_tokenizer(folder: str):
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        log.info("no tokenizer in %s: the engine takes token ids only", folder)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a broken tokenizer is a config problem, not a crash
        raise ConfigError(f"cannot load the tokenizer of {folder}: {e}") from e
