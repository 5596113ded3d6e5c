"""Snapshots (saved prefix states): the prefix cache beyond the KV streams, a RAM tier and a disk
tier of saved sequence states.

When a sequence ends holding at least `min_tokens` cached tokens, the engine saves its KV state
(llama_state_seq_get_data: the cells of positions [0, n) of its seq id) as a *snapshot*: the
state's bytes and the tokens they are the KV of. Snapshots stay in RAM (LRU, within a byte limit
that the memory budget sets) and, when a directory is given, are written to disk by a background
thread (LRU by file time, within a byte limit). A new sequence whose prompt starts with a
snapshot's first blocks, beyond what the KV streams still hold, gets the state restored into its
seq id (llama_state_seq_set_data) and cut to the hit, instead of computing it again: the same
bytes the cold computation wrote, so the answer is the cold answer.

Snapshots are grouped in *spaces*: everything that decides the numbers in them (the model file's
content hash, the llama.cpp build, KV type, attention path, KV layout, block size; see
`space_identity`). A space's snapshots are found by the chained block hashes of their tokens
(kvcache/blocks.py), the same hashes the block manager uses, so a lookup costs a dict probe per
block; a hit also compares the tokens. On a model with sliding-window layers llama.cpp saves
only the window before a sequence's last position, so such a snapshot is restored whole or not
at all (`whole_only`).

Disk format: one file per snapshot, `<dir>/<space digest>/<last block's chain hash>.kv`:
MAGIC, a 4-byte header length, a JSON header (space identity, block size, tokens, size of the
state), the CRC-32 of everything before it, the state, and the CRC-32 of everything before
that: the whole file. Any change to a byte of a file is caught: the header's checksum when the
directory is scanned (headers only), the whole file's when a hit reads the state. A header must
also agree with where the file lies: its space identity and block size with the space digest
of its folder, its tokens' chain hash with the file name. A file that fails any check (an older
format too) is skipped with a log line, deleted and counted in the tier's `bad`.

Sharing the directory (replicas; docs/prefix-cache.md has the rules): no file is any process's
own (no index or manifest file: the folder is the index). A file is written under a temporary
name and renamed into place, so a reader never sees half of one, and a file deleted while read
stays readable. The rename and the trim that follows it hold a lock on `<dir>/.lock`, so the
directory exceeds the smallest byte limit of the processes using it by at most the file just
renamed. A process that only reads trims too: when a refresh sees that its space's folder
changed, its disk thread trims the directory to its own limit. An error writing (a full or
read-only disk) turns writing off with a log line, and requests go on without it.

Planning reads no file: the block manager looks snapshots up in the index (`Space.find`, in
memory) and asks for a hit with a LoadOp (kvcache/blocks.py) that holds the state when RAM has it
(`Space.in_ram`); otherwise the engine reads it as it applies the op (`Space.load`: the file,
read and checked, or the snapshot that holds those tokens now if that one left the tiers since).
A state that cannot be read sends its sequences back to be planned again (engine/llama.py,
Context.apply; the scheduler's `reopen`). The engine also indexes other processes' new files
before it plans (`Space.refresh`).

Parts: files.py (the file format, its checks, and the file utilities: the only file I/O of the
kvcache package is in this package), space.py (`Space`, `Snapshot`: the index of one space,
lookups and reads), store.py (`PrefixStore`: the RAM tier, the disk thread, trims).
"""
from kvcache.snapshots.files import file_digest, write_atomic
from kvcache.snapshots.space import Restore, Snapshot, Space, space_identity
from kvcache.snapshots.store import PrefixStore

__all__ = ["PrefixStore", "Restore", "Snapshot", "Space", "file_digest", "space_identity",
           "write_atomic"]
