"""transformers' own forward as the reference: last-position log-probabilities."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]), logits_to_keep=1, use_cache=False)
    return out.logits[0, -1].double().log_softmax(-1)


def load_hf(folder: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
