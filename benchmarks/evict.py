"""Prefix-cache eviction cost: microseconds per evicted block with 1k, 10k and 100k cached blocks,
the BlockManager's leaf queue ("new") against the scan it replaced ("old": walk every evictable
block in release order to the first leaf). Pure Python, no model; printed, not asserted.

Two states to evict from, built through the manager's own calls:
- chains: finished sequences of 8 cached blocks each (released tail first, so the oldest
  evictable block is always a leaf: the scan stops at once too);
- parents first: split KV, pairs of sequences that computed the same first block at once; the
  first of each pair ends before the second, so every pair's parent block is released (not a leaf:
  the second's next block hangs below it) before any child. The scan walks past those parents.

    python -m benchmarks.evict [--sizes 1000,10000,100000] [--evictions 1000]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Callable

from benchmarks.metrics import write_result
from kvcache import BlockManager

BS = 4


class ScanningBlockManager(BlockManager):
    """The eviction of before the leaf queue: the first leaf among all evictable blocks."""

    def _evict_one(self) -> bool:
        leaf = next((b for b in self.evictable.values() if b.n_children == 0), None)
        if leaf is None:
            return False
        self.leaves.discard(leaf)
        self._evict(leaf)
        return True


def build_chains(cls: type[BlockManager], n_blocks: int) -> BlockManager:
    n_seqs = n_blocks // 8
    manager = cls(n_blocks, block_size=BS, num_seq_ids=n_seqs)
    for s in range(n_seqs):
        tokens = [s * 100 + i for i in range(8 * BS)]
        alloc = manager.open(tokens, 0, len(tokens))
        manager.ensure(alloc, len(tokens))
        manager.commit(alloc, tokens, len(tokens))
        manager.free(alloc)
    return manager


def build_parents_first(cls: type[BlockManager], n_blocks: int) -> BlockManager:
    n_pairs = n_blocks // 2     # cached per pair: the parent and the child
    manager = cls(3 * n_pairs, block_size=BS, num_seq_ids=2 * n_pairs, share_cells=False)
    pairs = []
    for p in range(n_pairs):
        head = [p * 100 + i for i in range(BS)]
        first, second = head, head + [p * 100 + 50 + i for i in range(BS)]
        pairs.append([(manager.open(t, 0, len(t)), t) for t in (first, second)])
    for pair in pairs:
        for alloc, tokens in pair:
            manager.ensure(alloc, len(tokens))
            manager.commit(alloc, tokens, len(tokens))
    for index in (0, 1):
        for pair in pairs:
            manager.free(pair[index][0])
    return manager


def us_per_eviction(manager: BlockManager, n: int) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(n):
        manager._evict_one()
    return (time.perf_counter() - t0) / n * 1e6


WORKLOADS: dict[str, Callable[[type[BlockManager], int], BlockManager]] = {
    "chains": build_chains, "parents first": build_parents_first}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000", help="cached blocks to evict from")
    p.add_argument("--evictions", type=int, default=1000, help="evictions timed per measurement")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    rows = []
    print(f"{'state':<14} {'cached':>8} {'old us/evict':>13} {'new us/evict':>13} {'old/new':>8}")
    for name, build in WORKLOADS.items():
        for size in [int(x) for x in args.sizes.split(",")]:
            times = {}
            for label, cls in (("old", ScanningBlockManager), ("new", BlockManager)):
                manager = build(cls, size)
                cached = manager.num_cached_blocks
                times[label] = us_per_eviction(manager, min(args.evictions, cached))
            rows.append({"state": name, "cached_blocks": cached, "old_us": times["old"],
                         "new_us": times["new"]})
            print(f"{name:<14} {cached:>8,} {times['old']:>13.2f} {times['new']:>13.2f} "
                  f"{times['old'] / times['new']:>7.1f}x", flush=True)
    if args.result_file:
        write_result(args.result_file, {"evictions": args.evictions, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
