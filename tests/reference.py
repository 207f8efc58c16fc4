"""References for the numeric tests: transformers' own forward (last-position log-probabilities)
and explicit float64 attention."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]), logits_to_keep=1, use_cache=False)
    return out.logits[0, -1].double().log_softmax(-1)


def load_hf(folder: str, dtype: torch.dtype):
    """transformers' model of `folder` in `dtype`: its default attention, eager for Gemma (whose
    soft-capping and windows transformers computes exactly only there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gemma = AutoConfig.from_pretrained(folder).model_type.startswith("gemma")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **({"attn_implementation": "eager"} if gemma else {})).eval()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """softmax(QK^T * scale)V in float64 with a bottom-right causal mask: q [Hq, Lq, D], k/v
    [Hkv, Lk, D]; query i sits at key position Lk - Lq + i; query heads share KV heads in groups.
    window > 0: a query at t sees keys (t - window, t] only; softcap > 0: scores s (scaled) become
    softcap * tanh(s / softcap) before the mask (Gemma 2's attention soft-capping)."""
    hq, lq, _ = q.shape
    hkv, lk, _ = k.shape
    g = hq // hkv
    k = k.double().repeat_interleave(g, 0)
    v = v.double().repeat_interleave(g, 0)
    scores = q.double() @ k.transpose(1, 2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(lq)[:, None] + (lk - lq)
    kpos = torch.arange(lk)[None, :]
    hidden = (kpos > qpos) | ((qpos - kpos >= window) if window else False)
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
