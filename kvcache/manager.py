"""BlockManager: paged bookkeeping over one llama.cpp context's KV cells.

Blocks are units of budget (block_size cells). A live sequence holds a llama.cpp seq id and a
block table. With prefix caching on, every full block a sequence computes is registered under its
chain hash, owned by that sequence's seq id. When the sequence ends, the seq id stays alive as a
*holder* of the cells of the cached blocks it owns (its uncached tail is removed), until LRU
eviction removes them: a holder's cells cover [0, end of its last owned block), because cached
blocks form chains and a chain's ancestors are evicted only after its descendants (leaves first);
evicting a holder's block trims its cells back to the end of the nearest ancestor it owns, since
the blocks between (shared from another seq id, or twins swapped for its own) are not its to keep.
Eviction takes the least recently released leaf from a LeafQueue kept in that order as blocks are
released, referenced again and gain or lose cached children: O(1) amortised.

A new sequence whose prompt starts with cached blocks gets them by CopyOp (llama_memory_seq_cp
from the owner of the last matched block, which holds the whole chain): zero-copy in a unified
KV cache, a stream copy with split KV (share_cells=False). With split KV a finished sequence
moves its cached blocks to the highest free seq id, so running sequences keep low, contiguous
ids (llama.cpp batches only consecutive seq ids of split streams into one ubatch). A hit may end
on any token: the engine's kernels compute the same numbers for any cut of a prompt into pieces
of 2 or more tokens (docs/prefix-cache.md, "Exact answers"), and the scheduler keeps the rest of
the prompt at 2 tokens or more unless a cold run computes its last token alone too. Past its
last matched block, the cached block that continues it with the most of the prompt's next tokens
lends those cells (one copy from its owner, which holds the whole chain), so a prompt reuses
what it shares to the token, as llama-server's slots do (a chat template's head rarely ends on a
block boundary).

A live sequence's block table is one cached chain (each cached block's parent is the block before
it) followed by uncached blocks. A block computed twice at once, or restored over its own cached
copy after a swap, is swapped for the cached twin, with split KV too (there the sequence's own
stream already holds the same values, so no KV op is needed; the shared block is counted once, as
a prefix hit is). Keeping the table one chain keeps this invariant: every cached ancestor of a
referenced block is referenced, so an evictable block has only evictable descendants and can be
evicted now (leaves first). That makes `num_free_blocks` (free + evictable) exactly what `ensure`
can deliver, and `open`/`ensure` all or nothing.

Beyond the KV streams (kvcache/tiers.py, with a `Space`): a sequence that ends holding at least
the space's `min_tokens` cached tokens not yet saved is saved as a snapshot (SnapshotOp) once
its holder's cells hold exactly its cached chain, not on the step it ended in: copying a state
takes a while (0.2 s for 3,000 SmolLM2 tokens in a busy server), so it waits until the engine
has nothing else to do (take_snapshots) or until an op would change the holder's cells (_emit
saves it first); a new sequence whose prompt a snapshot holds further
than the streams do, by enough to pay for loading it, gets it (LoadOp into its own seq id, cut to
whole blocks within max_reuse), and its blocks join the prefix cache as if computed.

Invariant: cells llama.cpp uses <= cells of the blocks counted as used here.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from kvcache.blocks import (
    NO_PARENT,
    Block,
    CopyOp,
    DropSavedOp,
    KVOp,
    LoadOp,
    RemoveOp,
    RestoreOp,
    SaveOp,
    SeqAlloc,
    SnapshotOp,
    block_hashes,
)
from kvcache.leaves import LeafQueue
from kvcache.tiers import Space

# A snapshot is loaded when it brings at least this many blocks more than the streams hold, and
# at least 1/LOAD_RATIO of its own size: loading moves every byte of it (a few GB/s), computing
# costs milliseconds a token.
LOAD_MIN_BLOCKS = 4
LOAD_RATIO = 256
# With split KV, a prompt that continues a finished sequence's chain but for a tail of it runs on
# that sequence's seq id and drops the tail, rather than copying the whole stream, when the tail
# holds fewer tokens than the stream's cells / TAIL_CELLS_PER_TOKEN: a stream copy moves about
# 5 us a cell (2-core VM, Gemma 3 270M: 0.15 s for 32,768 cells), computing a token again costs
# 1-3 ms, so a dropped token is worth some 256 copied cells.
TAIL_CELLS_PER_TOKEN = 256


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
        self.prefix_caching = prefix_caching
        self.share_cells = share_cells
        self.stream_cells = stream_cells   # cells of one KV stream (split KV; see _adopt)
        self.tiers = tiers if prefix_caching else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_list: deque[Block] = deque(self.blocks)          # unreferenced, uncached
        self.evictable: dict[int, Block] = {}   # unreferenced, cached; in release order
        self.leaves = LeafQueue()               # the evictable ones without cached children
        self._clock = itertools.count(1)        # Block.last_used
        self.cache: dict[int, Block] = {}                      # chain hash -> block
        # parent's chain hash (NO_PARENT for a first block) -> its cached children: where a hit
        # that ends inside a block finds the block that continues it
        self.children: dict[int, set[Block]] = {}
        self.free_seq_ids = list(range(num_seq_ids))
        self.num_seq_ids = num_seq_ids
        self.owned: dict[int, int] = {}   # seq id -> number of cached blocks it owns
        self.live: set[int] = set()       # seq ids of open sequences
        self.allocs: dict[int, SeqAlloc] = {}   # seq id -> its open sequence
        self._ops: list[KVOp] = []          # for the engine, in order; read through take_ops()
        self.unsaved: dict[int, tuple[int, ...]] = {}   # holder -> its chain's tokens, to save
        self._save_keys = itertools.count()
        self.query_tokens = self.hit_tokens = 0

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

    def take_ops(self) -> list[KVOp]:
        ops, self._ops = self._ops, []
        return ops

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, self.block_size)

    # ---- opening and closing sequences ---------------------------------------------------------
    def can_open(self) -> bool:
        return bool(self.free_seq_ids) or bool(self.owned.keys() - self.live)

    def open(self, tokens: Sequence[int], max_reuse: int, reserve_tokens: int, *,
             hashes: list[int] | None = None, extra_blocks: int = 0) -> SeqAlloc | None:
        """A sequence for `tokens` that reuses up to `max_reuse` cached tokens, if blocks for
        `reserve_tokens` (+ extra_blocks already promised elsewhere) fit and a seq id is free."""
        hashes = hashes if hashes is not None else self.hashes(tokens)
        adopted = self._adopt(tokens, hashes, max_reuse, reserve_tokens, extra_blocks)
        if adopted is not None:
            return adopted
        seq_id = self._acquire_seq_id()
        if seq_id is None:
            return None
        hit = self._match(hashes, tokens, 0, max_reuse)
        part, k = self._partial(hit, tokens, max_reuse)
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
            self._ref(part)      # of its own now; a use: the lent block goes to the back of
            self._unref(part)    # the eviction order
            self.ensure(alloc, alloc.num_cached)
        if self.prefix_caching:
            self.query_tokens += len(tokens)
            self.hit_tokens += alloc.num_cached
        return alloc

    def _adopt(self, tokens: Sequence[int], hashes: list[int], max_reuse: int,
               reserve_tokens: int, extra_blocks: int) -> SeqAlloc | None:
        """With split KV: open on the seq id of a holder whose cached chain the prompt continues
        (the next turn of a conversation), where its cells already are, instead of copying its
        stream to another seq id (a stream is copied whole: 600 MB for a 32,768-cell Gemma 3
        270M stream). Every block the holder owns must be in the hit, so that no cached block's
        cells are overwritten, except a short tail past the hit: the end of the last answer,
        which the history renders to other tokens (an answer cut at its limit, a stop string),
        or whose last block is partial. That tail is evicted when dropping it costs less than
        the copy (`TAIL_CELLS_PER_TOKEN`); otherwise the copy path keeps it."""
        if self.share_cells or not self.prefix_caching:
            return None
        hit = self._match(hashes, tokens, 0, max_reuse)
        holder = hit[-1].owner if hit else None
        if holder is None or holder in self.live:
            return None
        tail = self._tail(hit[-1], holder)
        if (tail is None or sum(1 for b in hit if b.owner == holder) + len(tail)
                != self.owned.get(holder)
                or len(tail) * self.block_size * TAIL_CELLS_PER_TOKEN > self.stream_cells):
            return None
        ids = sorted(self.live | {holder})   # live ids stay consecutive (see _acquire_seq_id)
        if ids[-1] - ids[0] != len(ids) - 1:
            return None
        hit_evictable = sum(1 for b in hit if b.ref_count == 0)
        if (self.blocks_for(reserve_tokens) - len(hit) + extra_blocks
                > self.num_free_blocks - hit_evictable):
            return None
        self.unsaved.pop(holder, None)   # it goes on: saved with what follows when it ends
        for block in reversed(tail):     # leaves first: each is a leaf once its child is gone
            self.leaves.discard(block)
            self._evict(block)
        self.live.add(holder)
        alloc = self.allocs[holder] = SeqAlloc(holder, hashes=list(hashes))
        for block in hit:
            self._ref(block)
            alloc.blocks.append(block)
        alloc.num_cached = len(hit) * self.block_size
        self.query_tokens += len(tokens)
        self.hit_tokens += alloc.num_cached
        return alloc

    def _tail(self, last: Block, holder: int) -> list[Block] | None:
        """The cached blocks the holder owns past `last`, in chain order, when they are one
        unreferenced chain that nothing else continues (so each can be evicted now); None
        otherwise."""
        tail: list[Block] = []
        block = last
        while True:
            kids = self.children.get(block.key, ())
            own = [b for b in kids if b.owner == holder]
            if not own:
                return None if tail and kids else tail
            if len(own) != 1 or (tail and len(kids) != 1):
                return None
            block = own[0]
            if block.ref_count:
                return None
            tail.append(block)

    def _open_from_tier(self, seq_id: int, tokens: Sequence[int], hashes: list[int],
                        max_reuse: int, in_streams: int, reserve_tokens: int,
                        extra_blocks: int) -> SeqAlloc | None:
        """Open on seq_id from a snapshot that holds more of the prompt than the streams do
        (module doc), or None (then open goes on from the streams)."""
        if self.tiers is None or len(tokens) < self.tiers.min_tokens:
            return None
        found = self.tiers.find(hashes, tokens, max_reuse)
        if found is None:
            self.tiers.miss()
            return None
        snap, n = found
        gain = n - in_streams
        if gain < LOAD_MIN_BLOCKS * self.block_size or gain * LOAD_RATIO < snap.n_tokens:
            return None
        if self.blocks_for(reserve_tokens) + extra_blocks > self.num_free_blocks:
            return None
        restore = self.tiers.fetch(snap, n)
        if restore is None:
            return None
        alloc = self._reserve(seq_id, [], reserve_tokens, extra_blocks)
        assert alloc is not None, "checked above"
        alloc.hashes = list(hashes)
        self.ensure(alloc, n)
        self._ops.append(LoadOp(seq_id, restore.data, n, restore.tier))
        self.commit(alloc, tokens, n)
        alloc.num_cached, alloc.tier = n, restore.tier
        self.query_tokens += len(tokens)
        self.hit_tokens += n
        return alloc

    def open_for_restore(self, key: int, tokens: Sequence[int], reserve_tokens: int, *,
                         extra_blocks: int = 0) -> SeqAlloc | None:
        """A sequence for the state saved under `key` (the KV of `tokens`), on the same terms as
        open: the state is loaded into its seq id and its full blocks go to the prefix cache."""
        seq_id = self._acquire_seq_id()
        if seq_id is None:
            return None
        alloc = self._reserve(seq_id, [], reserve_tokens, extra_blocks)
        if alloc is None:
            return None
        self.ensure(alloc, len(tokens))
        self._ops.append(RestoreOp(key, seq_id))
        self.commit(alloc, tokens, len(tokens))
        return alloc

    def fork(self, parent: SeqAlloc, tokens: Sequence[int], n_tokens: int,
             reserve_tokens: int) -> SeqAlloc | None:
        """A new sequence holding a copy of the first n_tokens positions of a live one (n > 1:
        the other choices start from the first's computed prompt), if blocks for reserve_tokens
        and a seq id are free. The parent's leading cached blocks are shared (referenced, counted
        once, as a prefix hit is); the rest gets blocks of its own. One CopyOp moves the cells:
        zero-copy in a unified cache, a stream copy with split KV."""
        seq_id = self._acquire_seq_id()
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
        for block in shared:
            self._ref(block)
            alloc.blocks.append(block)
        self.ensure(alloc, n_tokens)
        self._emit(CopyOp(parent.seq_id, seq_id, 0, n_tokens))
        alloc.num_checked = len(shared)
        self.commit(alloc, tokens, n_tokens)
        return alloc

    def fork_blocks(self, n_tokens: int) -> int:
        """Blocks a fork of an n_tokens prompt takes: its full blocks are the parent's, cached
        (unless prefix caching is off); the rest, and room for one more token, are its own."""
        shared = n_tokens // self.block_size if self.prefix_caching else 0
        return self.blocks_for(n_tokens + 1) - shared

    def _reserve(self, seq_id: int, hit: list[Block], reserve_tokens: int,
                 extra_blocks: int) -> SeqAlloc | None:
        """A live sequence on seq_id if blocks for reserve_tokens (less the cached hit, plus
        extra_blocks) fit; otherwise seq_id goes back to the pool."""
        hit_evictable = sum(1 for b in hit if b.ref_count == 0)
        need = self.blocks_for(reserve_tokens) - len(hit) + extra_blocks
        if need > self.num_free_blocks - hit_evictable:
            self._release_seq_id(seq_id, had_cells=False)
            return None
        self.live.add(seq_id)
        alloc = self.allocs[seq_id] = SeqAlloc(seq_id)
        return alloc

    def extend(self, alloc: SeqAlloc, tokens: Sequence[int], num_computed: int,
               max_reuse: int) -> int:
        """Share cached blocks that continue a sequence computed up to num_computed (blocks
        another sequence computed since this one opened). Returns the number of tokens gained."""
        start = len(alloc.blocks)
        if (not self.prefix_caching or start * self.block_size != num_computed
                or (start and alloc.blocks[-1].hash is None)):   # the table's chain ended
            return 0
        hit = self._match(alloc.hashes, tokens, start, max_reuse)
        self._share(alloc, hit)
        gained = len(hit) * self.block_size
        self.hit_tokens += gained
        return gained

    def free(self, alloc: SeqAlloc, snapshot: bool = True) -> None:
        """Close a sequence. Cached blocks stay (LRU evictable, tail first); the rest is freed.
        With a tier, a long enough cached chain is saved to it (`snapshot`; not for a sequence
        preempted to come back)."""
        seq_id = alloc.seq_id
        self.live.discard(seq_id)
        self.allocs.pop(seq_id, None)
        # A holder keeps its cells up to the end of the last block it owns: blocks after it
        # (shared from another owner, or not cached) are removed from it.
        owned = [b for b in alloc.blocks if b.owner == seq_id and b.hash is not None]
        n_keep = owned[-1].index + 1 if owned else 0
        chain = alloc.blocks[:n_keep]
        for block in reversed(alloc.blocks):
            self._unref(block)
        alloc.blocks = []
        if seq_id not in self.owned:
            self._release_seq_id(seq_id)
            return
        n_cells = n_keep * self.block_size
        if not self.share_cells and self.free_seq_ids and max(self.free_seq_ids) > seq_id:
            seq_id = max(self.free_seq_ids)
            self._move_holder(alloc.seq_id, seq_id, n_cells, owned)
        else:
            self._emit(RemoveOp(seq_id, n_cells))
        if snapshot and self._worth_saving([b.key for b in chain]):
            self.unsaved[seq_id] = tuple(t for b in chain for t in b.tokens)

    def _worth_saving(self, hashes: list[int]) -> bool:
        """Whether a holder's cached chain goes to the tiers: long enough, and not held by a
        snapshot already."""
        tiers = self.tiers
        return (tiers is not None and len(hashes) * self.block_size >= tiers.min_tokens
                and not tiers.covers(hashes))

    def take_snapshots(self, limit: int | None = None) -> list[KVOp]:
        """The ops so far, then a SnapshotOp for each holder not yet saved, `limit` of them at
        most (the engine calls this while it has nothing else to do, and before it stops)."""
        for seq_id in list(self.unsaved)[:limit]:
            self._save_holder(seq_id)
        return self.take_ops()

    def _save_holder(self, seq_id: int) -> None:
        tokens = self.unsaved.pop(seq_id)
        if self._worth_saving(block_hashes(tokens, self.block_size)):
            self._ops.append(SnapshotOp(seq_id, tokens))

    def _emit(self, op: KVOp) -> None:
        """Queue an op for the engine; a holder not yet saved is saved first if the op would
        change its cells (module doc)."""
        if isinstance(op, RemoveOp):
            tokens = self.unsaved.get(op.seq)
            if tokens is not None and op.p0 < len(tokens):
                self._save_holder(op.seq)
        elif isinstance(op, CopyOp) and op.dst in self.unsaved:
            self._save_holder(op.dst)
        self._ops.append(op)

    def _move_holder(self, src: int, dst: int, n_tokens: int, owned: list[Block]) -> None:
        """Hand the cached blocks src owns, and its cells [0, n_tokens), to seq id dst."""
        self.free_seq_ids.remove(dst)
        heapq.heapify(self.free_seq_ids)
        self._emit(CopyOp(src, dst, 0, n_tokens))
        for block in owned:
            block.owner = dst
        self.owned[dst] = self.owned.pop(src)
        if src in self.unsaved:   # saved from its new seq id (the engine settles the copy first)
            self.unsaved[dst] = self.unsaved.pop(src)
        self._release_seq_id(src)

    # ---- swapping sequence state to RAM -------------------------------------------------------
    def save(self, alloc: SeqAlloc) -> int:
        """Have the engine save the sequence's state to RAM (before the ops that follow, such as
        free's). Returns the key to open_for_restore or drop_saved it by."""
        key = next(self._save_keys)
        self._ops.append(SaveOp(alloc.seq_id, key))
        return key

    def drop_saved(self, key: int) -> None:
        """Forget the state saved under key (its sequence ended while swapped out)."""
        self._ops.append(DropSavedOp(key))

    # ---- growing ------------------------------------------------------------------------------
    def ensure(self, alloc: SeqAlloc, n_tokens: int) -> bool:
        """Make the block table cover n_tokens positions. All or nothing."""
        need = self.blocks_for(n_tokens) - len(alloc.blocks)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self._take_free_block()
            block.ref_count, block.index = 1, len(alloc.blocks)
            alloc.blocks.append(block)
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
            self._unref(block)
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
        self._register(alloc, i, block_tokens, parent)
        return True

    def _meet_twin(self, alloc: SeqAlloc, i: int, twin: Block, block_tokens: tuple) -> bool:
        """Block i was computed twice at once (or restored over its cached copy): swap it for the
        cached twin, so that the blocks registered after it hang below a block this sequence
        references (a twin it did not reference could be released while they are not)."""
        if twin.tokens != block_tokens:
            return False    # a hash collision: leave the rest of this sequence uncached
        self._swap_for_twin(alloc, i, twin)
        return True

    def _swap_for_twin(self, alloc: SeqAlloc, i: int, twin: Block) -> None:
        """A unified cache shares the twin's cells; a split KV stream keeps its own copy of them."""
        if self.share_cells:
            p0, p1 = i * self.block_size, (i + 1) * self.block_size
            self._emit(RemoveOp(alloc.seq_id, p0, p1))
            self._emit(CopyOp(twin.holder, alloc.seq_id, p0, p1))
        self._ref(twin)
        block, alloc.blocks[i] = alloc.blocks[i], twin
        block.reset()
        self.free_list.append(block)

    def _register(self, alloc: SeqAlloc, i: int, block_tokens: tuple,
                  parent: Block | None) -> None:
        """Put block i of a sequence in the cache, owned by its seq id, below parent."""
        block, h = alloc.blocks[i], alloc.hashes[i]
        block.hash, block.tokens, block.owner, block.index = h, block_tokens, alloc.seq_id, i
        block.parent = parent
        if parent is not None:
            parent.n_children += 1
            self.leaves.discard(parent)
        self.cache[h] = block
        self.children.setdefault(block.parent_key, set()).add(block)
        self.owned[alloc.seq_id] = self.owned.get(alloc.seq_id, 0) + 1

    def lookup(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache holds (no side effects)."""
        return len(self._match(self.hashes(tokens), tokens, 0, len(tokens))) * self.block_size

    # ---- internals ----------------------------------------------------------------------------
    def _match(self, hashes: list[int], tokens: Sequence[int], start: int,
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

    def _partial(self, hit: list[Block], tokens: Sequence[int],
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

    def _share(self, alloc: SeqAlloc, hit: list[Block], part: Block | None = None,
               k: int = 0) -> None:
        if not hit and part is None:
            return
        p0 = len(alloc.blocks) * self.block_size
        for block in hit:
            self._ref(block)
            alloc.blocks.append(block)
        p1 = len(alloc.blocks) * self.block_size
        src = hit[-1].holder if part is None else part.holder
        self._emit(CopyOp(src, alloc.seq_id, p0, p1 + k))

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.evictable[block.id]
            self.leaves.discard(block)
        block.ref_count += 1

    def _unref(self, block: Block) -> None:
        """Drop one reference: a cached block becomes evictable, an uncached one free."""
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is None:
            block.reset()
            self.free_list.append(block)
            return
        block.last_used = next(self._clock)
        self.evictable[block.id] = block
        if block.n_children == 0:
            self.leaves.add(block)

    def _take_free_block(self) -> Block:
        if not self.free_list:
            self._evict_one()
        return self.free_list.popleft()

    def _evict_one(self) -> bool:
        """Evict the least recently used cached leaf block. False if nothing is evictable."""
        leaf = self.leaves.pop_oldest()
        if leaf is None:
            return False
        self._evict(leaf)
        return True

    def _evict(self, leaf: Block) -> None:
        del self.evictable[leaf.id]
        del self.cache[leaf.key]
        owner, bs = leaf.holder, self.block_size
        self._emit(RemoveOp(owner, self._kept_cells(leaf), (leaf.index + 1) * bs))
        parent = leaf.parent
        key = leaf.parent_key
        siblings = self.children[key]
        siblings.discard(leaf)
        if not siblings:
            del self.children[key]
        if parent is not None:
            parent.n_children -= 1
            if parent.n_children == 0 and parent.ref_count == 0:
                self.leaves.add(parent)
        self.owned[owner] -= 1
        if self.owned[owner] == 0:
            del self.owned[owner]
            if owner not in self.live:
                self._release_seq_id(owner)
        leaf.reset()
        self.free_list.append(leaf)

    def _kept_cells(self, leaf: Block) -> int:
        """Where the owner's cells end once leaf is evicted: after the nearest ancestor it owns
        too. Blocks between them are another seq id's (shared from it, or a twin swapped for
        it), and their cells in this one would outlive their eviction."""
        if self.owned[leaf.holder] == 1 and leaf.holder not in self.live:
            return 0                    # its last block: the seq id is released, cells and all
        block = leaf.parent
        while block is not None and block.owner != leaf.owner:
            block = block.parent
        return 0 if block is None else (block.index + 1) * self.block_size

    def _acquire_seq_id(self) -> int | None:
        rehome = True
        while not self.free_seq_ids:
            if rehome and self._rehome_one():
                continue
            leaf = self.leaves.pop_oldest() if self.owned.keys() - self.live else None
            if leaf is None:
                return None
            parent = leaf.parent
            self._evict(leaf)
            # a holder may be rehomed once its deepest block is another seq id's ancestor
            rehome = parent is not None and parent.n_children > 0
        seq_id = heapq.heappop(self.free_seq_ids)
        if self.share_cells:
            return seq_id
        gap = next(i for i in itertools.count() if i not in self.live)
        if gap < seq_id and gap in self.owned:
            # Split KV: the lowest id not live holds cached blocks (its sequence ended when no
            # higher id was free). Move that holder to the free id and run the new sequence on
            # the gap, so live ids stay contiguous: llama.cpp puts only consecutive seq ids of
            # split streams in one micro-batch, and a decode step over ids {0, 1, 2, 30} is two
            # graph computations, each streaming the weights.
            owned = [b for b in self.blocks if b.owner == gap and b.hash is not None]
            if not owned:
                return seq_id
            heapq.heappush(self.free_seq_ids, seq_id)
            self._move_holder(gap, seq_id, (max(b.index for b in owned) + 1) * self.block_size,
                              owned)
            self.free_seq_ids.remove(gap)
            heapq.heapify(self.free_seq_ids)
            return gap
        return seq_id

    def _rehome_one(self) -> bool:
        """Free a holder's seq id without losing a cached block: a holder (its sequence ended)
        whose cached blocks are all in the table of an open sequence, or all ancestors of a
        cached block another seq id holds, hands them to that seq id. Its cells hold every block
        of its chain (copied from the owner, or computed by itself, or shared in a unified
        cache), so no KV op moves anything; the holder's cells are removed. Without this, a
        holder of a prefix that others continued would keep its seq id, and with no seq ids
        kept for the cache (cache_seqs 0) one fewer sequence could run, or a newer
        conversation that continued an older one's prefix would be evicted with it.
        True if one was freed."""
        holders = self.owned.keys() - self.live
        if not holders:
            return False
        by_holder: dict[int, list[Block]] = {}
        for block in self.cache.values():
            if block.owner in holders:
                by_holder.setdefault(block.owner, []).append(block)
        for holder in sorted(by_holder):
            blocks = by_holder[holder]
            heir = self._heir(holder, blocks)
            if heir is None:
                continue
            for block in blocks:
                block.owner = heir
            self.owned[heir] = self.owned.get(heir, 0) + self.owned.pop(holder)
            self._release_seq_id(holder)
            return True
        return False

    def _heir(self, holder: int, blocks: list[Block]) -> int | None:
        """A seq id whose cells hold all of a holder's blocks: an open sequence whose table
        holds its deepest block, or the holder of a cached child of that block (a chain runs
        through its ancestors). None while the holder keeps blocks nobody else has."""
        deepest = max(blocks, key=lambda b: b.index)
        for child in self.children.get(deepest.key, ()):
            if child.owner is not None and child.owner != holder:
                return child.owner
        if any(b.ref_count == 0 for b in blocks):
            return None
        return next((a.seq_id for a in self.allocs.values()
                     if deepest.index < len(a.blocks) and a.blocks[deepest.index] is deepest),
                    None)

    def _release_seq_id(self, seq_id: int, had_cells: bool = True) -> None:
        if had_cells:
            self._emit(RemoveOp(seq_id, 0))
        heapq.heappush(self.free_seq_ids, seq_id)

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for block in self.blocks:
            if block.ref_count:
                refs[block.id] = block.ref_count
        assert len(self.free_list) + len(self.evictable) + len(refs) == self.num_blocks
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
        owned: dict[int, int] = {}
        for block in self.cache.values():
            owned[block.holder] = owned.get(block.holder, 0) + 1
        assert owned == self.owned
        assert not (set(self.free_seq_ids) & (self.live | set(self.owned)))
        assert set(self.allocs) == self.live
        # an open sequence's cells hold what it owns: every block it owns is in its table
        assert all(self.allocs[b.holder].blocks[b.index] is b for b in self.cache.values()
                   if b.holder in self.allocs)
        assert len(set(self.free_seq_ids)) == len(self.free_seq_ids)
        assert set(self.unsaved) <= set(self.owned) - self.live, "only holders wait to be saved"
        assert len(self.free_seq_ids) + len(self.live | set(self.owned)) == self.num_seq_ids

    def _check_leaves(self) -> None:
        """The leaf queue holds exactly the evictable leaves, and its oldest is the first leaf
        in release order (what a scan of every evictable block would pick)."""
        self.leaves.check()
        leaves = [b for b in self.evictable.values() if b.n_children == 0]
        assert self.leaves.ids() == {b.id for b in leaves}
        assert all(a.last_used < b.last_used
                   for a, b in zip(self.evictable.values(), list(self.evictable.values())[1:]))
        assert self.leaves.oldest() is (leaves[0] if leaves else None)
