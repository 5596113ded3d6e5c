"""Route a request to one of the contexts (replicas) serving its model.

Each replica is scored by the work the request would wait for there: the prompt tokens it would
have to compute (those beyond the longest prefix that replica's cache holds) plus `LOAD_TOKENS`
for every request already in flight on it; the lowest score wins, the less loaded among equals.
So a long cached prefix (a shared system prompt) keeps requests on the replica that holds it until
that replica is `prefix / LOAD_TOKENS` requests busier than another, and a short one (the chat
template's first tokens, which every replica soon holds) does not outweigh one request of load.
Replicas that lend each other their threads (engine/threads.py, CoreBudget) make an idle replica
cheap to leave idle, and a spread load is served faster (1-thread contexts never meet at
llama.cpp's barriers)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

LOAD_TOKENS = 64   # what one request in flight is taken to cost: a short prompt's worth


class Replica(Protocol):
    @property
    def outstanding(self) -> int: ...

    def cached_prefix(self, tokens: list[int]) -> int: ...


def score(replica: Replica, tokens: list[int]) -> int:
    return len(tokens) - replica.cached_prefix(tokens) + LOAD_TOKENS * replica.outstanding


def pick_replica(replicas: Sequence[Replica], tokens: list[int]) -> Replica:
    if len(replicas) == 1:
        return replicas[0]
    return min(replicas, key=lambda r: (score(r, tokens), r.outstanding))
