"""LeafQueue: the prefix cache's evictable leaves, least recently used first.

A leaf is a cached block that no sequence references and no cached block has as its parent; only
leaves are evicted, so a chain goes tail first. A leaf's age is `Block.last_used`, the manager's
clock when its last reference was dropped, and eviction takes the oldest: the same block that
scanning all unreferenced blocks in release order for the first leaf would find.

Most leaves arrive at an end of that order: a finished sequence releases its blocks tail first,
each newer than every queued leaf; a parent whose last child is evicted is usually older than
every queued leaf (that child was the oldest, and the two were released together). Both go into
an ordered dict, O(1). A parent released between queued leaves (say, a shared prefix whose last
holder kept its tail uncached) goes to a heap instead; stale heap entries are dropped when they
reach the top, and the heap is rebuilt when they outnumber the live ones.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from kvcache.blocks import Block


class LeafQueue:
    def __init__(self) -> None:
        self._queue: OrderedDict[int, Block] = OrderedDict()   # by id, last_used ascending
        self._late: dict[int, Block] = {}                       # by id, ordered by _heap
        self._heap: list[tuple[int, int]] = []                  # (last_used, id), some stale

    def __len__(self) -> int:
        return len(self._queue) + len(self._late)

    def __contains__(self, block: Block) -> bool:
        return block.id in self._queue or block.id in self._late

    def ids(self) -> set[int]:
        return self._queue.keys() | self._late.keys()

    def add(self, block: Block) -> None:
        """Queue an evictable leaf (its last_used set)."""
        if not self._queue or block.last_used > self._newest_queued().last_used:
            self._queue[block.id] = block
        elif block.last_used < self._first_queued().last_used:
            self._queue[block.id] = block
            self._queue.move_to_end(block.id, last=False)
        else:
            self._late[block.id] = block
            heapq.heappush(self._heap, (block.last_used, block.id))
            self._compact()

    def discard(self, block: Block) -> None:
        """Forget a block (referenced again, given a child, or evicted); no-op if absent."""
        if self._queue.pop(block.id, None) is None and self._late.pop(block.id, None) is not None:
            self._compact()

    def oldest(self) -> Block | None:
        late, queued = self._oldest_late(), self._oldest_queued()
        if late is not None and (queued is None or late.last_used < queued.last_used):
            return late
        return queued

    def pop_oldest(self) -> Block | None:
        block = self.oldest()
        if block is not None:
            self.discard(block)
        return block

    def _oldest_queued(self) -> Block | None:
        return next(iter(self._queue.values()), None)

    def _first_queued(self) -> Block:
        """The oldest queued leaf (the queue is not empty)."""
        return next(iter(self._queue.values()))

    def _newest_queued(self) -> Block:
        return next(reversed(self._queue.values()))

    def _oldest_late(self) -> Block | None:
        while self._heap:
            last_used, block_id = self._heap[0]
            block = self._late.get(block_id)
            if block is not None and block.last_used == last_used:
                return block
            heapq.heappop(self._heap)   # stale: discarded, or queued again under another entry
        return None

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._late) + 16:
            self._heap = [(b.last_used, b.id) for b in self._late.values()]
            heapq.heapify(self._heap)

    def check(self) -> None:
        ages = [b.last_used for b in self._queue.values()]
        assert ages == sorted(set(ages)), "queued leaves out of LRU order"
        assert not (self._queue.keys() & self._late.keys())
        assert all(b.id == i for i, b in self._queue.items()) and all(
            b.id == i for i, b in self._late.items())
        live_entries = {(b.last_used, b.id) for b in self._late.values()}
        assert live_entries <= set(self._heap), "a late leaf without its heap entry"
        assert len(self._heap) <= 2 * len(self._late) + 16
