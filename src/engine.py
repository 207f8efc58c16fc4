"""Engine: the public entry point. Loads a model once, scores prompts in batched forward steps.

    with Engine(EngineConfig()) as engine:
        r = engine.score("Is the sky blue? Answer:", [" Yes", " No"])
        r.chosen.text, r.chosen.prob

Request path: submit_task() has the request's kind (tasks/) validate + tokenize in the caller's
thread (prompts.py) into one Request record (request.py) and the scheduler queues it (refusing
at once a prompt that could never fit the activation budget) -> the worker thread runs one step
at a time, in three calls:

    plan = scheduler.schedule()               # scheduler/: FCFS | SJF | CSJF order against the prefix
                                              # cache's current state; members pinned, memory decided
    outcome = runner.execute(plan)            # runner.py: the cache's data moves, one forward over every
                                              # member's uncached tokens (executor.py), each answer
                                              # built by its request's kind
    answers = scheduler.finish(plan, outcome) # tickets committed or aborted, counters

-> each answer goes to its request's Future on the completion thread (completions.py) while the
worker starts the next step.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from .cache.prefix_cache import PrefixCache
from .completions import CompletionThread
from .config import EngineConfig
from .model.default_model import ensure_default_model
from .contract.checkpoint import CLASSIFIER_HEAD, LM_HEAD, NO_HEAD
from .contract.errors import ConfigError, EngineClosedError, InvalidRequestError
from .contract.pooling_files import pooling_for
from .worker.executor import HybridPrefillExecutor
from .kernels import gpu_support
from .kernels.backend import KernelBackend
from .kernels.gpu_selfcheck import ModelShapes
from .contract.limits import RequestLimits, derived_max_prompt_bytes, max_token_bytes, resolve_max_input_len
from .worker.memory import ActivationBudget, available_memory_bytes
from .model.spec import ModelSpec
from .prompts import PromptEncoder
from .request import Request, check_cache_prefix_len, check_deadline, check_namespace, check_priority, check_tenant
from .contract.tenants import tenant_namespace
from . import tasks
from .contract.wire import ClassificationResult, ContinuationScore, EmbeddingResult, PromptLogprobs, ScoreResult
from .worker.runner import PrefillRunner
from .scheduler import Answer, IndexPrefixView, JctEstimator, Scheduler, StepBudget, StepOutcome, StepPlan
from .stats import EngineStats, StepRecord
from .model.weights import ModelWeights

log = logging.getLogger("prefillonly")

_RECENT_STEPS = 256  # step sizes kept for the metrics' histograms (read far more often than this fills)
# A running step counts as making progress while a forward of it finished (or it began) this recently:
# a liveness probe is then answered at once (progressing_step) instead of waiting for the step's end.
PROGRESS_WINDOW_S = 30.0


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
        log.info("dtype %s (%s)", config.dtype, config.dtype_reason)  # what dtype="auto" chose here, and why
        with gpu_support.device_scope(self.device):  # every kernel launches on the engine's device
            self.executor = self._load_executor()
            self._load_prompts()
            free = available_memory_bytes(self.device)
            cache_bytes = config.cache_budget_for(free)
            # the pool's pages are counted now even where the OS maps them lazily (CPU)
            self.activation_budget_bytes = config.activation_budget_for(free, cache_bytes)
            self.cache = self._make_cache(cache_bytes)
            self.executor.forward(torch.zeros(8, dtype=torch.long), config.chunk_size)  # warm-up
            self.jct = JctEstimator(fallback_s_per_token=self._time_per_token())
        self.max_batch_tokens = config.batch_token_budget
        self.memory = ActivationBudget(self.spec, self.executor.kernels, config.chunk_size, self.activation_budget_bytes)
        self.runner = PrefillRunner(self.executor, self.cache, config.chunk_size, self.encoder.token_text)
        self.scheduler = Scheduler(config.scheduling_policy, self.jct, IndexPrefixView(self.cache.index) if self.cache else None,
                                   budget=StepBudget(self.max_batch_tokens, self.memory), max_waiting=config.max_waiting,
                                   lambda_tokens_per_s=config.lambda_tokens_per_s)
        self._steps = 0
        self._step_ends_at = 0.0  # monotonic time the running step is predicted to end (0: none runs)
        self._step_began = 0.0  # monotonic time the running step began (0: none runs)
        self._recent_steps: deque[StepRecord] = deque(maxlen=_RECENT_STEPS)
        self._cv = threading.Condition()  # guards the scheduler (and its counters), the step records and _closed
        self._closed = False
        # answers are delivered off the worker, so a slow callback never delays the next step
        self._completions = CompletionThread()
        # one worker runs one forward step at a time (prefill is compute-bound); daemon: it never
        # keeps the process alive, and close() fails whatever still waits
        self._worker = threading.Thread(target=self._serve, name="prefillonly-engine", daemon=True)
        self._worker.start()
        log.info(
            "engine ready: %s (%s, %d layers, answers %s) %s on %s, chunk %s, attention %s, linear %s, score head %s, max input %d, "
            "prefix cache %.1f MiB in blocks of %d (+%.1f MiB second tier), activation budget %.1f MiB, "
            "scheduling %s, up to %d tokens per step, %.1f s",
            self.model_path, self.spec.architecture, self.spec.num_layers, _HEAD_ASKS[self.spec.head], config.dtype, self.device,
            config.chunk_size or "none", self.executor.kernels.attention, self.executor.kernels.linear,
            self.executor.kernels.score_head, self.max_input_len,
            cache_bytes / 2**20, config.cache_block_size, config.cache_second_tier_bytes / 2**20,
            self.activation_budget_bytes / 2**20, config.scheduling_policy, self.max_batch_tokens, time.perf_counter() - t0,
        )

    def _load_executor(self) -> HybridPrefillExecutor:
        """The weights, the kernels (chosen once, here: the GEMMs timed on layer 0's own weights
        where auto), the executor (which packs the weights for them)."""
        config, spec = self.config, self.spec
        weights = ModelWeights.load(self.model_path, spec, self.dtype, self.device)
        kernels = KernelBackend.choose(self.device, self.dtype, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                       config.attention_backend, config.linear_backend, weights.layers[0].projections(),
                                       config.head_dtype, ModelShapes.of(spec, config.cache_block_size))
        self.weight_bytes = weights.nbytes()
        return HybridPrefillExecutor(spec, weights, kernels)

    def _load_prompts(self) -> None:
        """The tokenizer, the request limits and the prompt encoder."""
        tokenizer = _load_tokenizer(self.model_path)
        self.max_input_len = resolve_max_input_len(self.config.max_input_len, self.spec.context_length)
        if self.max_input_len > self.spec.context_length:
            log.warning("max_input_len %d exceeds the model's context length %d (explicit override)",
                        self.max_input_len, self.spec.context_length)
        self.limits = _request_limits(self.config, self.max_input_len, tokenizer)
        self.encoder = PromptEncoder(tokenizer, self.spec.vocab_size, self.limits)
        self.pooling = pooling_for(self.model_path, self.spec.head)  # how it embeds (None: a classifier)
        # a request the engine's own Triton model checked against self.limits is not checked again
        self._submit_contexts = {checked: tasks.SubmitContext(encoder, self.spec, self.max_input_len,
                                                               self.config.max_decision_tokens, self.pooling)
                                 for checked, encoder in ((False, self.encoder), (True, self.encoder.trusting()))}

    # -- public API -------------------------------------------------------------------
    def submit_task(self, kind: str, prompt, *, cache_prefix_len: int | None = None, cache_namespace: str | None = None,
                    user: str | None = None, tenant: str | None = None, priority: int = 0,
                    deadline_s: float | None = None, limits_checked: bool = False, **arguments) -> Future:
        """Queue one request of the registered kind `kind` (tasks/: "score", "items",
        "loglikelihood", "prompt_logprobs", or one registered since); the Future gets its answer.

        The kind checks and tokenizes `prompt` and its own `arguments`; the options every kind
        shares are checked here: cache_prefix_len keeps at most this many leading tokens in the
        prefix cache (default the whole prompt); cache_namespace: cache hits never cross
        namespaces, `user` is the namespace when none is given; tenant: the team the request is
        for (1-64 characters of [A-Za-z0-9._-], set by a server from the caller's API key, not by
        the client): its namespaces are its own (cache hits never cross tenants, whatever
        cache_namespace or user says) and the scheduler shares turns between the tenants waiting,
        so one tenant's burst does not queue the others behind it; priority: higher runs first;
        deadline_s: seconds from now after which the request fails with DeadlineExceededError
        instead of starting. limits_checked: the caller already checked the request against this
        engine's `limits` (its Triton model does), so the sizes are not checked again. Bad input raises here, in the caller's thread; the Future never sees it."""
        kind_of = tasks.kind_named(kind)
        check_head(kind_of, self.spec)
        request = kind_of.build(self._submit_contexts[limits_checked], prompt, **arguments)
        # the keep boundary in whole blocks, converted once: everything below counts it in blocks
        request.kept_blocks = check_cache_prefix_len(cache_prefix_len, request.cache_tokens) // self.config.cache_block_size
        request.tenant = check_tenant(tenant)
        request.namespace = tenant_namespace(request.tenant, check_namespace(cache_namespace, user))
        return self._enqueue(request, priority, deadline_s)

    def submit(self, prompt, allowed_tokens, *, top_k: int = 0, apply_chat_template: bool = False,
               **options) -> "Future[ScoreResult]":
        """Queue one request (kind "score"); the Future gets its ScoreResult (or its error).

        prompt: text, UTF-8 bytes, or a sequence of token ids. allowed_tokens: strings (each
        exactly one token, e.g. " Yes") and/or token ids. top_k: also return the k most likely
        tokens of the full vocabulary. options: cache_prefix_len (e.g. the shared user profile),
        cache_namespace, user, tenant, priority, deadline_s (submit_task).
        """
        return self.submit_task("score", prompt, allowed=allowed_tokens, top_k=top_k,
                                apply_chat_template=apply_chat_template, **options)

    def submit_items(self, prompt, items, allowed_tokens, *, item_template: str | None = None, top_k: int = 0,
                     apply_chat_template: bool = False, **options) -> "Future[list[ScoreResult]]":
        """Queue N items that share one prompt (kind "items"; e.g. a user profile and candidate posts).

        The shared prompt is computed once per request (its K/V held for the request, whatever
        the cache budget) and each item is scored as a suffix over it: result i is the
        distribution after `prompt + item_i`. Items are text (tokenized on their own, without
        special tokens; `item_template` such as "\\nPost: {item}\\nAnswer:" is applied first)
        or token ids. The shared prompt goes through the prefix cache like a plain request
        (cache_prefix_len defaults to the whole shared prompt).
        """
        return self.submit_task("items", prompt, items=items, allowed=allowed_tokens, item_template=item_template,
                                top_k=top_k, apply_chat_template=apply_chat_template, **options)

    def submit_loglikelihood(self, context, continuations, **options) -> "Future[list[ContinuationScore]]":
        """Queue the log-likelihood of each continuation after `context` (kind "loglikelihood"; a
        multiple-choice question's choices, lm-evaluation-harness's loglikelihood): one
        ContinuationScore per continuation, in order, with the sum of its tokens' log-probabilities
        and whether each token was the most likely one. The context is computed once (through the
        prefix cache like a prompt), the continuations batched over it. Text is tokenized by
        lm-evaluation-harness's rule (PromptEncoder.encode_continuations); token ids are taken as
        they are."""
        return self.submit_task("loglikelihood", context, items=continuations, **options)

    def submit_prompt_logprobs(self, prompt, *, start: int = 1, top_k: int = 0, **options) -> "Future[PromptLogprobs]":
        """Queue the log-probability of each of the prompt's own tokens from position `start` on
        (kind "prompt_logprobs"; each given every token before it; 1 <= start < prompt length) and
        the `top_k` (<= 20) most likely tokens at each: a PromptLogprobs. The prompt goes through
        the prefix cache like any other: cached positions' logprobs come from the final hidden
        states the cache keeps with their K/V (the LM head runs on them; nothing is recomputed)."""
        return self.submit_task("prompt_logprobs", prompt, start=start, top_k=top_k, **options)

    def submit_decide(self, input, questions, *, permutations: int = 1, return_token_ids: bool = False,
                      **options) -> "Future[DecisionResult]":
        """Queue one decision call (kind "decisions"): typed questions (contract.decisions.Question)
        about `input` (a text, or Messages), every question over one shared prefill of the input
        and each option's whole answer scored; permutations: score each choice and score question
        under up to this many option orders, a set closed under reversal (decisions.render.orders), and average (order debiasing). The Future gets a
        DecisionResult: per question its options' probabilities (summarize() gives the winner, the
        expected level and the confidence). options: cache_namespace, user, tenant, priority, deadline_s."""
        from .contract.decisions import DecisionCall, Message

        messages = (Message("user", input),) if isinstance(input, str) else tuple(input)
        call = DecisionCall(messages, tuple(questions), permutations, return_token_ids)
        return self.submit_task("decisions", call, **options)

    def submit_embed(self, prompt, *, dimensions: int | None = None, normalize: bool | None = None,
                     prompt_name: str | None = None, truncate: str | None = None, **options) -> "Future[EmbeddingResult]":
        """Queue one embedding (kind "embed"): the prompt's final hidden states pooled as the checkpoint
        says (its sentence-transformers files: last token, mean or first; else the last token,
        normalised). dimensions: Matryoshka truncation (1 .. hidden size); normalize: L2 (default: the
        checkpoint's); prompt_name: one of the checkpoint's named prompts put before a text (default:
        its default prompt, if it names one); truncate: "right" or "left" cuts a prompt over the max
        input length from that side (default: refused). A cached prefix pools from the cache's hidden
        states. options: cache_prefix_len, cache_namespace, user, tenant, priority, deadline_s."""
        return self.submit_task("embed", prompt, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name,
                                truncate=truncate, **options)

    def embed(self, inputs, **kwargs):
        """An EmbeddingResult of one prompt (a text, bytes or token ids), or a list of them for a list of
        prompts (texts or id lists; all queued at once); keyword arguments as submit_embed."""
        if _many(inputs):
            return [f.result() for f in [self.submit_embed(p, **kwargs) for p in inputs]]
        return self.submit_embed(inputs, **kwargs).result()

    def submit_classify(self, prompt, responses=None, *, truncate: str | None = None, **options):
        """Queue a sequence classifier's (or reward model's) scores after `prompt` (kind "classify"): a
        ClassificationResult. With `responses` (texts, tokenized without special tokens, or id lists):
        one ClassificationResult per response, each of prompt + response, the prompt computed once
        (kind "classify_items": best-of-N). truncate: as submit_embed (a prompt alone only)."""
        if responses is not None:
            if truncate is not None:
                raise InvalidRequestError("truncate applies to a prompt alone, not to a prompt with responses")
            return self.submit_task("classify_items", prompt, items=responses, **options)
        return self.submit_task("classify", prompt, truncate=truncate, **options)

    def classify(self, prompt, responses=None, **kwargs):
        """submit_classify(...).result(); a list of prompts (without responses) gives a list of results."""
        if responses is None and _many(prompt):
            return [f.result() for f in [self.submit_classify(p, **kwargs) for p in prompt]]
        return self.submit_classify(prompt, responses, **kwargs).result()

    def decide(self, input, questions, **kwargs) -> "DecisionResult":
        """submit_decide(...).result()."""
        return self.submit_decide(input, questions, **kwargs).result()

    def loglikelihood(self, context, continuations, **kwargs) -> "list[ContinuationScore]":
        """submit_loglikelihood(...).result()."""
        return self.submit_loglikelihood(context, continuations, **kwargs).result()

    def prompt_logprobs(self, prompt, **kwargs) -> "PromptLogprobs":
        """submit_prompt_logprobs(...).result()."""
        return self.submit_prompt_logprobs(prompt, **kwargs).result()

    def score(self, prompt, allowed_tokens, **kwargs) -> ScoreResult:
        """submit(...).result(): the probabilities of the allowed tokens after `prompt`."""
        return self.submit(prompt, allowed_tokens, **kwargs).result()

    def score_items(self, prompt, items, allowed_tokens, **kwargs) -> list[ScoreResult]:
        """submit_items(...).result(): one ScoreResult per item, in item order."""
        return self.submit_items(prompt, items, allowed_tokens, **kwargs).result()

    def stats(self) -> EngineStats:
        """A snapshot for metrics: requests by outcome, waiting, JCT error, prefix cache, recent
        steps (with their idle gaps), memory budgets; and the compute dtype with why it was
        chosen (EngineConfig.dtype_reason)."""
        budget = {"weights": self.weight_bytes, "activation": self.activation_budget_bytes,
                  **{f"cache_tier{t}": b for t, b in (self.cache.capacity_bytes() if self.cache else {}).items()}}
        with self._cv:
            return EngineStats(
                waiting=len(self.scheduler), counters=self.scheduler.counters.copy(), jct_mean_abs_rel_error=self.jct.mean_abs_relative_error(),
                tokens_computed=self.executor.tokens_computed, steps=self._steps, recent_steps=list(self._recent_steps),
                dtype=self.config.dtype, dtype_reason=self.config.dtype_reason, budget_bytes=budget,
                attention_backend=self.executor.kernels.attention, linear_backend=self.executor.kernels.linear,
                kernel_check=self.executor.kernels.self_check.summary() if self.executor.kernels.self_check else "",
                score_head=self.executor.kernels.score_head,
                cache=copy.copy(self.cache.stats) if self.cache else None,
                cache_bytes_in_use=self.cache.bytes_in_use() if self.cache else {},
                queued_work_s=self.scheduler.queued_work_s() + max(0.0, self._step_ends_at - time.monotonic()),
                jct_coefficients=self.jct.coefficients)

    def progressing_step(self, window_s: float = PROGRESS_WINDOW_S) -> str | None:
        """While a step runs and one of its forwards finished (or it began) within `window_s`: how
        it progresses, e.g. "a step running for 130.2 s, its last forward finished 1.4 s ago" (the
        proof a liveness probe takes that the engine is alive); None when idle or stalled (the probe
        then queues a real inference: a wedged worker never answers it)."""
        began, now = self._step_began, time.monotonic()
        if not began:
            return None
        last = max(began, self.executor.last_forward_at)
        if now - last > window_s:
            return None
        return f"a step running for {now - began:.1f} s, its last forward finished {now - last:.1f} s ago"

    def predict_peak_bytes(self, new_tokens: int, prefix_tokens: int = 0, inplace_attention: bool = False) -> int:
        """Predicted peak extra memory of computing `new_tokens` after `prefix_tokens` cached ones."""
        return self.memory.peak_bytes([(new_tokens, prefix_tokens)], inplace=inplace_attention)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking work; fail every waiting request with EngineClosedError; let the running
        step finish; stop the worker. Idempotent."""
        with self._cv:
            already, self._closed = self._closed, True
            answers = self.scheduler.refuse_all(EngineClosedError("engine closed before the request ran"))
            self._cv.notify_all()
        for a in answers:  # resolved here: the worker (and its completion thread) may be gone already
            a.request.future.set_exception(a.error)
        if not already and threading.current_thread() is not self._worker:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._worker.join(timeout)
            # the worker stops the completion thread as it exits: wait until every answer is out
            self._completions.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- request loop -------------------------------------------------------------------
    def _enqueue(self, request: Request, priority, deadline_s) -> Future:
        request.priority = check_priority(priority)
        deadline = check_deadline(deadline_s)
        if self.cache is not None:
            # K/V rotated with LongRoPE's long factors never serves a prompt rotated with the short ones
            namespace = request.namespace
            if self.spec.rope_long(request.rope_length):
                namespace = f"{namespace or ''}\0longrope-long"
            request.block_hashes = self.cache.hashes(request.token_ids, namespace)
        with self._cv:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if deadline is not None:
                request.deadline = self.scheduler.clock() + deadline
            self.scheduler.add(request)  # raises (counted) when full, or when the prompt can never fit
            self._cv.notify()
        request.future.add_done_callback(lambda f: f.cancelled() and self._forget(request))
        return request.future

    def _forget(self, request: Request) -> None:
        """A waiting request's Future was cancelled: drop it from the waiting set."""
        with self._cv:
            self.scheduler.cancel(request)

    def _serve(self) -> None:
        try:
            with gpu_support.device_scope(self.device):  # this thread's launches on the engine's device
                self._serve_steps()
        finally:
            self._completions.stop()  # after the last answer this worker hands over

    def _serve_steps(self) -> None:
        """Plan and run steps until closed."""
        last_step_end = 0.0
        while True:
            with self._cv:
                while not self._closed and not len(self.scheduler):
                    self._cv.wait()
                if self._closed:
                    return
                plan = self._schedule()
                # the queued work published to the fleet includes what is left of this step:
                # a replica busy on a long forward with nothing waiting is not idle
                self._step_ends_at = time.monotonic() + self.jct.predict_step(plan.shape) if plan else 0.0
            self._deliver(plan.refused)
            if plan or plan.moves:
                self._step(plan, last_step_end)
                last_step_end = time.monotonic()

    def _schedule(self) -> StepPlan:
        """scheduler.schedule(), or, if the scheduler itself fails, an empty plan whose refusals
        fail everything that waited (the worker must survive)."""
        try:
            return self.scheduler.schedule()
        except BaseException as e:
            log.exception("prefillonly: the scheduler failed to plan a step; failing every waiting request")
            return StepPlan(refused=self.scheduler.fail_all(e))

    def _step(self, plan: StepPlan, last_step_end: float) -> None:
        """One forward step: execute the plan, finish it; each member gets exactly one answer."""
        now = time.monotonic()
        # the worker's idle gap: how long this step's work waited for it after its previous step
        ready_since = max(last_step_end, min((m.request.arrived for m in plan.members), default=now))
        self._step_began = time.monotonic()
        outcome = self.runner.execute(plan)
        self._step_began = 0.0
        with self._cv:  # counters and the step record move before any answer is delivered: an
            # answer's callback may read stats() (or the metrics endpoint) the moment it runs
            answers = self.scheduler.finish(plan, outcome)
            self._step_ends_at = 0.0
            if plan:
                self._steps += 1
                computed = plan.tokens if outcome.error is None else 0
                self._recent_steps.append(StepRecord(computed, len(plan), max(0.0, now - ready_since)))
        self._deliver(answers)

    def _deliver(self, answers: list[Answer]) -> None:
        for a in answers:
            self._completions.deliver(a.request.future, a.result, a.error)

    def _time_per_token(self, n: int = 256) -> float:
        """Seed of the JCT estimate: one cold forward's seconds per token (the fit takes over
        after a few real requests). On CUDA the first forward at this length compiles kernel
        variants and returns before the GPU is done: an untimed one first, synchronised clocks."""
        ids = torch.zeros(n, dtype=torch.long)
        if self.device.type == "cuda":
            self.executor.forward(ids, self.config.chunk_size)
        gpu_support.synchronize(self.device)
        t0 = time.perf_counter()
        self.executor.forward(ids, self.config.chunk_size)
        gpu_support.synchronize(self.device)
        return (time.perf_counter() - t0) / n

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


def _many(inputs) -> bool:
    """A list of prompts (texts, bytes or id lists), not one prompt of token ids."""
    return isinstance(inputs, (list, tuple)) and bool(inputs) and not isinstance(inputs[0], int)


_HEAD_NAMES = {LM_HEAD: "a causal LM", NO_HEAD: "an embedding model (no LM head)", CLASSIFIER_HEAD: "a sequence classifier"}
_HEAD_ASKS = {LM_HEAD: "the token-scoring tasks (score, loglikelihood, prompt_logprobs, decide) and embed",
              NO_HEAD: "embed", CLASSIFIER_HEAD: "classify"}


def check_head(kind, spec: ModelSpec) -> None:
    """InvalidRequestError where the served checkpoint cannot answer `kind` (an embedding asked of a
    classifier, token scores of an embedding model, ...), naming what it is and what it answers."""
    if spec.head not in kind.heads:
        raise InvalidRequestError(
            f"task {kind.wire_task!r} needs {' or '.join(_HEAD_NAMES[h] for h in kind.heads)}; the served checkpoint is "
            f"{_HEAD_NAMES[spec.head]} ({spec.architecture}): it answers {_HEAD_ASKS[spec.head]}")


def _request_limits(config: EngineConfig, max_input_len: int, tokenizer) -> RequestLimits:
    token_bytes = max_token_bytes(tokenizer)
    return RequestLimits(max_prompt_bytes=config.max_prompt_bytes or derived_max_prompt_bytes(max_input_len, token_bytes),
                         max_prompts_per_request=config.max_prompts_per_request, max_items=config.max_items,
                         max_allowed_tokens=config.max_allowed_tokens, max_token_bytes=token_bytes)


def _load_tokenizer(folder: str):
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        log.info("no tokenizer in %s: the engine takes token ids only", folder)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a broken tokenizer is a config problem, not a crash
        raise ConfigError(f"cannot load the tokenizer of {folder}: {e}") from e
