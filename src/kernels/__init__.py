"""Compute kernels of the hot path: attention over the whole sequence and per-token fused ops."""

from .attention import causal_attention, causal_attention_inplace, inplace_attention_supported, resolve_backend
from .linear import linear
from .ops import gated_activation_into, rms_norm_into, rope_into, swiglu_into

__all__ = ["causal_attention", "causal_attention_inplace", "inplace_attention_supported", "resolve_backend", "linear", "gated_activation_into", "rms_norm_into", "rope_into", "swiglu_into"]
