"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

The best sequence has the smallest key; the victim is the running sequence with the largest."""
from __future__ import annotations

from typing import Protocol

from scheduler.sequence import Sequence


class Policy(Protocol):
    name: str

    def key(self, seq: Sequence) -> tuple: ...

    def preempts_for(self, waiting: Sequence, running: Sequence) -> bool:
        """May `running` be preempted so that `waiting` can start?"""
        ...


class FIFO:
    name = "fifo"

    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival,)

    def preempts_for(self, waiting: Sequence, running: Sequence) -> bool:
        return False


class PriorityFirst:
    """vLLM's priority scheduling: lower `priority` runs first, ties by arrival."""
    name = "priority"

    def key(self, seq: Sequence) -> tuple:
        return (seq.priority, seq.arrival)

    def preempts_for(self, waiting: Sequence, running: Sequence) -> bool:
        return waiting.priority < running.priority


class ShortestPromptFirst:
    """Short prompts first (less head-of-line blocking behind long documents), ties by arrival."""
    name = "spf"

    def key(self, seq: Sequence) -> tuple:
        return (seq.num_prompt, seq.arrival)

    def preempts_for(self, waiting: Sequence, running: Sequence) -> bool:
        return False


POLICIES: dict[str, type] = {p.name: p for p in (FIFO, PriorityFirst, ShortestPromptFirst)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(POLICIES)}") from None
