"""The attention paths: what actually runs a model's attention, one object each, picked once per
engine by its KernelBackend (backend.ATTENTION_PATHS, in order: the first that takes the model).

A configured backend (attention.BACKENDS) names a wish; the path is what runs for the model's dtype
and head size under it ("cpu_flash" with head_dim 24 runs on torch). Each path answers the executor
and the memory prediction (worker/memory.py) alike, so the two cannot disagree:
  attend(q, k, v, scale, inplace, window, softcap)   one sequence's causal attention
  begin(batch, buffers, scale, inplace)              one forward's attention (a pass): `loads`, which
                                                     sequences' cached prefixes the executor gathers
                                                     into the workspace, then run(layer, ...) per layer
  writes_over_q, reads_prefix_in_place, scratch_bytes(...)   what memory.py counts
A new attention backend is one such class (`build`: an instance where it takes the model, else
None) and its entry in backend.ATTENTION_PATHS; a configurable name also goes into
attention.BACKENDS and resolve_backend (whether it can run here at all).
"""

from __future__ import annotations

import torch

from . import gpu_support
from .shared_prefix import SharedPrefixPass, shared_prefix_of
from .attention import (INPLACE_QUERY_BLOCK, AttentionShape, banded_scratch_bytes, causal_attention, causal_attention_inplace,
                        cpu_flash_attention, cpu_flash_covers, cpu_flash_scratch_bytes)

# torch SDPA's output and internal buffers, per query element ([S, q_width]), and its
# per-thread fixed blocks. Measured on CPU (memory_probe: growth minus the workspace) at
# 8K-16K tokens: ~6 B per query element in both bf16 and fp32 for small GQA configs, ~9 on
# SmolLM2 (9 heads / 3 KV heads). tests/engine/test_memory.py keeps the whole prediction within 15%.
_ATTENTION_BYTES_PER_QUERY_ELEMENT = 6
_ATTENTION_FIXED_BYTES = 2 << 20
# causal_attention_inplace: per element of one query block: two flash outputs and their
# float32 accumulators, the float32 merge, the cast back. Measured (memory_probe growth minus
# the workspace) ~45 B at 2048-query blocks on a small GQA config, plus ~8 MiB that does not
# shrink with the block (per-thread flash buffers of two calls, allocator slack).
_INPLACE_BYTES_PER_QUERY_ELEMENT = 48
_INPLACE_FIXED_BYTES = 8 << 20


class AttentionPath:
    """The interface; its `begin` is the per-sequence pass every path but the Triton one uses."""

    name = ""
    writes_over_q = False  # the output always replaces Q: no output tensor outlives a call
    reads_prefix_in_place = False  # cached prefixes are read from the pool's blocks, never gathered

    @classmethod
    def build(cls, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionPath | None:
        """This path for a model under configured `backend`, or None where it does not take it."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, inplace: bool = False,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """One sequence (q [Hq, Lq, D], k/v [Hkv, Lk, D], the last Lq keys the queries' own): its
        output, over q where the path writes there or `inplace` asks, else a new tensor."""
        raise NotImplementedError

    def in_place(self, batch) -> list[bool]:
        """Per sequence of `batch`, whether its prefix is read where it lies (the workspace then
        holds no rows for it): never, but on the Triton path."""
        return [False] * len(batch.sequences)

    def begin(self, batch, buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float, inplace: bool):
        """One forward's attention over `batch` (an executor.ForwardBatch) whose Q/K/V live in
        `buffers` (the workspace's whole q, k, v): sequences after one captured prefix read it
        once (shared_prefix.py), any others one at a time."""
        shared = shared_prefix_of(batch, buffers[0].device)
        if shared is not None:
            return SharedPrefixPass(self, batch, buffers, *shared, scale, inplace)
        return SequenceBySequence(self, batch, scale, inplace)

    def scratch_bytes(self, shape: AttentionShape, members: list[tuple[int, int]], windows: set[int], softcap: float,
                      inplace: bool) -> int:
        """Attention's output and temporaries at their largest in a forward over `members`
        [(new tokens, prefix tokens)] of a model with `shape`, layers of `windows` (0: full) and
        `softcap` (memory.py's `attention` part)."""
        raise NotImplementedError


class SequenceBySequence:
    """A forward's attention one sequence at a time, each cached prefix gathered into its sequence's
    workspace segment (by the executor, every layer)."""

    def __init__(self, path: AttentionPath, batch, scale: float, inplace: bool):
        self.path, self.scale, self.inplace = path, scale, inplace
        self.loads = [s.prefix_tokens > 0 for s in batch.sequences]

    def run(self, layer: int, qs: list, ks: list, vs: list, window: int, softcap: float) -> list[torch.Tensor]:
        """Each sequence's attention output at `layer` (over its q, or new tensors)."""
        return [self.path.attend(q, k, v, self.scale, self.inplace, window, softcap) for q, k, v in zip(qs, ks, vs)]


class TorchAttention(AttentionPath):
    """torch's kernels: SDPA (flash-attn's where configured), the banded path for windowed or
    soft-capped layers; the output a new tensor, or over Q block by block where a step asks
    (`inplace`, CPU: the memory-saving path). It takes every model: the fallback."""

    name = "torch"

    def __init__(self, backend: str):
        self.backend = "flash_attn" if backend == "flash_attn" else "sdpa"  # a kernel's name here: it did not take the model

    @classmethod
    def build(cls, backend, device, dtype, head_dim):
        return cls(backend)

    def attend(self, q, k, v, scale, inplace=False, window=0, softcap=0.0):
        if inplace:  # chosen per step by the forward plan: an input, not a dispatch
            return causal_attention_inplace(q, k, v, scale, window=window, softcap=softcap)
        return causal_attention(q, k, v, scale, self.backend, window=window, softcap=softcap)

    def scratch_bytes(self, shape, members, windows, softcap, inplace):
        return max(_torch_attention_bytes(shape, members, window, softcap, inplace) for window in windows)


def _torch_attention_bytes(shape: AttentionShape, members: list[tuple[int, int]], window: int, softcap: float,
                           inplace: bool) -> int:
    """Attention's output and temporaries for layers of one `window` on the torch paths (SDPA's
    measured estimate above, every sequence's output alive until the MLP half of the layer; the
    banded path's outputs and its largest block's temporaries for windowed or capped layers)."""
    q_width = shape.q_heads * shape.head_dim
    e = torch.tensor([], dtype=shape.dtype).element_size()
    if window or softcap:  # banded_attention: sequences in turn, every output alive unless over Q
        longest = max(members, key=lambda m: m[0] + m[1])
        scratch = banded_scratch_bytes(shape.q_heads, shape.kv_heads, shape.head_dim, longest[0], sum(longest), window)
        return scratch + (0 if inplace else e * sum(n for n, _ in members) * q_width)
    if inplace:  # one query block's flash outputs and float32 merge at a time
        longest = max(n for n, _ in members)
        return _INPLACE_BYTES_PER_QUERY_ELEMENT * min(longest, INPLACE_QUERY_BLOCK) * q_width + _INPLACE_FIXED_BYTES
    return _ATTENTION_BYTES_PER_QUERY_ELEMENT * sum(n for n, _ in members) * q_width + _ATTENTION_FIXED_BYTES


class CpuFlashAttention(AttentionPath):
    """The compiled CPU kernel (attention.cpu_flash_attention): output over Q, whole prompts and
    cached-prefix suffixes in one pass, windows and soft caps in the kernel."""

    name = "cpu_flash"
    writes_over_q = True

    @classmethod
    def build(cls, backend, device, dtype, head_dim):
        return cls() if backend == "cpu_flash" and cpu_flash_covers(device, dtype, head_dim) else None

    def attend(self, q, k, v, scale, inplace=False, window=0, softcap=0.0):
        return cpu_flash_attention(q, k, v, scale, out=q, window=window, softcap=softcap)

    def scratch_bytes(self, shape, members, windows, softcap, inplace):
        """Its scratch and (on the bf16 pair path) packed V, as the kernel reports them: one call at a
        time, so the longest sequence's; nothing to estimate."""
        longest_keys = max(n + p for n, p in members)
        return cpu_flash_scratch_bytes(shape.head_dim, shape.q_heads // shape.kv_heads, shape.kv_heads, longest_keys,
                                       shape.dtype)


class TritonAttention(AttentionPath):
    """The Triton kernel (gpu_attention.py): the whole batch in one launch per layer, output over Q,
    no scratch, cached prefixes read from the prefix pool's blocks in place."""

    name = "triton"
    writes_over_q = True
    reads_prefix_in_place = True

    def __init__(self, device: torch.device):
        self.device = device

    @classmethod
    def build(cls, backend, device, dtype, head_dim):
        return cls(device) if backend == "triton" and gpu_support.attention_applies(device, dtype, head_dim) else None

    def attend(self, q, k, v, scale, inplace=False, window=0, softcap=0.0):
        """One sequence as a batch of one, its prefix in k/v (over q, as every launch)."""
        from . import gpu_attention  # imported where chosen: it imports triton

        lq, lk = q.shape[1], k.shape[1]
        launch = gpu_attention.BatchAttention([0], [lq], [0], [lk - lq], [None], scale, q.device)
        return launch.run(0, q, k, v, window, softcap)

    def in_place(self, batch):
        return [pg is not None for pg in _paged_prefixes(batch)]

    def begin(self, batch, buffers, scale, inplace):
        return TritonPass(batch, buffers, scale, self.device)

    def scratch_bytes(self, shape, members, windows, softcap, inplace):
        return 0


class TritonPass:
    """A forward's attention on the Triton kernel: its layout and block table built once, then one
    launch per layer over the workspace's whole Q/K/V, each output over its own query segment."""

    def __init__(self, batch, buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
                 device: torch.device):
        from . import gpu_attention  # imported where chosen: it imports triton

        paged = _paged_prefixes(batch)
        self.buffers = buffers
        self.loads = [s.prefix_tokens > 0 and pg is None for s, pg in zip(batch.sequences, paged)]  # the rest read in place
        # the kernel finds position t of a sequence at workspace row kv_start + t: a segment without
        # its paged prefix's rows starts that many rows "before" its first row (reads begin at t = P)
        kv_starts = [a - off for a, off in zip(batch.kv_starts, batch.first_positions)]
        self.launch = gpu_attention.BatchAttention(
            batch.row_starts, [s.new_tokens for s in batch.sequences], kv_starts,
            [s.prefix_tokens for s in batch.sequences], paged, scale, device)

    def run(self, layer: int, qs: list, ks: list, vs: list, window: int, softcap: float) -> list[torch.Tensor]:
        self.launch.run(layer, *self.buffers, window, softcap)
        return qs


def _paged_prefixes(batch) -> list:
    """Per sequence, the (pool, slots) its prefix is read from in place, or None: loaded into its
    workspace segment (no prefix, a source with no pool blocks, a capture that copies prefix
    positions out of the workspace, or a pool other than the batch's first)."""
    paged, pool = [], None
    for s in batch.sequences:
        pg = s.prefix.paged() if s.prefix_tokens else None
        if pg is not None and s.capture is not None and s.capture[0] < s.prefix_tokens:
            pg = None  # the capture copies prefix positions out of the workspace: they must be there
        if pg is not None:
            pool = pool or pg[0]
            pg = pg if pg[0] is pool else None
        paged.append(pg)
    return paged
