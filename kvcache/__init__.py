"""Paged KV bookkeeping in plain Python (no llama_cpp import)."""
from kvcache.blocks import (
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
from kvcache.manager import BlockManager
from kvcache.snapshots import PrefixStore, Space, space_identity

__all__ = ["Block", "BlockManager", "CopyOp", "DropSavedOp", "KVOp", "LoadOp", "PrefixStore",
           "RemoveOp", "RestoreOp", "SaveOp", "SeqAlloc", "SnapshotOp", "Space", "block_hashes",
           "space_identity"]
