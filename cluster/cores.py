"""Split this process's cores between replicas, so that each replica's llama.cpp threads have
cores of their own (threads of two processes sharing a core stall each other at llama.cpp's
barriers: docs/shared-machines.md, "Why a busy neighbour stalls llama.cpp")."""
from __future__ import annotations

import os


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: list[int], replicas: int) -> list[list[int]]:
    """Consecutive, disjoint groups of equal size, one per replica; with fewer cores than
    replicas, replicas share cores round-robin (one core each)."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if len(cores) < replicas:
        return [[cores[i % len(cores)]] for i in range(replicas)]
    per = len(cores) // replicas
    return [cores[i * per:(i + 1) * per] for i in range(replicas)]
