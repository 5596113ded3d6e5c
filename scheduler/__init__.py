"""Scheduling: policies and the per-context continuous-batching scheduler."""
from scheduler.plan import Chunk, StepPlan
from scheduler.policy import POLICIES, Policy, make_policy
from scheduler.scheduler import Scheduler
from scheduler.sequence import FinishReason, Preemption, Sequence, Status

__all__ = ["Chunk", "FinishReason", "POLICIES", "Policy", "Preemption", "Scheduler", "Sequence",
           "Status", "StepPlan", "make_policy"]
