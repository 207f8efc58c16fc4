"""EngineConfig: every engine setting in one dataclass, validated once with clear messages.

The Triton model and the CLI build it from their own inputs (strings allowed: "bfloat16",
"2048", "none"). Settings come from here, not from the environment; the few environment
variables the code reads are switches for a host (docs/design.md §5, the environment table): where files are kept
(paths.py), turning the compiled CPU kernels or the GPU kernels off, forcing a CPU ISA path.

Defaults owned by a layer are written in that layer and read here (the scheduler's policies,
lambda and queue bound; the attention backends), so that those layers need not import this module.

dtype "auto" (the default) is resolved here, once, by hardware.resolve_dtype: after construction
`dtype` is always a concrete dtype, `requested_dtype` what was asked for and `dtype_reason` why.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields

import torch

from .contract.errors import ConfigError
from .hardware import resolve_dtype
from .kernels import gpu_support
from .kernels.attention import BACKENDS
from .kernels.linear import LINEAR_BACKENDS
from .kernels.score_head import HEAD_DTYPES
from .contract.limits import DEFAULT_MAX_ALLOWED_TOKENS, DEFAULT_MAX_DECISION_TOKENS, DEFAULT_MAX_ITEMS, DEFAULT_MAX_WAITING, default_max_prompts
from .contract.paths import default_cache_dir
from .scheduler.policy import DEFAULT_LAMBDA_TOKENS_PER_S, POLICIES
from .contract.setting_strings import is_unset, optional_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Uncached tokens per forward step by device type. CPU: from perf/bench_batching.py's sweep
# (docs/design.md §15); CUDA: not measured yet (no GPU lent), the batch size at which an
# H100-class GPU's matmuls are compute-bound for an 8B model, as vLLM's default.
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}
# Shares of the memory free at start-up that the unset budgets take: the prefix-KV pool first,
# then the activation budget out of what is left.
DEFAULT_CACHE_FRACTION = 0.2
DEFAULT_ACTIVATION_FRACTION = 0.9
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def _dtype_name(value) -> str:
    """A dtype setting in lower case, its alias resolved ("BF16" -> "bfloat16"); unknown names as they are."""
    name = str(value).lower()
    return _DTYPE_ALIASES.get(name, name)



@dataclass
class EngineConfig:
    # Every engine setting and its default (those owned by a lower layer are imported from it);
    # the CLI and the simulator read them with EngineConfig.default_of(name); a field's "help"
    # metadata is its CLI help.
    model: str | None = field(default=None, metadata={"help": "HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16 (CUDA); auto = bfloat16 on CUDA "
                                                          "and on CPUs with a native bf16 dot product, else float32"})
    device: str = "cpu"  # cpu | cuda | cuda:N
    chunk_size: int | None = field(default=2048, metadata={"help": "tokens per chunk; 0 = no chunking"})  # per-token ops; None = no chunking too
    max_input_len: int | None = None  # None = the model's context length; larger is an explicit override
    activation_budget_bytes: int | None = None  # one request's transient peak; None = 90% of the memory free at start less the cache's
    threads: int | None = None  # torch intra-op threads (CPU); None = torch's default
    attention_backend: str = "auto"  # one of kernels.attention.BACKENDS: auto | cpu_flash | triton | sdpa | flash_attn
    linear_backend: str = field(default="auto", metadata={"help": "auto | aten | onednn: the layers' GEMMs (auto: onednn "
                                                                   "unless aten times >= 10% faster at start; aten off CPU)"})
    head_dtype: str = field(default="float32", metadata={"help": "float32 | model: the dtype of the logits that become scores "
                                                                 "(float32: from the model dtype's operands with float32 sums, "
                                                                 "never rounded to bf16; model: the model dtype's GEMM, then a cast)"})
    cache_budget_bytes: int | None = None  # prefix-KV pool; None = 20% of free memory at start; 0 = no cache
    # tokens per cached block (the unit of prefix reuse): a prompt's tail past its last whole cached block is
    # recomputed, so small blocks reuse more (perf/RESULTS.md "Evaluation harness: 16-token blocks, ..."); 16 as vLLM's GPU default
    cache_block_size: int = 16
    cache_second_tier_bytes: int = 0  # blocks evicted from the pool go here (host memory); 0 = off
    max_items: int = DEFAULT_MAX_ITEMS  # most items one multi-item request may carry
    max_prompts_per_request: int | None = None  # most prompts (text_input values) in one server request; None = 64 or max_waiting if smaller
    max_allowed_tokens: int = DEFAULT_MAX_ALLOWED_TOKENS  # most allowed output tokens in one request
    max_decision_tokens: int = DEFAULT_MAX_DECISION_TOKENS  # most question + option tokens in one decision call
    max_prompt_bytes: int | None = None  # bytes of one prompt/item text; None = max_input_len x the longest token's bytes
    scheduling_policy: str = "csjf"  # fcfs | sjf | csjf (continuous JCT-calibrated SJF, dependency groups) | csjf-independent
    lambda_tokens_per_s: float = DEFAULT_LAMBDA_TOKENS_PER_S  # csjf starvation guard (the paper's): tokens of credit per second waited
    max_waiting: int = DEFAULT_MAX_WAITING  # waiting requests beyond this are refused at once ("overloaded")
    max_batch_tokens: int | None = None  # uncached tokens one forward step may pack; None = the device's default; 1 = no batching
    cache_dir: str = field(default_factory=default_cache_dir)  # converted default model
    # Set by __post_init__, not arguments: the dtype as asked ("auto" or a dtype) and why `dtype`
    # is what it is ("explicit", or the auto rule that chose it). Not compared: an "auto" config
    # equals the explicit one it resolved to (they build the same engine).
    requested_dtype: str = field(default="", init=False, compare=False)
    dtype_reason: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        requested = "auto" if self.dtype is None else _dtype_name(self.dtype)
        if requested != "auto" and requested not in DTYPES:
            raise ConfigError(f"dtype {requested!r} is not supported; choose one of auto, {', '.join(DTYPES)}")
        self.device = str(self.device).lower()
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device {self.device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available in this process")
        self.requested_dtype = requested
        self.dtype, self.dtype_reason = resolve_dtype(requested, self.device)
        # no CPU kernel takes float16; the Triton kernels under their interpreter do (the CPU tests
        # of the GPU path run an engine so, the interpreter having no bfloat16)
        if self.dtype == "float16" and self.device == "cpu" and not gpu_support.interpreting():
            raise ConfigError("dtype float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
        self.chunk_size = optional_int("chunk_size", self.chunk_size, minimum=0) or None
        self.max_input_len = optional_int("max_input_len", self.max_input_len, minimum=1)
        self.activation_budget_bytes = optional_int("activation_budget_bytes", self.activation_budget_bytes, minimum=1)
        self.threads = optional_int("threads", self.threads, minimum=1)
        self.cache_budget_bytes = optional_int("cache_budget_bytes", self.cache_budget_bytes, minimum=0)
        self.cache_block_size = optional_int("cache_block_size", self.cache_block_size, minimum=1)
        self.cache_second_tier_bytes = optional_int("cache_second_tier_bytes", self.cache_second_tier_bytes, minimum=0) or 0
        # limits: None ("" or "none" in the model config) is the default, never "no limit"
        self.max_items = optional_int("max_items", self.max_items, minimum=1) or DEFAULT_MAX_ITEMS
        self.max_waiting = optional_int("max_waiting", self.max_waiting, minimum=1) or DEFAULT_MAX_WAITING
        self.max_prompts_per_request = optional_int("max_prompts_per_request", self.max_prompts_per_request, minimum=1)
        if self.max_prompts_per_request is None:
            self.max_prompts_per_request = default_max_prompts(self.max_waiting)
        self.max_allowed_tokens = optional_int("max_allowed_tokens", self.max_allowed_tokens, minimum=1) or DEFAULT_MAX_ALLOWED_TOKENS
        self.max_decision_tokens = (optional_int("max_decision_tokens", self.max_decision_tokens, minimum=1)
                                    or DEFAULT_MAX_DECISION_TOKENS)
        self.max_prompt_bytes = optional_int("max_prompt_bytes", self.max_prompt_bytes, minimum=1)
        self.max_batch_tokens = optional_int("max_batch_tokens", self.max_batch_tokens, minimum=1)
        if self.max_prompts_per_request > self.max_waiting:
            # such a request could never be queued whole: it would be answered "overloaded" forever
            raise ConfigError(f"max_prompts_per_request {self.max_prompts_per_request} is over max_waiting "
                              f"{self.max_waiting}; lower it or raise max_waiting")
        self.scheduling_policy = str(self.scheduling_policy).lower()
        if self.scheduling_policy not in POLICIES:
            raise ConfigError(f"scheduling_policy {self.scheduling_policy!r} unknown; choose one of {', '.join(POLICIES)}")
        try:
            self.lambda_tokens_per_s = float(self.lambda_tokens_per_s)
        except (TypeError, ValueError):
            raise ConfigError(f"lambda_tokens_per_s must be a number, got {self.lambda_tokens_per_s!r}") from None
        if not self.lambda_tokens_per_s >= 0:
            raise ConfigError(f"lambda_tokens_per_s must be >= 0, got {self.lambda_tokens_per_s}")
        if self.attention_backend not in BACKENDS:
            raise ConfigError(f"attention_backend {self.attention_backend!r} unknown; choose one of {', '.join(BACKENDS)}")
        self.linear_backend = str(self.linear_backend or "auto").lower()
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ConfigError(f"linear_backend {self.linear_backend!r} unknown; choose one of {', '.join(LINEAR_BACKENDS)}")
        self.head_dtype = _dtype_name(self.head_dtype or "float32")
        if self.head_dtype not in HEAD_DTYPES:
            raise ConfigError(f"head_dtype {self.head_dtype!r} unknown; choose one of {', '.join(HEAD_DTYPES)}")
        if self.model is not None and not os.path.isdir(str(self.model)):
            raise ConfigError(f"model folder {self.model!r} does not exist (leave model unset for the default SmolLM2)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]  # dtype is concrete once constructed ("auto" resolved)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def batch_token_budget(self) -> int:
        """max_batch_tokens, or the default of the device type (docs/design.md §15)."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return DEFAULT_MAX_BATCH_TOKENS["cuda" if self.device.startswith("cuda") else "cpu"]

    def cache_budget_for(self, free_bytes: int) -> int:
        """cache_budget_bytes, or DEFAULT_CACHE_FRACTION of the memory free at start."""
        if self.cache_budget_bytes is not None:
            return self.cache_budget_bytes
        return int(DEFAULT_CACHE_FRACTION * free_bytes)

    def activation_budget_for(self, free_bytes: int, cache_bytes: int) -> int:
        """activation_budget_bytes, or DEFAULT_ACTIVATION_FRACTION of what the cache leaves free."""
        return self.activation_budget_bytes or int(DEFAULT_ACTIVATION_FRACTION * max(0, free_bytes - cache_bytes))

    @classmethod
    def default_of(cls, name: str):
        """The default of setting `name` (a default_factory's value as of now)."""
        f = next((f for f in fields(cls) if f.name == name), None)
        if f is None:
            raise KeyError(f"EngineConfig has no setting {name!r}")
        return f.default_factory() if f.default_factory is not MISSING else f.default

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineConfig":
        """Build from string settings (Triton parameters, CLI); unknown keys are an error."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{k: (None if is_unset(v) else v) for k, v in values.items()})


