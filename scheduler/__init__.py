"""Scheduling: policies and the per-context continuous-batching scheduler."""
from scheduler.policy import POLICIES, Policy, make_policy
from scheduler.scheduler import Chunk, Scheduler, StepPlan
from scheduler.sequence import FinishReason, Preemption, Sequence, Status

__all__ = ["Chunk", "FinishReason", "POLICIES", "Policy", "Preemption", "Scheduler", "Sequence",
           "Status", "StepPlan", "make_policy"]
