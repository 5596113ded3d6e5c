"""BlockPool: one context's KV blocks and the prefix cache's index over them.

Blocks are units of budget (block_size cells). A block is free (unreferenced, uncached),
referenced by the block tables of live sequences (ref_count), or cached and unreferenced
(evictable). A cached block is full and listed under its chain hash (kvcache/blocks.py: the hash
of its parent's hash and its tokens), with its parent, its number of cached children and the seq
id whose cells hold it (its owner: kvcache/seq_ids.py). Cached blocks form chains, and a chain's
ancestors are evicted only after its descendants: only leaves (evictable blocks without cached
children) are evicted, the least recently released first (LeafQueue, kvcache/leaves.py: O(1)
amortised). `children` lists the cached blocks under each parent's hash, where a hit that ends
inside a block finds the block that continues it (`partial`).

Every cached ancestor of a referenced block is referenced (a live sequence's table is one cached
chain followed by uncached blocks: kvcache/manager.py), so an evictable block has only evictable
descendants and can be evicted now (leaves first): `num_free_blocks` (free + evictable) is
exactly what a sequence can get.

This module keeps the blocks' bookkeeping only: which seq id's cells a block lives in, and the
KV operations that follow from evicting one, are the seq ids' (kvcache/seq_ids.py).
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from kvcache.blocks import NO_PARENT, Block, block_hashes
from kvcache.leaves import LeafQueue


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefill_chunk: int,
                 prefix_caching: bool):
        self.block_size, self.prefill_chunk = block_size, prefill_chunk
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_list: deque[Block] = deque(self.blocks)          # unreferenced, uncached
        self.evictable: dict[int, Block] = {}   # unreferenced, cached; in release order
        self.leaves = LeafQueue()               # the evictable ones without cached children
        self._clock = itertools.count(1)        # Block.last_used
        self.cache: dict[int, Block] = {}                      # chain hash -> block
        # parent's chain hash (NO_PARENT for a first block) -> its cached children: where a hit
        # that ends inside a block finds the block that continues it
        self.children: dict[int, set[Block]] = {}

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never-used ones plus evictable cached ones (each can
        be evicted now: its cached descendants are evictable too, see the module docstring)."""
        return len(self.free_list) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def fork_blocks(self, n_tokens: int) -> int:
        """Blocks a fork of an n_tokens prompt takes: its full blocks are the parent's, cached
        (unless prefix caching is off); the rest, and room for one more token, are its own."""
        shared = n_tokens // self.block_size if self.prefix_caching else 0
        return self.blocks_for(n_tokens + 1) - shared

    def fits(self, hit: list[Block], reserve_tokens: int, extra_blocks: int) -> bool:
        """Whether blocks for reserve_tokens (less the cached hit, plus extra_blocks) can be had
        now."""
        hit_evictable = sum(1 for b in hit if b.ref_count == 0)
        need = self.blocks_for(reserve_tokens) - len(hit) + extra_blocks
        return need <= self.num_free_blocks - hit_evictable

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, self.block_size)

    # ---- looking up ---------------------------------------------------------------------------
    def match(self, hashes: list[int], tokens: Sequence[int], start: int,
              max_reuse: int) -> list[Block]:
        """Cached blocks for hashes[start:], as many as keep the reuse <= max_reuse."""
        if not self.prefix_caching:
            return []
        bs, hit = self.block_size, []
        for i in range(start, len(hashes)):
            block = self.cache.get(hashes[i])
            if block is None or block.tokens != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hit.append(block)
        end = min((start + len(hit)) * bs, max_reuse) // bs
        return hit[:max(0, end - start)]

    def partial(self, hit: list[Block], tokens: Sequence[int],
                max_reuse: int) -> tuple[Block | None, int]:
        """A hit that ends inside a block: the cached block that continues `hit` with the most of
        our next tokens, and how many (1 to block_size - 1, within max_reuse). Its owner holds
        the whole chain, so one copy from it brings them. The partial block itself stays the
        new sequence's own: it is neither referenced nor shared. Reuse does not end one token
        before a prefill grid line, where the next piece would be a single token (other
        numbers; see the scheduler)."""
        if not self.prefix_caching:
            return None, 0
        bs, grid = self.block_size, self.prefill_chunk
        p = len(hit) * bs
        kids = self.children.get(hit[-1].key if hit else NO_PARENT)
        limit = min(bs - 1, max_reuse - p, len(tokens) - p)
        if not kids or limit < 1:
            return None, 0
        ours = tokens[p:p + limit]
        best, best_k = None, 0
        for block in kids:
            k = 0
            for a, b in zip(block.tokens, ours):
                if a != b:
                    break
                k += 1
            if k > best_k:
                best, best_k = block, k
        if best_k and (p + best_k) % grid == grid - 1 and p + best_k + 1 < len(tokens):
            best_k -= 1
        return (best, best_k) if best_k else (None, 0)

    def lookup(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache holds (no side effects)."""
        return len(self.match(self.hashes(tokens), tokens, 0, len(tokens))) * self.block_size

    # ---- references -----------------------------------------------------------------------------
    def ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.evictable[block.id]
            self.leaves.discard(block)
        block.ref_count += 1

    def unref(self, block: Block) -> None:
        """Drop one reference: a cached block becomes evictable, an uncached one free."""
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is None:
            self.release(block)
            return
        block.last_used = next(self._clock)
        self.evictable[block.id] = block
        if block.n_children == 0:
            self.leaves.add(block)

    def take_free(self, index: int) -> Block:
        """A free block, referenced once as block `index` of a table (one is free: the caller
        evicts first when none is)."""
        block = self.free_list.popleft()
        block.ref_count, block.index = 1, index
        return block

    def release(self, block: Block) -> None:
        """An unreferenced, uncached block goes back to the free list."""
        block.reset()
        self.free_list.append(block)

    # ---- the prefix index -----------------------------------------------------------------------
    def register(self, block: Block, h: int, tokens: tuple[int, ...], owner: int, index: int,
                 parent: Block | None) -> None:
        """Put a referenced block in the cache under chain hash h, held by seq id `owner`, below
        parent."""
        block.hash, block.tokens, block.owner, block.index = h, tokens, owner, index
        block.parent = parent
        if parent is not None:
            parent.n_children += 1
            self.leaves.discard(parent)
        self.cache[h] = block
        self.children.setdefault(block.parent_key, set()).add(block)

    def unlist(self, block: Block) -> None:
        """Take a cached block without cached children out of the index; its parent may become
        an evictable leaf. The block keeps its references (the caller frees or resets it)."""
        self.leaves.discard(block)
        self.evictable.pop(block.id, None)
        del self.cache[block.key]
        key = block.parent_key
        siblings = self.children[key]
        siblings.discard(block)
        if not siblings:
            del self.children[key]
        parent = block.parent
        if parent is not None:
            parent.n_children -= 1
            if parent.n_children == 0 and parent.ref_count == 0:
                self.leaves.add(parent)

    def evict(self, leaf: Block) -> None:
        """An evictable leaf leaves the cache for the free list."""
        self.unlist(leaf)
        self.release(leaf)

    def uncache(self, block: Block) -> int:
        """A referenced block without cached children leaves the index: its cells do not hold
        what it was listed for. It stays in its tables, uncached. Returns its former owner."""
        self.unlist(block)
        owner = block.holder
        block.hash, block.tokens, block.owner, block.parent = None, (), None, None
        return owner

    def subtree(self, roots: list[Block]) -> list[Block]:
        """Cached blocks under `roots`, roots included, each once, deepest first (a cached
        block's index is its depth in its chain)."""
        found: dict[int, Block] = {}
        stack = list(roots)
        while stack:
            block = stack.pop()
            if block.id not in found:
                found[block.id] = block
                stack.extend(self.children.get(block.key, ()))
        return sorted(found.values(), key=lambda b: -b.index)

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        referenced = sum(1 for b in self.blocks if b.ref_count)
        assert len(self.free_list) + len(self.evictable) + referenced == self.num_blocks
        assert all(b.ref_count == 0 and b.hash is None for b in self.free_list)
        assert all(b.ref_count == 0 and b.hash is not None for b in self.evictable.values())
        assert all(self.cache[b.key] is b for b in self.evictable.values())
        # every cached ancestor of a referenced block is referenced: evictable blocks can go now
        assert all(b.parent is None or b.parent.ref_count for b in self.cache.values()
                   if b.ref_count)
        self._check_leaves()
        for h, block in self.cache.items():
            assert block.hash == h and block.owner is not None
            assert block.parent is None or block.parent.hash is not None
        children: dict[int, int] = {}
        for block in self.cache.values():
            if block.parent is not None:
                children[block.parent.id] = children.get(block.parent.id, 0) + 1
        assert all(b.n_children == children.get(b.id, 0) for b in self.cache.values())
        index: dict[int, set] = {}
        for block in self.cache.values():
            index.setdefault(block.parent_key, set()).add(block)
        assert index == self.children

    def _check_leaves(self) -> None:
        """The leaf queue holds exactly the evictable leaves, and its oldest is the first leaf
        in release order (what a scan of every evictable block would pick)."""
        self.leaves.check()
        leaves = [b for b in self.evictable.values() if b.n_children == 0]
        assert self.leaves.ids() == {b.id for b in leaves}
        assert all(a.last_used < b.last_used
                   for a, b in zip(self.evictable.values(), list(self.evictable.values())[1:]))
        assert self.leaves.oldest() is (leaves[0] if leaves else None)
