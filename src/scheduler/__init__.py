"""Request scheduling: the waiting set, the JCT estimate and the policy that plans the next step.

Tensor-free: it sees requests as token counts and prefix-cache keys, and asks the cache how many
leading tokens of a prompt are cached now and to pin a step's members (prefix_view.py), so the
simulator drives the same code with a cost model instead of a model. What it hands down is a
typed, final StepPlan (plan.py): the step is plan = schedule(), outcome = runner.execute(plan),
answers = finish(plan, outcome).
"""

from ..contract.jct import JctCoefficients, JctEstimator
from .plan import (Answer, ItemsPlan, Schedulable, StepBudget, StepMember, StepMemory, StepOutcome, StepPlan, TokenSplit,
                   WaitingRequest)
from .policy import DEFAULT_LAMBDA_TOKENS_PER_S, POLICIES, Scheduler, error_code
from .prefix_view import IndexPrefixView, NoPrefixCache, PrefixView

__all__ = ["JctCoefficients", "JctEstimator", "DEFAULT_LAMBDA_TOKENS_PER_S", "POLICIES", "Scheduler",
           "error_code", "Answer", "ItemsPlan", "Schedulable", "StepBudget", "StepMember", "StepMemory", "StepOutcome",
           "StepPlan", "TokenSplit", "WaitingRequest", "IndexPrefixView", "NoPrefixCache", "PrefixView"]
