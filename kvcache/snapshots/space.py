"""Space: the snapshots of one set of numbers (the package doc), indexed by the chained block
hashes of their tokens: what a context's block manager looks up and its engine saves into, reads
and restores from."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.blocks import LoadOp, block_hashes
from kvcache.snapshots.files import (
    FILE_SUFFIX,
    RACY_NS,
    BadFile,
    GoneFile,
    State,
    UnreadableFile,
    read_snapshot,
)

if TYPE_CHECKING:
    from kvcache.snapshots.store import PrefixStore

log = logging.getLogger("pagedllama.kvcache")


@dataclass(eq=False)
class Snapshot:
    """One saved sequence state: the KV of `tokens` (whole blocks), in RAM, on disk or both."""
    space: Space
    hashes: list[int]                 # chain hash of each block of tokens
    tokens: tuple[int, ...]
    size: int                         # bytes of state
    data: State | None = None         # held in RAM
    path: Path | None = None          # written to disk
    file_size: int = 0                # bytes of its file
    writing: bool = False             # queued for the disk writer

    @property
    def key(self) -> int:
        return self.hashes[-1]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class TierCounts:
    """Per tier: lookups that found a prefix there (hits), tokens restored from it, the time
    restores took, entries that failed a check, and states written to it (RAM: saved from a
    context; disk: files)."""
    hits: int = 0
    misses: int = 0
    tokens: int = 0
    restore_s: float = 0.0
    bad: int = 0
    written: int = 0
    write_s: float = 0.0


@dataclass
class Restore:
    """What a lookup found: the state to load, the tokens it holds to use, and its tier."""
    data: State
    n_tokens: int
    tier: str          # "ram" or "disk"


class Space:
    """The snapshots of one space (package doc): what a context's block manager looks up and its
    engine saves into, reads and restores from."""

    def __init__(self, store: PrefixStore, digest: str, identity: dict, block_size: int,
                 whole_only: bool):
        self.store, self.digest, self.identity = store, digest, identity
        self.block_size, self.whole_only = block_size, whole_only
        self.by_hash: dict[int, set[Snapshot]] = {}   # block chain hash -> snapshots holding it
        self.on_disk: dict[str, Snapshot] = {}        # file name -> snapshot
        self.directory = (store.disk_dir / digest if store.disk_dir is not None
                          else Path("/nonexistent"))
        self._dir_mtime = -1
        # files that failed a check and could not be deleted (a read-only directory): name ->
        # (size, mtime), not checked again while they stay the same
        self._rejected: dict[str, tuple[int, int]] = {}

    @property
    def min_tokens(self) -> int:
        return self.store.min_tokens

    def snapshots(self) -> set[Snapshot]:
        return {s for group in self.by_hash.values() for s in group}

    def _index(self, snap: Snapshot) -> None:
        for h in snap.hashes:
            self.by_hash.setdefault(h, set()).add(snap)

    def forget(self, snap: Snapshot) -> None:
        """Take a snapshot out of the index (it is in no tier any more)."""
        for h in snap.hashes:
            group = self.by_hash.get(h)
            if group is not None:
                group.discard(snap)
                if not group:
                    del self.by_hash[h]

    # ---- saving -------------------------------------------------------------------------------
    def covers(self, hashes: Sequence[int]) -> bool:
        """Whether a snapshot already holds these blocks, restorable at their end."""
        with self.store.lock:
            group = self.by_hash.get(hashes[-1], ())
            return any(not self.whole_only or s.key == hashes[-1] for s in group)

    def put(self, tokens: Sequence[int], data: State) -> None:
        """Keep the state of `tokens` (whole blocks): in RAM, and queued for disk. Snapshots it
        makes redundant (a prefix of it, restorable anywhere) are dropped."""
        bs = self.block_size
        assert tokens and len(tokens) % bs == 0, "whole blocks"
        snap = Snapshot(self, block_hashes(tokens, bs), tuple(tokens), len(data))
        with self.store.lock:
            if not self.whole_only:
                for h in snap.hashes:
                    for old in list(self.by_hash.get(h, ())):
                        if old.key == h:   # ends inside the new one
                            self._drop(old)
            self._index(snap)
            self.store.counts["ram"].written += 1   # saved from a context
            if self.store.disk_writable:
                snap.writing = True
                self.store._enqueue((snap, data))
            self.store._keep_in_ram(snap, data)   # (dropped at once when larger than the tier)

    def _drop(self, snap: Snapshot) -> None:
        store = self.store
        if store.ram.pop(id(snap), None) is not None:
            store.ram_bytes -= snap.size
        snap.data = None
        if snap.path is not None:
            try:
                snap.path.unlink(missing_ok=True)
            except OSError:   # a read-only directory: the file stays, found by its tokens
                pass
            self.on_disk.pop(snap.path.name, None)
            snap.path = None
        self.forget(snap)

    # ---- looking up ---------------------------------------------------------------------------
    def find(self, hashes: Sequence[int], tokens: Sequence[int],
             max_tokens: int) -> tuple[Snapshot, int] | None:
        """The snapshot holding the most of this prompt's leading blocks, up to max_tokens, and
        how many tokens of it to use (whole blocks; all of it for whole_only spaces). The index
        only, in memory: files other processes wrote since the last `refresh` are not seen."""
        bs = self.block_size
        with self.store.lock:
            n = 0
            while n < len(hashes) and (n + 1) * bs <= max_tokens and hashes[n] in self.by_hash:
                n += 1
            for i in range(n - 1, -1, -1):
                fits = [s for s in self.by_hash.get(hashes[i], ())
                        if (not self.whole_only or s.n_tokens == (i + 1) * bs)
                        and s.tokens[:(i + 1) * bs] == tuple(tokens[:(i + 1) * bs])]
                if fits:   # in RAM first, then the smallest to restore
                    best = min(fits, key=lambda s: (s.data is None, s.size))
                    return best, (i + 1) * bs
        return None

    def in_ram(self, snap: Snapshot, n_tokens: int) -> Restore | None:
        """The state of a snapshot found by find if RAM holds it (a hit), else None; no I/O."""
        t0 = time.perf_counter()
        with self.store.lock:
            if snap.data is None:
                return None
            self.store.touch(snap)
            return self._hit("ram", snap.data, n_tokens, t0)

    def fetch(self, snap: Snapshot, n_tokens: int) -> Restore | None:
        """The state of a snapshot found by find: from RAM, or read and checked from disk (then
        kept in RAM). None when the disk copy is gone or fails a check (logged, deleted)."""
        restore = self.in_ram(snap, n_tokens)
        if restore is not None:
            return restore
        store = self.store
        t0 = time.perf_counter()
        with store.lock:
            path = snap.path
        if path is None:
            return None
        try:
            data = read_snapshot(path, self.identity, self.block_size, snap.tokens, state=True)[2]
        except GoneFile:
            data = None
        except BadFile as exc:
            self._reject(path, exc)
            data = None
        with store.lock:
            if data is None:
                self.on_disk.pop(path.name, None)
                snap.path = None
                if snap.data is None:
                    self.forget(snap)
                return None
            try:
                os.utime(path)   # a hit renews its place in the disk's LRU order
            except OSError:
                pass
            store._keep_in_ram(snap, data)
            return self._hit("disk", data, n_tokens, t0)

    def load(self, op: LoadOp) -> Restore | None:
        """The state a LoadOp loads (the engine, applying it): held since it was planned (a RAM
        hit), or read now (`read`). None when it cannot be read."""
        if op.data is not None:
            return Restore(op.data, op.n_tokens, op.tier)
        return self.read(op.snapshot, op.n_tokens)

    def read(self, snap: Snapshot, n_tokens: int) -> Restore | None:
        """The state for a LoadOp of snap's first n_tokens (the engine, applying it): fetch's,
        or, when snap left the tiers since it was found (a snapshot that continues it replaced
        it), the state of the snapshot that holds those tokens now."""
        with self.store.lock:
            if snap not in self.by_hash.get(snap.key, ()):
                hashes, tokens = snap.hashes, snap.tokens
                found = self.find(hashes[:n_tokens // self.block_size], tokens[:n_tokens],
                                  n_tokens)
                if found is None:
                    return None
                snap = found[0]
        return self.fetch(snap, n_tokens)

    def _hit(self, tier: str, data: State, n_tokens: int, t0: float) -> Restore:
        counts = self.store.counts[tier]
        counts.hits += 1
        counts.tokens += n_tokens
        counts.restore_s += time.perf_counter() - t0
        return Restore(data, n_tokens, tier)

    def restored(self, tier: str, seconds: float) -> None:
        """The engine's time loading a state into a sequence, counted with the tier's."""
        with self.store.lock:
            self.store.counts[tier].restore_s += seconds

    def miss(self) -> None:
        with self.store.lock:
            self.store.counts["ram"].misses += 1

    # ---- disk ---------------------------------------------------------------------------------
    def _reject(self, path: Path, exc: BadFile, st: os.stat_result | None = None) -> None:
        """Skip a file that failed a check: a log line, the `bad` count, and delete it (not one
        that could not be read)."""
        with self.store.lock:
            self.store.counts["disk"].bad += 1
        if isinstance(exc, UnreadableFile):
            log.warning("prefix cache disk tier: %s skipped: %s", path, exc)
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("prefix cache disk tier: %s skipped: %s (not deleted: %s)", path,
                            exc, err.strerror or err)
            else:
                log.warning("prefix cache disk tier: %s skipped and deleted: %s", path, exc)
                return
        if st is not None:   # not checked again while it stays the same
            self._rejected[path.name] = (st.st_size, st.st_mtime_ns)

    def scan_disk(self) -> bool:
        """Index the snapshot files of this space (at start, and when its folder changed: another
        process wrote or deleted some): headers only; the state is read and checked on a hit.
        Files gone since the last scan leave the index. Returns whether it found new files."""
        if self.store.disk_dir is None:
            return False
        with self.store.lock:
            known = set(self.on_disk)
        try:
            mtime = self.directory.stat().st_mtime_ns
            names = {e.name for e in os.scandir(self.directory)
                     if e.name.endswith(FILE_SUFFIX) and not e.name.startswith(".")}
        except OSError:
            return False
        self._dir_mtime = mtime if time.time_ns() - mtime > RACY_NS else -1
        for name in sorted(names - known):
            path = self.directory / name
            try:
                st = path.stat()
                if self._rejected.get(name) == (st.st_size, st.st_mtime_ns):
                    continue
                tokens, size, _ = read_snapshot(path, self.identity, self.block_size, None,
                                                 state=False)
            except (GoneFile, OSError):   # deleted meanwhile
                continue
            except BadFile as exc:
                self._reject(path, exc, st)
                continue
            snap = Snapshot(self, block_hashes(tokens, self.block_size), tokens, size,
                            path=path)
            with self.store.lock:
                if name not in self.on_disk:
                    snap.file_size = st.st_size
                    self.on_disk[name] = snap
                    self._index(snap)
        with self.store.lock:
            for name in known - names:
                gone = self.on_disk.pop(name, None)
                if gone is not None:
                    gone.path = None
                    if gone.data is None and not gone.writing:
                        self.forget(gone)
            if not self.store.disk_writable:   # no trim counts the directory: what is indexed
                self.store.disk_bytes = sum(s.file_size for sp in self.store.spaces.values()
                                            for s in sp.on_disk.values())
        return bool(names - known)

    def refresh(self) -> None:
        """Index the files other processes wrote or deleted since the last look, if the space's
        folder changed (the engine calls this before it plans)."""
        if self.store.disk_dir is None:
            return
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            return
        if mtime != self._dir_mtime and self.scan_disk():
            self.store.request_trim()   # another process wrote: hold this process's limit too


def space_identity(**facts) -> dict:
    """What decides the numbers a snapshot holds; two contexts share snapshots only when all of
    it is equal. The caller passes the model file's content hash, the llama.cpp build, the KV
    type, the attention path, the KV layout (split or unified, cells per stream), the weights'
    layout and where the model computes."""
    return dict(sorted(facts.items()))


