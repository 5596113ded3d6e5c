"""Route a request to one of the contexts (replicas) serving its model.

Prefix-affine: prefer the replica whose prefix cache already holds the longest prefix of the
prompt (at least one block); among equals, the least loaded one."""
from __future__ import annotations

from typing import Protocol, Sequence


class Replica(Protocol):
    @property
    def outstanding(self) -> int: ...

    def cached_prefix(self, tokens: list[int]) -> int: ...


def pick_replica(replicas: Sequence[Replica], tokens: list[int]) -> Replica:
    if len(replicas) == 1:
        return replicas[0]
    return max(replicas, key=lambda r: (r.cached_prefix(tokens), -r.outstanding))
