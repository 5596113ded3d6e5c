"""SeqIds: the prefix cache's blocks mapped onto llama.cpp sequence ids.

A live sequence runs on a seq id of its own. Every full block it computes is registered in the
prefix cache owned by that seq id. When the sequence ends, its seq id stays alive as a *holder*
of the cells of the cached blocks it owns (its uncached tail is removed), until LRU eviction
removes them: a holder's cells cover [0, end of its last owned block), because cached blocks
form chains and a chain's ancestors are evicted only after its descendants (leaves first);
evicting a holder's block trims its cells back to the end of the nearest ancestor it owns, since
the blocks between (shared from another seq id, or twins swapped for its own) are not its to
keep (`kept_cells`). A holder whose last block goes is released with its cells.

With split KV (share_cells False) live ids are kept low and contiguous: llama.cpp batches only
consecutive seq ids of split streams into one micro-batch. A finished sequence moves its cached
blocks to the highest free seq id (`keep`); a new one takes the lowest id not live, moving the
holder there away first (`acquire`); and the next turn of a conversation may run on the seq id
of the holder whose chain it continues, where its cells already are (`adoptable`). When seq ids
run out, a holder whose blocks another seq id's cells hold too hands them over (`rehome_one`)
before any cached block is evicted for its seq id.

Invariants (`check_invariants`): every seq id is free, live or a holder, exactly once; `owned`
counts the cached blocks each seq id owns; an open sequence owns only blocks of its own table.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from kvcache.blocks import Block, CopyOp, KVOp, RemoveOp, SeqAlloc
from kvcache.pool import BlockPool

# With split KV, a prompt that continues a finished sequence's chain but for a tail of it runs on
# that sequence's seq id and drops the tail, rather than copying the whole stream, when the tail
# holds fewer tokens than the stream's cells / TAIL_CELLS_PER_TOKEN: a stream copy moves about
# 5 us a cell (2-core VM, Gemma 3 270M: 0.15 s for 32,768 cells), computing a token again costs
# 1-3 ms, so a dropped token is worth some 256 copied cells.
TAIL_CELLS_PER_TOKEN = 256


class SeqIds:
    def __init__(self, pool: BlockPool, num_seq_ids: int, *, share_cells: bool,
                 stream_cells: int, emit: Callable[[KVOp], None],
                 moved: Callable[[int, int], None]):
        """`emit`: queue a KV op for the engine; `moved`: a holder moved from one seq id to
        another (the saving of its chain follows it)."""
        self.pool = pool
        self.num_seq_ids = num_seq_ids
        self.free_seq_ids = list(range(num_seq_ids))   # a heap
        self.owned: dict[int, int] = {}   # seq id -> number of cached blocks it owns
        self.live: set[int] = set()       # seq ids of open sequences
        self.allocs: dict[int, SeqAlloc] = {}   # seq id -> its open sequence
        self.share_cells = share_cells
        self.stream_cells = stream_cells   # cells of one KV stream (split KV; see adoptable)
        self._emit, self._moved = emit, moved

    @property
    def holders(self) -> set[int]:
        """Seq ids of ended sequences kept for the cached blocks they own."""
        return self.owned.keys() - self.live

    def open(self, seq_id: int) -> SeqAlloc:
        """A live sequence on seq_id."""
        self.live.add(seq_id)
        alloc = self.allocs[seq_id] = SeqAlloc(seq_id)
        return alloc

    def close(self, seq_id: int) -> None:
        self.live.discard(seq_id)
        self.allocs.pop(seq_id, None)

    def own(self, seq_id: int, n: int = 1) -> None:
        self.owned[seq_id] = self.owned.get(seq_id, 0) + n

    def disown(self, seq_id: int) -> None:
        """seq_id holds one cached block less; a holder left with none is released."""
        self.owned[seq_id] -= 1
        if self.owned[seq_id] == 0:
            del self.owned[seq_id]
            if seq_id not in self.live:
                self.release(seq_id)

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, leaf: Block) -> None:
        """Evict a cached leaf: its owner's cells are trimmed (`kept_cells`)."""
        owner, p1 = leaf.holder, (leaf.index + 1) * self.pool.block_size
        p0 = self.kept_cells(leaf)
        self.pool.evict(leaf)
        self._emit(RemoveOp(owner, p0, p1))
        self.disown(owner)

    def evict_oldest(self) -> bool:
        """Evict the least recently used cached leaf block. False if nothing is evictable."""
        leaf = self.pool.leaves.pop_oldest()
        if leaf is None:
            return False
        self.evict(leaf)
        return True

    def kept_cells(self, leaf: Block) -> int:
        """Where the owner's cells end once leaf is evicted: after the nearest ancestor it owns
        too. Blocks between them are another seq id's (shared from it, or a twin swapped for
        it), and their cells in this one would outlive their eviction."""
        if self.owned[leaf.holder] == 1 and leaf.holder not in self.live:
            return 0                    # its last block: the seq id is released, cells and all
        block = leaf.parent
        while block is not None and block.owner != leaf.owner:
            block = block.parent
        return 0 if block is None else (block.index + 1) * self.pool.block_size

    # ---- taking and giving back seq ids ---------------------------------------------------------
    def acquire(self) -> int | None:
        """A seq id for a new sequence: a free one, or one a holder gives up (rehomed, or
        evicted leaves first); None when every seq id is live."""
        rehome = True
        while not self.free_seq_ids:
            if rehome and self.rehome_one():
                continue
            leaf = self.pool.leaves.pop_oldest() if self.holders else None
            if leaf is None:
                return None
            parent = leaf.parent
            self.evict(leaf)
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
            owned = [b for b in self.pool.blocks if b.owner == gap and b.hash is not None]
            if not owned:
                return seq_id
            heapq.heappush(self.free_seq_ids, seq_id)
            self.move(gap, seq_id, (max(b.index for b in owned) + 1) * self.pool.block_size,
                      owned)
            self.free_seq_ids.remove(gap)
            heapq.heapify(self.free_seq_ids)
            return gap
        return seq_id

    def release(self, seq_id: int, had_cells: bool = True) -> None:
        if had_cells:
            self._emit(RemoveOp(seq_id, 0))
        heapq.heappush(self.free_seq_ids, seq_id)

    def keep(self, seq_id: int, n_cells: int, owned: list[Block]) -> int:
        """An ended sequence's seq id becomes the holder of the cached blocks it owns, cells
        [0, n_cells): with split KV it moves to the highest free seq id, if higher. Returns the
        holder's seq id."""
        if not self.share_cells and self.free_seq_ids and max(self.free_seq_ids) > seq_id:
            dst = max(self.free_seq_ids)
            self.move(seq_id, dst, n_cells, owned)
            return dst
        self._emit(RemoveOp(seq_id, n_cells))
        return seq_id

    def move(self, src: int, dst: int, n_tokens: int, owned: list[Block]) -> None:
        """Hand the cached blocks src owns, and its cells [0, n_tokens), to seq id dst."""
        self.free_seq_ids.remove(dst)
        heapq.heapify(self.free_seq_ids)
        self._emit(CopyOp(src, dst, 0, n_tokens))
        for block in owned:
            block.owner = dst
        self.owned[dst] = self.owned.pop(src)
        self._moved(src, dst)   # saved from its new seq id (the engine settles the copy first)
        self.release(src)

    def rehome_one(self) -> bool:
        """Free a holder's seq id without losing a cached block: a holder (its sequence ended)
        whose cached blocks are all in the table of an open sequence, or all ancestors of a
        cached block another seq id holds, hands them to that seq id. Its cells hold every block
        of its chain (copied from the owner, or computed by itself, or shared in a unified
        cache), so no KV op moves anything; the holder's cells are removed. Without this, a
        holder of a prefix that others continued would keep its seq id, and with no seq ids
        kept for the cache (cache_seqs 0) one fewer sequence could run, or a newer
        conversation that continued an older one's prefix would be evicted with it.
        True if one was freed."""
        holders = self.holders
        if not holders:
            return False
        by_holder: dict[int, list[Block]] = {}
        for block in self.pool.cache.values():
            if block.owner in holders:
                by_holder.setdefault(block.owner, []).append(block)
        for holder in sorted(by_holder):
            blocks = by_holder[holder]
            heir = self.heir(holder, blocks)
            if heir is None:
                continue
            for block in blocks:
                block.owner = heir
            self.own(heir, self.owned.pop(holder))
            self.release(holder)
            return True
        return False

    def heir(self, holder: int, blocks: list[Block]) -> int | None:
        """A seq id whose cells hold all of a holder's blocks: an open sequence whose table
        holds its deepest block, or the holder of a cached child of that block (a chain runs
        through its ancestors). None while the holder keeps blocks nobody else has."""
        deepest = max(blocks, key=lambda b: b.index)
        for child in self.pool.children.get(deepest.key, ()):
            if child.owner is not None and child.owner != holder:
                return child.owner
        if any(b.ref_count == 0 for b in blocks):
            return None
        return next((a.seq_id for a in self.allocs.values()
                     if deepest.index < len(a.blocks) and a.blocks[deepest.index] is deepest),
                    None)

    def unload(self, seq_ids: list[int]) -> set[int]:
        """Open sequences that loaded blocks whose KV never arrived (the engine could not read
        their state): those blocks, and every cached block below them, leave the prefix cache.
        Returns the seq ids of the open sequences whose tables hold such a block (sharing them
        since), theirs among them."""
        allocs = self.allocs
        roots = [b for s in seq_ids for b in allocs[s].blocks
                 if b.owner == s and b.hash is not None]
        gone = self.pool.subtree(roots)
        for block in gone:
            self.disown(self.pool.uncache(block))
        gone_ids = {b.id for b in gone}
        return set(seq_ids) | {a.seq_id for a in allocs.values()
                               if any(b.id in gone_ids for b in a.blocks)}

    # ---- the next turn on its holder's seq id (split KV) ----------------------------------------
    def adoptable(self, hit: list[Block]) -> list[Block] | None:
        """With split KV: the tail to evict if a prompt whose cached hit is `hit` may open on
        the seq id of the holder of its last block, or None. Every block the holder owns must be
        in the hit, so that no cached block's cells are overwritten, except a short tail past
        the hit: the end of the last answer, which the history renders to other tokens (an
        answer cut at its limit, a stop string), or whose last block is partial. That tail is
        evicted when dropping it costs less than copying the stream (`TAIL_CELLS_PER_TOKEN`);
        otherwise the copy path keeps it. Live ids must stay consecutive (`acquire`)."""
        holder = hit[-1].owner if hit else None
        if self.share_cells or holder is None or holder in self.live:
            return None
        tail = self.tail(hit[-1], holder)
        if (tail is None or sum(1 for b in hit if b.owner == holder) + len(tail)
                != self.owned.get(holder)
                or len(tail) * self.pool.block_size * TAIL_CELLS_PER_TOKEN > self.stream_cells):
            return None
        ids = sorted(self.live | {holder})
        return tail if ids[-1] - ids[0] == len(ids) - 1 else None

    def tail(self, last: Block, holder: int) -> list[Block] | None:
        """The cached blocks the holder owns past `last`, in chain order, when they are one
        unreferenced chain that nothing else continues (so each can be evicted now); None
        otherwise."""
        tail: list[Block] = []
        block = last
        while True:
            kids = self.pool.children.get(block.key, ())
            own = [b for b in kids if b.owner == holder]
            if not own:
                return None if tail and kids else tail
            if len(own) != 1 or (tail and len(kids) != 1):
                return None
            block = own[0]
            if block.ref_count:
                return None
            tail.append(block)

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        owned: dict[int, int] = {}
        for block in self.pool.cache.values():
            owned[block.holder] = owned.get(block.holder, 0) + 1
        assert owned == self.owned
        assert not (set(self.free_seq_ids) & (self.live | set(self.owned)))
        assert set(self.allocs) == self.live
        # an open sequence's cells hold what it owns: every block it owns is in its table
        assert all(self.allocs[b.holder].blocks[b.index] is b for b in self.pool.cache.values()
                   if b.holder in self.allocs)
        assert len(set(self.free_seq_ids)) == len(self.free_seq_ids)
        assert len(self.free_seq_ids) + len(self.live | set(self.owned)) == self.num_seq_ids
