"""The buffers of one request, planned in one place.

The executor allocates exactly this plan, and memory.py predicts a request's peak from the
same plan, so the two cannot drift apart.

  request-long buffers (live for the whole forward, reused by every layer):
    hidden [S, d]  residual stream          q [Hq, S, hd]   k, v [Hkv, P+S, hd]
  one chunk's buffers (reused by every chunk and layer), C = chunk size:
    normed [C, d]   scratch32 [C, max(d, q_width)] float32 (torch RMSNorm only)   qkv [C, qkv_width]
    o_rows [C, q_width]   proj [C, d]   gate_up [C, 2F]   act [C, F]
  qkv, proj and gate_up are the projections' outputs: planned with no rows where the linear
  backend allocates its own outputs (kernels.linear.allocates_output; memory.py counts those).
  after the layers, a logprob span's logits: LOGPROB_ROWS rows of [vocab] at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.spec import ModelSpec


# rows of a logprob span per LM-head call (executor._span_logprobs): their [rows, vocab] float32
# logits and log-softmax temporaries are what a span adds to a forward's peak, whatever its length
LOGPROB_ROWS = 64


@dataclass(frozen=True)
class WorkspacePlan:
    new_tokens: int  # S
    prefix_tokens: int  # P (cached K/V given)
    chunk: int  # C (== S when unchunked)
    shapes: dict  # name -> (shape, dtype)

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in self.shapes.values():
            n = 1
            for x in shape:
                n *= x
            total += n * torch.tensor([], dtype=dtype).element_size()
        return total


def plan_workspace(spec: ModelSpec, new_tokens: int, chunk_size: int | None, dtype: torch.dtype, prefix_tokens: int = 0,
                   fp32_scratch: bool = True, linear_outputs: bool = True) -> WorkspacePlan:
    """fp32_scratch=False: the compiled RMSNorm runs, scratch32 gets no rows (KernelBackend.norm_scratch).
    linear_outputs=False: the linear backend allocates the projections' outputs, qkv, proj and
    gate_up get no rows."""
    s, total = new_tokens, prefix_tokens + new_tokens
    c = s if not chunk_size or chunk_size >= s else int(chunk_size)
    d, f = spec.hidden_size, spec.intermediate_size
    hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    f32 = torch.float32
    lc = c if linear_outputs else 0
    shapes = {
        "hidden": ((s, d), dtype),
        "q": ((hq, s, hd), dtype),
        "k": ((hkv, total, hd), dtype),
        "v": ((hkv, total, hd), dtype),
        "normed": ((c, d), dtype),
        "scratch32": ((c if fp32_scratch else 0, max(d, spec.q_width)), f32),
        "qkv": ((lc, spec.qkv_width), dtype),
        "o_rows": ((c, spec.q_width), dtype),
        "proj": ((lc, d), dtype),
        "gate_up": ((lc, 2 * f), dtype),
        "act": ((c, f), dtype),
    }
    return WorkspacePlan(new_tokens=s, prefix_tokens=prefix_tokens, chunk=c, shapes=shapes)


def allocate(plan: WorkspacePlan, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dt, device=device) for name, (shape, dt) in plan.shapes.items()}
