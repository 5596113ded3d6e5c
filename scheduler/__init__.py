"""Scheduling: policies and the per-context continuous-batching scheduler."""
from scheduler.policy import POLICIES, Policy, make_policy
from scheduler.scheduler import Chunk, Scheduler, StepPlan
from scheduler.sequence import FinishReason, Sequence, Status

__all__ = ["Chunk", "FinishReason", "POLICIES", "Policy", "Scheduler", "Sequence", "Status", "StepPlan",
           "make_policy"]
