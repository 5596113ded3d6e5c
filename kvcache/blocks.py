"""Blocks, chained block hashes and the KV operations the manager asks the engine to run."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.snapshots import Snapshot

NO_PARENT = 0x9E3779B97F4A7C15  # hash chain seed for the first block of a sequence


def chain_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """hash(parent block hash, token ids of the block); ints and tuples hash the same in every
    run."""
    return hash((parent_hash, tuple(tokens)))


def block_hashes(tokens: Sequence[int], block_size: int, parent_hash: int = NO_PARENT,
                 start: int = 0) -> list[int]:
    """Hashes of the full blocks of tokens[start:], chained from parent_hash."""
    hashes = []
    for i in range(start, len(tokens) - block_size + 1, block_size):
        parent_hash = chain_hash(parent_hash, tokens[i:i + block_size])
        hashes.append(parent_hash)
    return hashes


@dataclass(eq=False)
class Block:
    """block_size KV cells of budget. Cached blocks are full and keyed by their chain hash."""
    id: int
    ref_count: int = 0
    index: int = 0                     # position of the block in its sequence (cells index*B ...)
    hash: int | None = None            # set while the block is in the prefix cache
    tokens: tuple[int, ...] = ()
    owner: int | None = None           # llama.cpp seq id whose cells hold the block for the cache
    parent: Block | None = None
    n_children: int = 0                # cached blocks whose parent is this one
    last_used: int = 0                 # the manager's clock when its last reference was dropped

    @property
    def key(self) -> int:
        """The chain hash of a block known to be cached."""
        assert self.hash is not None, f"block {self.id} is not cached"
        return self.hash

    @property
    def holder(self) -> int:
        """The seq id holding the cells of a block known to be cached."""
        assert self.owner is not None, f"block {self.id} has no owner"
        return self.owner

    @property
    def parent_key(self) -> int:
        """The key its cached children are listed under: its parent's chain hash, or NO_PARENT
        for a first block."""
        return self.parent.key if self.parent is not None else NO_PARENT

    def reset(self) -> None:
        self.ref_count, self.index, self.hash, self.tokens = 0, 0, None, ()
        self.owner, self.parent, self.n_children, self.last_used = None, None, 0, 0


# KV operations, applied by the engine in order before the next llama_decode.
@dataclass(frozen=True)
class CopyOp:
    """llama_memory_seq_cp(src, dst, p0, p1): share cells [p0, p1) of src with dst."""
    src: int
    dst: int
    p0: int
    p1: int


@dataclass(frozen=True)
class RemoveOp:
    """llama_memory_seq_rm(seq, p0, p1); p1 == -1 means to the end."""
    seq: int
    p0: int
    p1: int = -1


@dataclass(frozen=True)
class SaveOp:
    """Save a sequence's state to RAM under key (llama_state_seq_get_data), then remove it."""
    seq: int
    key: int


@dataclass(frozen=True)
class RestoreOp:
    """Restore a saved state into seq (llama_state_seq_set_data) and drop the saved copy."""
    key: int
    seq: int


@dataclass(frozen=True)
class DropSavedOp:
    """Forget a saved state (its request was cancelled while swapped out)."""
    key: int


@dataclass(frozen=True)
class SnapshotOp:
    """Save the state of seq, which holds exactly the KV of `tokens`, to the prefix cache's tiers
    (kvcache/snapshots/); the sequence keeps its cells."""
    seq: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class LoadOp:
    """Load a snapshot from the prefix cache's tiers into seq and keep its first n_tokens cells.
    `tier` is where the snapshot was when the load was planned: "ram", and `data` is its state,
    held since; or "disk", and the engine reads the state as it applies the op (Space.load)."""
    seq: int
    snapshot: Snapshot
    n_tokens: int
    tier: str
    data: bytes | bytearray | None = None


KVOp = CopyOp | RemoveOp | SaveOp | RestoreOp | DropSavedOp | SnapshotOp | LoadOp


@dataclass(eq=False)
class SeqAlloc:
    """What the manager holds for one live sequence: its llama.cpp seq id and block table."""
    seq_id: int
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)   # chain hashes of its full blocks, as known
    num_cached: int = 0     # tokens that came from the prefix cache when it was opened
    tier: str = "kv"        # where they came from: the KV streams, or a tier ("ram", "disk")
    num_checked: int = 0    # leading blocks already registered (or shared) by commit
    query_tokens: int = 0   # what it added to the manager's counts of prompt tokens
    hit_tokens: int = 0     # and of cached ones
