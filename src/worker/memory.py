"""Peak memory of one request: the engine's prediction and the measurement (docs/design.md §7).

Prediction mirrors the executor's allocations (see executor.py): full-length buffers of the
request plus the larger of attention's and one chunk's temporaries. Measurement is what every
compared system is measured by: process peak-RSS growth on CPU, allocator peak on CUDA.
"""

from __future__ import annotations

import torch

from ..kernels.attention import AttentionShape, inplace_attention_supported
from ..kernels import shared_prefix
from ..kernels.backend import KernelBackend
from ..model.spec import ModelSpec
from .workspace import LOGPROB_ROWS, plan_workspace

_PAGE = 4096  # an allocation may touch one page more than its size (its header, the rounding)
# A forward's allocations that are not tensors (Python objects, per-call library buffers, thread
# arenas, heap fragmentation of the small ones): a 16-token forward grows the RSS by 0.4-0.7 MiB
# (memory_probe's small_forward_bytes, which tests/engine/test_memory.py checks against this), a
# 16K-token fp32 forward by up to 1.5 MiB more than its tensors (RSS peak minus the plan, which
# matches torch's own allocation trace within 0.3 MiB; seen on an AVX2 host, 2026-12), and a
# 16K-token bf16 forward on a CPU without native bf16 (AVX2; its matmuls convert through library
# buffers) by up to 2.4 MiB: fresh processes of fresh clones measured that peak anywhere in
# 35.6-38.4 MiB for 36.0 MiB of tensors (2026-12-01). 3 MiB covers the worst seen.
UNSEEN_BYTES = 3 << 20


def predict_peak_bytes(spec: ModelSpec, new_tokens: int, chunk_size: int | None, dtype: torch.dtype, prefix_tokens: int = 0,
                       captured_tokens: int = 0, inplace_attention: bool = False, attention_backend: str = "sdpa",
                       device: torch.device | str = "cpu", linear_backend: str = "aten") -> int:
    """Peak extra bytes of a forward over `new_tokens` after `prefix_tokens` of given K/V on these
    (concrete) backends, for tools and benchmarks that have no engine: the sum of
    batch_peak_components for a batch of one."""
    kernels = KernelBackend(torch.device(device), dtype, spec.head_dim, attention_backend, linear_backend)
    return sum(batch_peak_components(spec, [(new_tokens, prefix_tokens)], chunk_size, kernels, captured_tokens,
                                     inplace_attention).values())


def batch_peak_components(spec: ModelSpec, members: list[tuple[int, int]], chunk_size: int | None, kernels: KernelBackend,
                          captured_tokens: int = 0, inplace_attention: bool = False,
                          logprob_spans: list[tuple[int, int]] | None = None) -> dict[str, int]:
    """The prediction by part, in bytes, for a forward over B = len(members) sequences packed
    row after row (executor.ForwardBatch; a single request is a batch of one):

    workspace  the batch's buffers (exact: the executor allocates this plan);
    linear     the projections' per-call allocations, the largest alive at a time, as the kernels
               count one call (KernelBackend.linear_call_bytes: their outputs where the linear
               backend allocates them, the workspace then plans none, and the library's own
               buffers: float32 copies of the output where oneDNN emulates bf16), and the LM
               head's library buffers (KernelBackend.score_head_library_bytes); where attention
               writes over Q (the compiled and Triton kernels) its scratch is freed before any
               projection runs, so only what exceeds `attention` is added;
    attention  attention's output and temporaries, as the attention path counts them
               (kernels.attention_paths, `scratch_bytes`: the compiled CPU kernel's scratch and
               packed V as it reports them, one call at a time; none on the Triton kernel; SDPA's
               measured estimate, every sequence's output alive until the MLP half of the layer;
               the banded path's for windowed or soft-capped layers on torch; the largest over
               the model's layer kinds);
    captured   K/V of a captured prefix (multi-item), all layers;  prefix_gather: one layer's
               cached blocks of one sequence gathered from the pool (sequences load in turn;
               none on a path that reads the pool's blocks in place: the Triton kernel's);
    ids        the token ids (int64): built by the caller before the forward starts, but held for it;
    small      RoPE cos/sin tables (float32 on CPU) and one chunk's angle table, the B last rows and
               their logits;
    logprob_span  members' logprob spans (`logprob_spans`: (rows, top k) per member, Sequence.
               logprob_rows): one block of LOGPROB_ROWS rows' normed states, logits and log-softmax
               temporaries (spans run one after another, after the layers), and every span's outputs,
               less `linear` and `attention`, whose transients are freed before the spans run;
    pages      one page per allocation (header and rounding): an allowance, not a buffer;
    unseen     what a forward allocates outside tensors: an allowance (UNSEEN_BYTES).
    """
    dtype = kernels.dtype
    e = torch.tensor([], dtype=dtype).element_size()
    s = sum(n for n, _ in members)
    b = len(members)
    plan = plan_workspace(spec, s, chunk_size, dtype, _held_prefix_rows(members, kernels, captured_tokens),
                          fp32_scratch=kernels.norm_scratch(spec.qk_norm), linear_outputs=kernels.linear_outputs)
    attention = _attention_bytes(spec, members, kernels, inplace_attention)
    linear = _linear_call_bytes(spec, plan.chunk, b, kernels)
    if kernels.writes_over_q:  # attention writes over Q: its scratch is freed before any projection runs
        linear = max(0, linear - attention)
    chunks = -(-s // plan.chunk)
    pieces = (chunks + b - 1) * spec.rope_tables  # chunk x sequence intersections, each with its own RoPE tables
    return dict(
        workspace=plan.nbytes(),
        linear=linear,
        attention=attention,
        captured=e * 2 * captured_tokens * spec.kv_width * spec.num_layers,
        prefix_gather=0 if kernels.attention_path.reads_prefix_in_place else e * 2 * max(p for _, p in members) * spec.kv_width,
        ids=s * 8,
        small=spec.rope_tables * s * spec.head_dim * 4 + plan.chunk * spec.head_dim * 2 + _last_rows_bytes(spec, b, kernels),
        # after the layers: the projections' and attention's transients are gone by then
        logprob_span=max(0, _span_bytes(spec, members, logprob_spans or [], plan.chunk, kernels) - linear - attention),
        pages=_PAGE * (len(plan.shapes) + 2 * pieces + 8 + (2 * b if b > 1 else 0)),  # workspace, RoPE tables, the few others
        unseen=UNSEEN_BYTES,
    )


def _held_prefix_rows(members: list[tuple[int, int]], kernels: KernelBackend, captured_tokens: int) -> int:
    """The members' prefix positions the workspace holds: a step's cached prefixes come from the
    prefix pool, which the Triton kernel reads in place (no rows: executor.ForwardBatch.in_place);
    a captured one (multi-item, `captured_tokens` > 0) is loaded into the segment."""
    if kernels.attention_path.reads_prefix_in_place and not captured_tokens:
        return 0
    return sum(p for _, p in members)


def _attention_bytes(spec: ModelSpec, members: list[tuple[int, int]], kernels: KernelBackend, inplace: bool) -> int:
    """The attention path's own count and, where the members may be items over one captured prompt
    (shared_prefix.py's pass, which the executor picks on the prefixes themselves), the larger of
    that and the shared pass's."""
    shape = AttentionShape(kernels.dtype, spec.head_dim, spec.num_heads, spec.num_kv_heads)
    windows = {spec.layer_window(i) for i in range(spec.num_layers)}
    attention = kernels.attention_path.scratch_bytes(shape, members, windows, spec.attention_softcap or 0.0, inplace)
    if may_share_a_prefix(members, kernels):
        attention = max(attention, shared_prefix.scratch_bytes(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                                               kernels.dtype, members))
    return attention


def may_share_a_prefix(members: list[tuple[int, int]], kernels: KernelBackend) -> bool:
    """Whether a forward over `members` may run attention as shared_prefix.py's pass (which the
    executor decides on the prefixes themselves): two or more members, each after a prefix, on CPU."""
    return len(members) > 1 and all(p for _, p in members) and kernels.device.type == "cpu"


def _last_rows_bytes(spec: ModelSpec, b: int, kernels: KernelBackend) -> int:
    """The B last rows (gathered and normed where B > 1) and their float32 logits, with what the score
    head adds on the way (kernels.score_head: nothing on the float32 heads; the model-dtype output
    before its cast on the "linear" head)."""
    e = torch.tensor([], dtype=kernels.dtype).element_size()
    rows = b * spec.hidden_size * 2 * e if b > 1 else 0
    return rows + kernels.score_head_bytes(b, spec.hidden_size, spec.vocab_size)


def _span_bytes(spec: ModelSpec, members: list[tuple[int, int]], spans: list[tuple[int, int]], chunk: int,
                kernels: KernelBackend) -> int:
    """The logprob spans' part: one block (its rows' normed states in the model dtype, the rows
    gathered from the prefix cache where the span starts inside it, their float32 logits and what
    the score head adds on the way, and the log-softmax's float32 output) and every row's
    outputs (its logprob, greedy flag, best token's logprob and id, top-k values and ids, and the
    3 float32 values a prefix cache keeps, built twice on their way into its blocks)."""
    if not any(n for n, _ in spans):
        return 0
    e = torch.tensor([], dtype=kernels.dtype).element_size()
    block = min(LOGPROB_ROWS, chunk, max(n for n, _ in spans))
    head = kernels.score_head_bytes(block, spec.hidden_size, spec.vocab_size)
    outputs = sum(n * (4 + 1 + (4 + 8) + k * (4 + 8) + 2 * 12) for n, k in spans)
    into_prefix = any(n >= new for (n, _), (new, _) in zip(spans, members))  # rows gathered from the cache
    # per row: its normed state and (a span over cached positions) the gathered one, and its log-softmax (`head` has its logits)
    return (head + block * (4 * spec.vocab_size + (2 if into_prefix else 1) * e * spec.hidden_size) + outputs
            + 6 * _PAGE * sum(1 for n, _ in spans if n))


def _linear_call_bytes(spec: ModelSpec, chunk: int, last_rows: int, kernels: KernelBackend) -> int:
    """The largest of the projections' calls over one chunk (and the LM head's library buffers over
    the last rows, after the layers), as the kernels count one call."""
    calls = [kernels.linear_call_bytes(chunk, n) for n in (spec.qkv_width, spec.hidden_size, 2 * spec.intermediate_size)]
    return max(calls + [kernels.score_head_library_bytes(last_rows, spec.vocab_size)])


class ActivationBudget:
    """The engine's activation budget as the scheduler checks steps against it (its StepMemory,
    scheduler/plan.py): the prediction above for the engine's model, kernels (the executor's own)
    and chunk, and the budget in bytes."""

    def __init__(self, spec: ModelSpec, kernels: KernelBackend, chunk_size: int | None, budget_bytes: int):
        self.spec, self.kernels = spec, kernels
        self.chunk_size = chunk_size
        self.budget_bytes = budget_bytes
        self.inplace_supported = inplace_attention_supported(kernels.device)

    def peak_bytes(self, shape: list[tuple[int, int]], captured: int = 0, inplace: bool = False,
                   logprob_spans: list[tuple[int, int]] | None = None) -> int:
        """Predicted peak of one forward over `shape` = [(new tokens, prefix tokens)]."""
        return sum(batch_peak_components(self.spec, list(shape), self.chunk_size, self.kernels, captured, inplace,
                                         logprob_spans).values())


class PeakMemoryMeter:
    """Measures one request's peak memory growth on its device.

    CPU: reset the kernel's RSS high-water mark (/proc/self/clear_refs) before, read VmHWM
    after; growth over the RSS at the start. CUDA: torch's allocator peak over the allocation
    at the start. `available` is False where the high-water mark cannot be reset.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.available = device.type == "cuda" or _can_reset_hwm()
        self._base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.available:
            _reset_hwm()
            self._base = status_bytes("VmRSS")

    def peak_growth(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        if not self.available:
            return None
        return max(0, status_bytes("VmHWM") - self._base)


def status_bytes(key: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes: the one reader of it (perf/ uses it too)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _can_reset_hwm() -> bool:
    try:
        _reset_hwm()
        status_bytes("VmHWM")
        return True
    except OSError:
        return False


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: MemAvailable on CPU, the CUDA driver's free bytes on a GPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 34
