"""Paged KV bookkeeping in plain Python (no llama_cpp import)."""
from kvcache.blocks import (
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
from kvcache.manager import BlockManager

__all__ = ["Block", "BlockManager", "CopyOp", "DropSavedOp", "KVOp", "RemoveOp", "RestoreOp",
           "SaveOp", "SeqAlloc", "block_hashes"]
