"""BlockManager: paged bookkeeping over one llama.cpp context's KV cells, in three parts: the block
pool and its prefix index (kvcache/pool.py), the mapping of sequences and cached blocks onto
llama.cpp seq ids (kvcache/seq_ids.py), and what is asked of the RAM and disk tiers
(kvcache/tier_link.py). This module opens, grows and closes sequences with them, and queues the
KV ops (kvcache/blocks.py) that the engine applies in order before its next decode (take_ops).
It reads no file and calls no llama.cpp: a tier hit is a LoadOp whose state the engine reads.

A live sequence holds a llama.cpp seq id and a block table. With prefix caching on, every full
block a sequence computes is registered under its chain hash, owned by its seq id (commit).
A new sequence whose prompt starts with cached blocks gets them by CopyOp (llama_memory_seq_cp
from the owner of the last matched block, which holds the whole chain): zero-copy in a unified
KV cache, a stream copy with split KV (share_cells=False). A hit may end on any token (the
engine's kernels compute the same numbers for any cut of a prompt into pieces of 2 or more
tokens: docs/prefix-cache.md, "Exact answers"): past its last matched block, the cached block
that continues it with the most of the prompt's next tokens lends those cells
(BlockPool.partial), as llama-server's slots do (a chat template's head rarely ends on a block
boundary). With split KV the next turn of a conversation may instead run on its holder's seq id
(`_adopt`); a prompt a snapshot holds further than the streams loads it (`_open_from_tier`).

A live sequence's block table is one cached chain (each cached block's parent is the block before
it) followed by uncached blocks: a block computed twice at once, or restored over its own cached
copy after a swap, is swapped for the cached twin (`_meet_twin`). So every cached ancestor of a
referenced block is referenced, and `num_free_blocks` is exactly what `ensure` can deliver
(kvcache/pool.py): `open` and `ensure` are all or nothing.

Invariant: cells llama.cpp uses <= cells of the blocks counted as used here.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvcache.blocks import (
    NO_PARENT,
    Block,
    CopyOp,
    DropSavedOp,
    KVOp,
    RemoveOp,
    RestoreOp,
    SaveOp,
    SeqAlloc,
    block_hashes,
)
from kvcache.pool import BlockPool
from kvcache.seq_ids import SeqIds
from kvcache.snapshots import Space
from kvcache.tier_link import TierLink


class BlockManager:
    def __init__(self, num_blocks: int, *, block_size: int = 16, num_seq_ids: int = 64,
                 prefix_caching: bool = True, prefill_chunk: int | None = None,
                 share_cells: bool = True, tiers: Space | None = None,
                 stream_cells: int = 0):
        prefill_chunk = prefill_chunk or block_size
        if prefill_chunk % block_size:
            raise ValueError(f"prefill chunk {prefill_chunk} must be a multiple of block size "
                             f"{block_size}")
        self.block_size, self.prefill_chunk = block_size, prefill_chunk
        self.prefix_caching, self.share_cells = prefix_caching, share_cells
        self._ops: list[KVOp] = []          # for the engine, in order; read through take_ops()
        self.pool = pool = BlockPool(num_blocks, block_size, prefill_chunk, prefix_caching)
        self.link = TierLink(tiers if prefix_caching else None, block_size, self._push)
        self.ids = SeqIds(self.pool, num_seq_ids, share_cells=share_cells,
                          stream_cells=stream_cells, emit=self._emit, moved=self.link.moved)
        # what the scheduler, the engine and tests read of the parts (never replaced)
        self.cache, self.free_list = pool.cache, pool.free_list
        self.live, self.unsaved = self.ids.live, self.link.unsaved
        self.blocks_for, self.hashes, self.lookup = pool.blocks_for, pool.hashes, pool.lookup
        self.fork_blocks, self.num_blocks = pool.fork_blocks, pool.num_blocks
        self._save_keys = itertools.count()
        self.query_tokens = self.hit_tokens = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now (kvcache/pool.py)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def take_ops(self) -> list[KVOp]:
        ops, self._ops = self._ops, []
        return ops

    def _push(self, op: KVOp) -> None:
        self._ops.append(op)

    def _emit(self, op: KVOp) -> None:
        """Queue an op for the engine; a holder not yet saved is saved first if the op would
        change its cells (kvcache/tier_link.py)."""
        self.link.save_before(op)
        self._ops.append(op)

    def _count_hits(self, alloc: SeqAlloc, query: int, hit: int) -> None:
        self.query_tokens += query
        self.hit_tokens += hit
        alloc.query_tokens += query
        alloc.hit_tokens += hit

    # ---- opening and closing sequences ---------------------------------------------------------
    def open(self, tokens: Sequence[int], max_reuse: int, reserve_tokens: int, *,
             hashes: list[int] | None = None, extra_blocks: int = 0) -> SeqAlloc | None:
        """A sequence for `tokens` that reuses up to `max_reuse` cached tokens, if blocks for
        `reserve_tokens` (+ extra_blocks already promised elsewhere) fit and a seq id is free."""
        hashes = hashes if hashes is not None else self.hashes(tokens)
        adopted = self._adopt(tokens, hashes, max_reuse, reserve_tokens, extra_blocks)
        if adopted is not None:
            return adopted
        seq_id = self.ids.acquire()
        if seq_id is None:
            return None
        hit = self.pool.match(hashes, tokens, 0, max_reuse)
        part, k = self.pool.partial(hit, tokens, max_reuse)
        loaded = self._open_from_tier(seq_id, tokens, hashes, max_reuse,
                                      len(hit) * self.block_size + k, reserve_tokens,
                                      extra_blocks)
        if loaded is not None:
            return loaded
        alloc = self._reserve(seq_id, hit, reserve_tokens, extra_blocks)
        if alloc is None:
            return None
        alloc.hashes = list(hashes)
        self._share(alloc, hit, part, k)
        alloc.num_cached = len(hit) * self.block_size + k
        if part is not None:   # the copied cells of the partial block are counted in a block
            self.pool.ref(part)      # of its own now; a use: the lent block goes to the back of
            self.pool.unref(part)    # the eviction order
            self.ensure(alloc, alloc.num_cached)
        if self.prefix_caching:
            self._count_hits(alloc, len(tokens), alloc.num_cached)
        return alloc

    def _adopt(self, tokens: Sequence[int], hashes: list[int], max_reuse: int,
               reserve_tokens: int, extra_blocks: int) -> SeqAlloc | None:
        """With split KV: open on the seq id of a holder whose cached chain the prompt continues
        (the next turn of a conversation), where its cells already are, instead of copying its
        stream to another seq id (a stream is copied whole: 600 MB for a 32,768-cell Gemma 3
        270M stream). SeqIds.adoptable says when, and which tail of the holder's goes."""
        if self.share_cells or not self.prefix_caching:
            return None
        hit = self.pool.match(hashes, tokens, 0, max_reuse)
        tail = self.ids.adoptable(hit)
        if tail is None or not self.pool.fits(hit, reserve_tokens, extra_blocks):
            return None
        holder = hit[-1].holder
        self.link.forget(holder)         # it goes on: saved with what follows when it ends
        for block in reversed(tail):     # leaves first: each is a leaf once its child is gone
            self.ids.evict(block)
        alloc = self.ids.open(holder)
        alloc.hashes = list(hashes)
        self._reference(alloc, hit)
        alloc.num_cached = len(hit) * self.block_size
        self._count_hits(alloc, len(tokens), alloc.num_cached)
        return alloc

    def _open_from_tier(self, seq_id: int, tokens: Sequence[int], hashes: list[int],
                        max_reuse: int, in_streams: int, reserve_tokens: int,
                        extra_blocks: int) -> SeqAlloc | None:
        """Open on seq_id from a snapshot that holds more of the prompt than the streams do
        (kvcache/tier_link.py), or None (then open goes on from the streams)."""
        found = self.link.find(hashes, tokens, max_reuse, in_streams)
        if found is None or not self.pool.fits([], reserve_tokens, extra_blocks):
            return None
        snap, n = found
        alloc = self.ids.open(seq_id)
        alloc.hashes = list(hashes)
        self.ensure(alloc, n)
        load = self.link.load_op(seq_id, snap, n)
        self._push(load)
        self.commit(alloc, tokens, n)
        alloc.num_cached, alloc.tier = n, load.tier
        self._count_hits(alloc, len(tokens), n)
        return alloc

    def unload(self, seq_ids: list[int]) -> set[int]:
        """Loads whose state the engine could not read (the snapshot's file gone or damaged
        since it was found): their blocks leave the prefix cache (SeqIds.unload) and what the
        sequences that held them counted is taken back. Returns those sequences' seq ids,
        theirs among them: to be freed (without a snapshot) and opened again."""
        victims = self.ids.unload(seq_ids)
        for seq_id in victims:
            alloc = self.ids.allocs[seq_id]
            self.query_tokens -= alloc.query_tokens
            self.hit_tokens -= alloc.hit_tokens
        return victims

    def open_for_restore(self, key: int, tokens: Sequence[int], reserve_tokens: int, *,
                         extra_blocks: int = 0) -> SeqAlloc | None:
        """A sequence for the state saved under `key` (the KV of `tokens`), on the same terms as
        open: the state is loaded into its seq id and its full blocks go to the prefix cache."""
        seq_id = self.ids.acquire()
        if seq_id is None:
            return None
        alloc = self._reserve(seq_id, [], reserve_tokens, extra_blocks)
        if alloc is None:
            return None
        self.ensure(alloc, len(tokens))
        self._push(RestoreOp(key, seq_id))
        self.commit(alloc, tokens, len(tokens))
        return alloc

    def fork(self, parent: SeqAlloc, tokens: Sequence[int], n_tokens: int,
             reserve_tokens: int) -> SeqAlloc | None:
        """A new sequence holding a copy of the first n_tokens positions of a live one (n > 1:
        the other choices start from the first's computed prompt), if blocks for reserve_tokens
        and a seq id are free. The parent's leading cached blocks are shared (referenced, counted
        once, as a prefix hit is); the rest gets blocks of its own. One CopyOp moves the cells:
        zero-copy in a unified cache, a stream copy with split KV."""
        seq_id = self.ids.acquire()
        if seq_id is None:
            return None
        n_full = n_tokens // self.block_size
        shared = []
        for block in parent.blocks[:n_full]:
            if block.hash is None:
                break
            shared.append(block)
        alloc = self._reserve(seq_id, shared, reserve_tokens, 0)
        if alloc is None:
            return None
        alloc.hashes = list(parent.hashes[:n_full])
        self._reference(alloc, shared)
        self.ensure(alloc, n_tokens)
        self._emit(CopyOp(parent.seq_id, seq_id, 0, n_tokens))
        alloc.num_checked = len(shared)
        self.commit(alloc, tokens, n_tokens)
        return alloc

    def _reserve(self, seq_id: int, hit: list[Block], reserve_tokens: int,
                 extra_blocks: int) -> SeqAlloc | None:
        """A live sequence on seq_id if its blocks fit (BlockPool.fits); otherwise seq_id goes
        back."""
        if not self.pool.fits(hit, reserve_tokens, extra_blocks):
            self.ids.release(seq_id, had_cells=False)
            return None
        return self.ids.open(seq_id)

    def extend(self, alloc: SeqAlloc, tokens: Sequence[int], num_computed: int,
               max_reuse: int) -> int:
        """Share cached blocks that continue a sequence computed up to num_computed (blocks
        another sequence computed since this one opened). Returns the number of tokens gained."""
        start = len(alloc.blocks)
        if (not self.prefix_caching or start * self.block_size != num_computed
                or (start and alloc.blocks[-1].hash is None)):   # the table's chain ended
            return 0
        hit = self.pool.match(alloc.hashes, tokens, start, max_reuse)
        self._share(alloc, hit)
        gained = len(hit) * self.block_size
        self._count_hits(alloc, 0, gained)
        return gained

    def _share(self, alloc: SeqAlloc, hit: list[Block], part: Block | None = None,
               k: int = 0) -> None:
        if not hit and part is None:
            return
        p0 = len(alloc.blocks) * self.block_size
        self._reference(alloc, hit)
        p1 = len(alloc.blocks) * self.block_size
        src = hit[-1].holder if part is None else part.holder
        self._emit(CopyOp(src, alloc.seq_id, p0, p1 + k))

    def _reference(self, alloc: SeqAlloc, blocks: list[Block]) -> None:
        """Cached blocks join the end of a sequence's table."""
        for block in blocks:
            self.pool.ref(block)
        alloc.blocks += blocks

    def free(self, alloc: SeqAlloc, snapshot: bool = True) -> None:
        """Close a sequence. Cached blocks stay (LRU evictable, tail first); the rest is freed.
        With a tier, a long enough cached chain is saved to it (`snapshot`; not for a sequence
        preempted to come back)."""
        seq_id = alloc.seq_id
        self.ids.close(seq_id)
        # A holder keeps its cells up to the end of the last block it owns: blocks after it
        # (shared from another owner, or not cached) are removed from it.
        owned = [b for b in alloc.blocks if b.owner == seq_id and b.hash is not None]
        n_keep = owned[-1].index + 1 if owned else 0
        chain = alloc.blocks[:n_keep]
        for block in reversed(alloc.blocks):
            self.pool.unref(block)
        alloc.blocks = []
        if seq_id not in self.ids.owned:
            self.ids.release(seq_id)
            return
        holder = self.ids.keep(seq_id, n_keep * self.block_size, owned)
        if snapshot:
            self.link.hold(holder, chain)

    def take_snapshots(self, limit: int | None = None) -> list[KVOp]:
        """The ops so far, then a SnapshotOp for each holder not yet saved, `limit` of them at
        most (the engine calls this while it has nothing else to do, and before it stops)."""
        self.link.take(limit)
        return self.take_ops()

    # ---- swapping sequence state to RAM -------------------------------------------------------
    def save(self, alloc: SeqAlloc) -> int:
        """Have the engine save the sequence's state to RAM (before the ops that follow, such as
        free's). Returns the key to open_for_restore or drop_saved it by."""
        key = next(self._save_keys)
        self._push(SaveOp(alloc.seq_id, key))
        return key

    def drop_saved(self, key: int) -> None:
        """Forget the state saved under key (its sequence ended while swapped out)."""
        self._push(DropSavedOp(key))

    # ---- growing ------------------------------------------------------------------------------
    def ensure(self, alloc: SeqAlloc, n_tokens: int) -> bool:
        """Make the block table cover n_tokens positions. All or nothing."""
        need = self.blocks_for(n_tokens) - len(alloc.blocks)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            if not self.pool.free_list:
                self.ids.evict_oldest()
            alloc.blocks.append(self.pool.take_free(len(alloc.blocks)))
        return True

    def rollback(self, alloc: SeqAlloc, n_tokens: int) -> None:
        """The sequence keeps the KV of its first n_tokens positions only (drafted tokens the
        model rejected leave it): a RemoveOp of the rest, and the blocks past the last one
        those positions need go back to the free list. Those blocks are the sequence's own and
        uncached: only verified tokens are ever committed."""
        assert n_tokens >= alloc.num_checked * self.block_size, "verified tokens stay"
        self._emit(RemoveOp(alloc.seq_id, n_tokens))
        keep = self.blocks_for(n_tokens)
        for block in alloc.blocks[keep:]:
            assert block.hash is None and block.ref_count == 1, "a drafted block was shared"
            self.pool.unref(block)
        del alloc.blocks[keep:]

    def commit(self, alloc: SeqAlloc, tokens: Sequence[int], num_computed: int) -> None:
        """Register in the prefix cache the blocks that the first num_computed tokens fill."""
        if not self.prefix_caching:
            return
        n_full = num_computed // self.block_size
        self._hash_up_to(alloc, tokens, n_full)
        for i in range(alloc.num_checked, n_full):
            alloc.num_checked = i
            if not self._commit_block(alloc, tokens, i):
                return
        alloc.num_checked = max(alloc.num_checked, n_full)

    def _hash_up_to(self, alloc: SeqAlloc, tokens: Sequence[int], n_full: int) -> None:
        """Extend alloc.hashes to cover its first n_full blocks."""
        if len(alloc.hashes) < n_full:
            bs = self.block_size
            parent = alloc.hashes[-1] if alloc.hashes else NO_PARENT
            alloc.hashes += block_hashes(tokens[:n_full * bs], bs, parent, len(alloc.hashes) * bs)

    def _commit_block(self, alloc: SeqAlloc, tokens: Sequence[int], i: int) -> bool:
        """Register block i of a sequence. False when no block after it can be registered."""
        if alloc.blocks[i].hash is not None:
            return True                      # shared from the cache, or registered already
        block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
        twin = self.cache.get(alloc.hashes[i])
        if twin is not None:
            return self._meet_twin(alloc, i, twin, block_tokens)
        parent = self.cache.get(alloc.hashes[i - 1]) if i else None
        if i and parent is None:
            return False    # the chain above was evicted meanwhile: nothing after it can be found
        self.pool.register(alloc.blocks[i], alloc.hashes[i], block_tokens, alloc.seq_id, i,
                           parent)
        self.ids.own(alloc.seq_id)
        return True

    def _meet_twin(self, alloc: SeqAlloc, i: int, twin: Block, block_tokens: tuple) -> bool:
        """Block i was computed twice at once (or restored over its cached copy): swap it for the
        cached twin, so that the blocks registered after it hang below a block this sequence
        references (a twin it did not reference could be released while they are not). A
        unified cache shares the twin's cells; a split KV stream keeps its own copy of them."""
        if twin.tokens != block_tokens:
            return False    # a hash collision: leave the rest of this sequence uncached
        if self.share_cells:
            p0, p1 = i * self.block_size, (i + 1) * self.block_size
            self._emit(RemoveOp(alloc.seq_id, p0, p1))
            self._emit(CopyOp(twin.holder, alloc.seq_id, p0, p1))
        self.pool.ref(twin)
        block, alloc.blocks[i] = alloc.blocks[i], twin
        self.pool.release(block)
        return True

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        """Each part's invariants (kvcache/pool.py, seq_ids.py, tier_link.py)."""
        self.pool.check_invariants()
        self.ids.check_invariants()
        self.link.check_invariants(self.ids.holders)
