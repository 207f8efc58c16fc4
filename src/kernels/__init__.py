"""Compute kernels of the hot path: attention over the whole sequence, the GEMMs and the per-token
fused ops; kernels.backend.KernelBackend is the one choice among them an engine makes."""

from .attention import causal_attention, causal_attention_inplace, inplace_attention_supported, resolve_backend
from .linear import linear
from .ops import ops_for

__all__ = ["causal_attention", "causal_attention_inplace", "inplace_attention_supported", "resolve_backend", "linear", "ops_for"]
