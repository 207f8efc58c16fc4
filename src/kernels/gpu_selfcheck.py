"""The Triton-language kernels checked against torch at start, each falling back to torch on its own.

The Triton kernels (gpu_attention.py, gpu_ops.py) are what a bf16/fp16 CUDA engine runs by
default, and a kernel that compiles but computes wrong gives silently wrong probabilities. So
before an engine serves, `run_self_check` runs every Triton kernel it would use at the model's
shapes on a few random rows: attention whole, over a cached prefix, as one row and over a prefix
read in place from a prefix pool's blocks (each with the model's soft cap), and with its sliding
window where it has one; and the per-token ops (RMSNorm, the residual add with RMSNorm, RoPE with
the q/k norms, SwiGLU). Each is compared with the torch path
that replaces it (attention with the torch paths in float32 from the same inputs, the ops with
TorchOps in the served dtype) under one stated bound:

    max |kernel - torch| <= TOLERANCE_EPS x eps(dtype) x max(1, max |torch|)

(eps: the dtype's machine epsilon; 8 of them is a few output roundings plus the float32
accumulation over these short rows; an indexing or masking mistake is off by O(1)). A kernel
that raises or misses the bound is logged with why and replaced by torch for the engine's life
(KernelBackend.choose): attention by SDPA (or flash-attn), an op by TorchOps' version of it. Running
them here also compiles every variant the engine launches (the ops at 1, 37 and 48 rows: Triton
specialises an integer argument equal to 1 or divisible by 16), so none compiles during a request.
Under TRITON_INTERPRET=1 on CPU (float16) the same checks run; that is how the CPU suite tests the
fallback with a deliberately wrong and a raising kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import gpu_support

log = logging.getLogger("prefillonly")

TOLERANCE_EPS = 8
ATTENTION_KERNELS = ("attention_whole", "attention_cached_prefix", "attention_one_row", "attention_paged_prefix",
                     "attention_sliding")
OP_KERNELS = ("rms_norm", "add_rms_norm", "rope_qkv", "swiglu")
_ROWS, _PREFIX = 37, 45  # odd, not a multiple of any tile or page
# the per-token kernels take their row count as an argument, which Triton compiles apart when it is
# 1 or a multiple of 16: a run at each compiles every variant a request can meet before it does
_OP_ROWS = (1, _ROWS, 48)


@dataclass(frozen=True)
class ModelShapes:
    """What the checks need of the model beyond its heads: the widths the per-token kernels tile
    by, and the attention variants it uses."""

    hidden: int
    intermediate: int
    window: int = 0  # sliding window (0: none)
    softcap: float = 0.0  # attention soft cap (0: none)
    qk_norm: bool = False
    page: int = 16  # the prefix cache's block size: the paged read compiles per page size

    @classmethod
    def of(cls, spec, page: int = 16) -> "ModelShapes":
        """A model.spec.ModelSpec's shapes, with the prefix cache's block size."""
        return cls(spec.hidden_size, spec.intermediate_size, spec.sliding_window or 0, spec.attention_softcap or 0.0,
                   spec.qk_norm, page)


@dataclass(frozen=True)
class KernelVerdict:
    kernel: str
    error: str = ""  # "": within the bound; else the exception or the error against the bound


@dataclass(frozen=True)
class SelfCheck:
    verdicts: tuple[KernelVerdict, ...]

    @property
    def failed(self) -> frozenset[str]:
        return frozenset(v.kernel for v in self.verdicts if v.error)

    @property
    def attention_failed(self) -> bool:
        return any(k in self.failed for k in ATTENTION_KERNELS)

    @property
    def failed_ops(self) -> frozenset[str]:
        return self.failed & frozenset(OP_KERNELS)

    def summary(self) -> str:
        """One line for the start-up log and the engine's stats."""
        if not self.failed:
            return f"passed ({len(self.verdicts)} kernels)"
        return "fell back to torch: " + "; ".join(f"{v.kernel} ({v.error})" for v in self.verdicts if v.error)


def run_self_check(device: torch.device, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int,
                   model: ModelShapes, attention: bool, ops: bool) -> SelfCheck:
    """Every Triton kernel the engine would use (`attention`: the attention kernel; `ops`: the
    per-token ones) against torch at these shapes; never raises."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    if attention:
        cases += _attention_cases(device, dtype, head_dim, q_heads, kv_heads, model, gen)
    if ops:
        cases += _op_cases(device, dtype, head_dim, q_heads, kv_heads, model, gen)
    verdicts = tuple(_judge(name, run, dtype) for name, run in cases)
    check = SelfCheck(verdicts)
    (log.warning if check.failed else log.info)("Triton kernel self-check on %s %s: %s", device, str(dtype).replace("torch.", ""),
                                                 check.summary())
    return check


def _judge(name: str, run, dtype: torch.dtype) -> KernelVerdict:
    try:
        got, want = run()
        got, want = got.float(), want.float()
        if got.shape != want.shape:
            return KernelVerdict(name, f"shape {tuple(got.shape)}, torch's {tuple(want.shape)}")
        err = float((got - want).abs().max()) if got.numel() else 0.0
        bound = TOLERANCE_EPS * torch.finfo(dtype).eps * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
        if not err <= bound:  # NaN fails too
            return KernelVerdict(name, f"max error {err:.3g} > bound {bound:.3g}")
        return KernelVerdict(name)
    except Exception as e:  # noqa: BLE001 - any failure of a kernel means "use torch"
        return KernelVerdict(name, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def _randn(gen: torch.Generator, *shape, device, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _attention_cases(device, dtype, head_dim, q_heads, kv_heads, model: ModelShapes, gen):
    """(name, run) pairs: run() -> (the kernel's output, torch's). Full-attention layers first
    (every model has them, windowed models too: Gemma mixes both), then the sliding window
    where the model has one, short enough to bite inside these rows."""
    from .attention import causal_attention
    from .attention_paths import TritonAttention

    path, scale = TritonAttention(device), head_dim ** -0.5
    randn = lambda *shape: _randn(gen, *shape, device=device, dtype=dtype)  # noqa: E731

    def case(rows: int, prefix: int, window: int = 0):
        q, k, v = randn(q_heads, rows, head_dim), randn(kv_heads, prefix + rows, head_dim), randn(kv_heads, prefix + rows, head_dim)

        def run():
            want = causal_attention(q.float(), k.float(), v.float(), scale, "sdpa", window, model.softcap)
            return path.attend(q.clone(), k, v, scale, window=window, softcap=model.softcap), want
        return run

    cases = [("attention_whole", case(_ROWS, 0)), ("attention_cached_prefix", case(_ROWS, _PREFIX)),
             ("attention_one_row", case(1, _PREFIX)), ("attention_paged_prefix", _paged_case(device, dtype, head_dim, q_heads, kv_heads, model, gen))]
    if model.window:
        cases.append(("attention_sliding", case(_ROWS, _PREFIX, min(model.window, _ROWS // 2))))
    return cases


def _paged_case(device, dtype, head_dim, q_heads, kv_heads, model: ModelShapes, gen):
    """A warm request as the engine runs one on this kernel: its prefix read in place from the
    prefix pool's blocks (3 of `model.page` tokens, in shuffled slots), its new rows after it."""
    from ..cache.kv_pool import KVPool
    from .attention import causal_attention
    from .gpu_attention import BatchAttention

    blocks, rows, scale = 3, _ROWS, head_dim ** -0.5
    prefix = blocks * model.page
    pool = KVPool(1, blocks + 2, kv_heads, model.page, head_dim, dtype, device)
    slots = torch.tensor([3, 0, 4], device=device)
    k_prefix, v_prefix = (_randn(gen, kv_heads, prefix, head_dim, device=device, dtype=dtype) for _ in range(2))
    pool.write(0, slots, k_prefix, v_prefix)
    q = _randn(gen, q_heads, rows, head_dim, device=device, dtype=dtype)
    k, v = (_randn(gen, kv_heads, prefix + rows, head_dim, device=device, dtype=dtype) for _ in range(2))  # prefix rows unread

    def run():
        want = causal_attention(q.float(), torch.cat([k_prefix, k[:, prefix:]], 1).float(),
                                torch.cat([v_prefix, v[:, prefix:]], 1).float(), scale, "sdpa", 0, model.softcap)
        launch = BatchAttention([0], [rows], [0], [prefix], [(pool, slots)], scale, device)
        return launch.run(0, q.clone(), k, v, 0, model.softcap), want
    return run


def _op_cases(device, dtype, head_dim, q_heads, kv_heads, model: ModelShapes, gen):
    """(name, run) pairs for the per-token kernels against TorchOps in the same dtype, each run at
    every row count in _OP_ROWS (its outputs concatenated)."""
    # under the interpreter nothing compiles: one row count checks the same code (and the CPU suite runs it often)
    row_counts = (_ROWS,) if gpu_support.interpreting() else _OP_ROWS
    per_rows = [_op_runs(device, dtype, head_dim, q_heads, kv_heads, model, gen, rows) for rows in row_counts]

    def across(name):
        def run():
            got, want = zip(*(runs[name]() for runs in per_rows))
            return torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
        return run
    return [(name, across(name)) for name in OP_KERNELS]


def _op_runs(device, dtype, head_dim, q_heads, kv_heads, model: ModelShapes, gen, rows: int) -> dict:
    """Per op, run() -> (the Triton kernel's output, TorchOps') over `rows` random rows."""
    from .ops import TorchOps, TritonOps

    fast, torch_ops = TritonOps(), TorchOps()
    randn = lambda *shape: _randn(gen, *shape, device=device, dtype=dtype)  # noqa: E731
    w32 = (torch.rand(model.hidden, generator=gen) + 0.5).to(device)
    x, delta = randn(rows, model.hidden), randn(rows, model.hidden)
    scratch = torch.empty(rows, model.hidden, device=device, dtype=torch.float32)

    def rms_norm():
        return (fast.rms_norm_into(torch.empty_like(x), x, w32, 1e-6, scratch),
                torch_ops.rms_norm_into(torch.empty_like(x), x, w32, 1e-6, scratch))

    def add_rms_norm():
        h1, h2, o1, o2 = x.clone(), x.clone(), torch.empty_like(x), torch.empty_like(x)
        fast.add_rms_norm_(h1, delta, w32, 1e-6, o1, scratch)
        torch_ops.add_rms_norm_(h2, delta, w32, 1e-6, o2, scratch)
        return torch.cat([h1, o1]), torch.cat([h2, o2])

    def rope_qkv():
        qkv = randn(rows, (q_heads + 2 * kv_heads) * head_dim)
        angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
        cos, sin = angles.cos().to(device), angles.sin().to(device)
        norms = ((torch.rand(head_dim, generator=gen) + 0.5).to(device), (torch.rand(head_dim, generator=gen) + 0.5).to(device),
                 1e-6) if model.qk_norm else None
        outs = []
        for ops in (fast, torch_ops):
            q = torch.empty(q_heads, rows, head_dim, device=device, dtype=dtype)
            k, v = (torch.empty(kv_heads, rows, head_dim, device=device, dtype=dtype) for _ in range(2))
            scratch_qkv = torch.empty(rows, (q_heads + kv_heads) * head_dim, device=device, dtype=torch.float32)
            ops.rope_qkv_into(q, k, v, qkv.clone(), cos, sin, q_heads, kv_heads, norms, scratch_qkv)  # q/k normed in place
            outs.append(torch.cat([q.flatten(), k.flatten(), v.flatten()]))
        return outs[0], outs[1]

    def swiglu():
        gate_up = randn(rows, 2 * model.intermediate)
        out = torch.empty(rows, model.intermediate, device=device, dtype=dtype)
        return fast.swiglu_into(out, gate_up.clone()), torch_ops.swiglu_into(torch.empty_like(out), gate_up.clone())

    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope_qkv": rope_qkv, "swiglu": swiglu}
