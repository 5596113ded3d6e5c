"""TierLink: what the block manager asks of the prefix cache's RAM and disk tiers
(kvcache/snapshots/, a `Space`), and when.

Saving: a sequence that ends holding at least the space's `min_tokens` cached tokens not yet
saved is saved as a snapshot (SnapshotOp) once its holder's cells hold exactly its cached chain,
not on the step it ended in: copying a state takes a while (0.2 s for 3,000 SmolLM2 tokens in a
busy server), so it waits until the engine finds room for the copy (`take`: between two steps
within the step target, or with nothing else to do; scheduler/save_pacing.py) or until an op
would change the holder's cells (`save_before`: the manager runs every op it queues through it).

Loading: a new sequence whose prompt a snapshot holds further than the streams do, by enough to
pay for loading it (`find`), gets it (a LoadOp into its own seq id, cut to whole blocks within
max_reuse), and its blocks join the prefix cache as if computed. The snapshot is found in the
space's index, in memory; the LoadOp holds its state when RAM has it, otherwise the engine reads
it as it applies the op (`load_op`; kvcache/snapshots/ package doc), and a state that cannot be
read then is unloaded (BlockManager.unload).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.blocks import Block, CopyOp, KVOp, LoadOp, RemoveOp, SnapshotOp, block_hashes
from kvcache.snapshots import Snapshot, Space

# A snapshot is loaded when it brings at least this many blocks more than the streams hold, and
# at least 1/LOAD_RATIO of its own size: loading moves every byte of it (a few GB/s), computing
# costs milliseconds a token.
LOAD_MIN_BLOCKS = 4
LOAD_RATIO = 256


class TierLink:
    def __init__(self, tiers: Space | None, block_size: int, push: Callable[[KVOp], None]):
        """`push`: queue an op for the engine as it is (no save before it)."""
        self.tiers, self.block_size, self._push = tiers, block_size, push
        self.unsaved: dict[int, tuple[int, ...]] = {}   # holder -> its chain's tokens, to save

    # ---- loading ------------------------------------------------------------------------------
    def find(self, hashes: list[int], tokens: Sequence[int], max_reuse: int,
             in_streams: int) -> tuple[Snapshot, int] | None:
        """A snapshot worth loading for this prompt, whose streams hold `in_streams` tokens of
        it, and how many of its tokens to use; None when none is (module doc)."""
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
        return found

    def load_op(self, seq_id: int, snap: Snapshot, n_tokens: int) -> LoadOp:
        """The LoadOp of a snapshot found by `find`: with its state when RAM holds it (a RAM
        hit, counted now), else for the engine to read from disk as it applies the op."""
        assert self.tiers is not None, "found in the tiers"
        restore = self.tiers.in_ram(snap, n_tokens)
        if restore is None:
            return LoadOp(seq_id, snap, n_tokens, "disk")
        return LoadOp(seq_id, snap, n_tokens, "ram", restore.data)

    # ---- saving -------------------------------------------------------------------------------
    def worth_saving(self, hashes: list[int]) -> bool:
        """Whether a holder's cached chain goes to the tiers: long enough, and not held by a
        snapshot already."""
        tiers = self.tiers
        return (tiers is not None and len(hashes) * self.block_size >= tiers.min_tokens
                and not tiers.covers(hashes))

    def hold(self, holder: int, chain: list[Block]) -> None:
        """A sequence ended on `holder` with this cached chain: saved later if worth it."""
        if self.worth_saving([b.key for b in chain]):
            self.unsaved[holder] = tuple(t for b in chain for t in b.tokens)

    def take(self, limit: int | None = None) -> None:
        """A SnapshotOp for each holder not yet saved, `limit` of them at most."""
        for seq_id in list(self.unsaved)[:limit]:
            self._save(seq_id)

    def save_before(self, op: KVOp) -> None:
        """A holder not yet saved is saved before an op that would change its cells."""
        if isinstance(op, RemoveOp):
            tokens = self.unsaved.get(op.seq)
            if tokens is not None and op.p0 < len(tokens):
                self._save(op.seq)
        elif isinstance(op, CopyOp) and op.dst in self.unsaved:
            self._save(op.dst)

    def moved(self, src: int, dst: int) -> None:
        """A holder moved to another seq id: saved from there (the engine settles the copy
        first)."""
        if src in self.unsaved:
            self.unsaved[dst] = self.unsaved.pop(src)

    def forget(self, holder: int) -> None:
        """A holder's sequence goes on (the next turn on its seq id): saved with what follows
        when it ends."""
        self.unsaved.pop(holder, None)

    def _save(self, seq_id: int) -> None:
        tokens = self.unsaved.pop(seq_id)
        if self.worth_saving(block_hashes(tokens, self.block_size)):
            self._push(SnapshotOp(seq_id, tokens))

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self, holders: set[int]) -> None:
        assert set(self.unsaved) <= holders, "only holders wait to be saved"
