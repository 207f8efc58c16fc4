"""Request scheduling: the waiting set, the JCT estimate and the policy that picks the next request.

Tensor-free: it sees requests as token counts and prefix-cache keys, and asks one question of
the cache ("how many leading tokens of this prompt are cached now?"), so the simulator drives
the same code with a cost model instead of a model.
"""

from .jct import JctCoefficients, JctEstimator
from .policy import DEFAULT_LAMBDA_TOKENS_PER_S, DEFAULT_MAX_WAITING, POLICIES, Scheduler, WaitingRequest

__all__ = ["JctCoefficients", "JctEstimator", "DEFAULT_LAMBDA_TOKENS_PER_S", "DEFAULT_MAX_WAITING", "POLICIES", "Scheduler",
           "WaitingRequest"]
