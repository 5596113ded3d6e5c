"""Scheduling: policies, the per-context continuous-batching scheduler, and the router."""
from scheduler.policy import POLICIES, Policy, make_policy
from scheduler.scheduler import Chunk, Scheduler, StepPlan
from scheduler.sequence import Sequence, Status

__all__ = ["Chunk", "POLICIES", "Policy", "Scheduler", "Sequence", "Status", "StepPlan",
           "make_policy"]
