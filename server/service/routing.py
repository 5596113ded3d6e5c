"""Route a request to one of the contexts (replicas) serving its model.

Each replica is scored by the work the request would wait for there: the prompt tokens it would
have to compute (those beyond the longest prefix that replica's cache holds) plus `LOAD_TOKENS`
for every request already in flight on it; the lowest score wins, the less loaded among equals.
So a long cached prefix (a shared system prompt) keeps requests on the replica that holds it until
that replica is `prefix / LOAD_TOKENS` requests busier than another, and a short one (the chat
template's first tokens, which every replica soon holds) does not outweigh one request of load.
Replicas that lend each other their threads (engine/threads.py, CoreBudget) make an idle replica
cheap to leave idle, and a spread load is served faster (1-thread contexts never meet at
llama.cpp's barriers).

A session's affinity key (`prompt_cache_key`, Claude Code's session header, the session in
`metadata.user_id`) keeps the session on the replica that served its last turn while that replica
is at most `AFFINITY_SLACK` requests busier than the least busy one: its history is cached there,
even where the rendered prompt changed at its start."""
from __future__ import annotations

from collections import OrderedDict
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


AFFINITY_SLACK = 2        # in-flight requests more than the least busy replica a session stays for
AFFINITY_KEYS = 4096      # sessions remembered (least recently seen forgotten first)


class Affinity:
    """The replica each recent session was last sent to, by its affinity key."""

    def __init__(self, capacity: int = AFFINITY_KEYS):
        self.capacity = capacity
        self.last: OrderedDict[str, Replica] = OrderedDict()

    def pick(self, replicas: Sequence[Replica], tokens: list[int],
             key: str | None = None) -> Replica:
        chosen = pick_replica(replicas, tokens)
        if key is None or len(replicas) == 1:
            return chosen
        held = self.last.get(key)
        if held in replicas and held.outstanding <= chosen.outstanding + AFFINITY_SLACK:
            chosen = held
        self.last[key] = chosen
        self.last.move_to_end(key)
        while len(self.last) > self.capacity:
            self.last.popitem(last=False)
        return chosen
