"""The prefix cache beyond the KV streams: a RAM tier and a disk tier of saved sequence states.

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
MAGIC, a 4-byte header length, a JSON header (space identity, tokens, size, CRC-32 of the
state), the state. Written to a temporary name and renamed, so a reader never sees half a file;
two processes sharing the directory write whole files and delete by age, and a file deleted
while read stays readable. A file whose magic, header, space, tokens, size or checksum do not
match is skipped with a log line (and deleted); an error writing (a full or read-only disk)
turns writing off with a log line, and requests go on without it.

This module is plain Python: the engine hands it bytes (engine/llama.py, Context.apply).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache.blocks import block_hashes

log = logging.getLogger("pagedllama.kvcache")

State = bytes | bytearray   # a sequence's state as llama.cpp writes it

MAGIC = b"PGLKV1\n"
HEADER = struct.Struct("<I")
FILE_SUFFIX = ".kv"


def file_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a file's content, remembered by (path, size, mtime, inode) in this process
    and, when `memo` is given, in that JSON file (a 270 MB model hashes in about a second)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if stamp in _DIGESTS:
        return _DIGESTS[stamp]
    known: dict = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
    digest = known.get(stamp)
    if not isinstance(digest, str):
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if memo is not None:
            known[stamp] = digest
            try:
                write_atomic(memo, json.dumps(known, sort_keys=True).encode())
            except OSError:
                pass
    _DIGESTS[stamp] = digest
    return digest


_DIGESTS: dict[str, str] = {}


def write_atomic(path: Path, data: State | Sequence[State]) -> None:
    """Write `data` (bytes, or parts of them one after the other) to a temporary file beside
    `path` and rename it there: a reader, or another process writing the same file, sees the
    old file or the new one, never a part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in ([data] if isinstance(data, (bytes, bytearray)) else data):
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(eq=False)
class Snapshot:
    """One saved sequence state: the KV of `tokens` (whole blocks), in RAM, on disk or both."""
    space: Space
    hashes: list[int]                 # chain hash of each block of tokens
    tokens: tuple[int, ...]
    size: int                         # bytes of state
    data: State | None = None         # held in RAM
    path: Path | None = None          # written to disk
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
    restores took, and entries that failed a check."""
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


class PrefixStore:
    """The process's RAM and disk tiers, shared by every context (module doc). Thread-safe:
    worker threads look up and save, the event loop reads counts and shrinks the RAM tier."""

    def __init__(self, *, ram_limit: Callable[[], int] | int = 0, disk_dir: Path | None = None,
                 disk_limit: int = 0, min_tokens: int = 512):
        self._ram_limit = ram_limit if callable(ram_limit) else (lambda: ram_limit)
        self.disk_dir, self.disk_limit, self.min_tokens = disk_dir, disk_limit, min_tokens
        self.lock = threading.RLock()
        self.ram: OrderedDict[int, Snapshot] = OrderedDict()   # id -> snapshot, LRU first
        self.ram_bytes = 0
        self.disk_bytes = 0
        self.counts = {"ram": TierCounts(), "disk": TierCounts()}
        self.spaces: dict[str, Space] = {}
        self.disk_writable = False
        self.disk_note = "off (no PAGEDLLAMA_CACHE_DIR)"
        self._queue: queue.Queue[tuple[Snapshot, State] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if disk_dir is not None and disk_limit > 0:
            self._open_disk(disk_dir)

    # ---- settings and state -------------------------------------------------------------------
    @property
    def ram_limit(self) -> int:
        return max(0, self._ram_limit())

    def _open_disk(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            self.disk_writable, self.disk_note = True, f"on ({directory})"
        except OSError as exc:
            self.disk_note = f"read-only ({directory}: {exc.strerror or exc})"
            log.warning("prefix cache disk tier: %s is not writable (%s); snapshots are read "
                        "from it but not written", directory, exc)
        self._writer = threading.Thread(target=self._write_forever, name="prefix-cache-disk",
                                        daemon=True)
        self._writer.start()

    def space(self, identity: dict, block_size: int, whole_only: bool) -> Space:
        """The snapshots of one set of numbers (space_identity), made once per process and kept
        across unload and reload of its model."""
        text = json.dumps(identity, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        with self.lock:
            space = self.spaces.get(digest)
            if space is None:
                space = self.spaces[digest] = Space(self, digest, identity, block_size,
                                                    whole_only)
                space.scan_disk()
            return space

    def stats(self) -> dict:
        with self.lock:
            return {"ram": {"entries": len(self.ram), "bytes": self.ram_bytes,
                            "limit": self.ram_limit, **vars(self.counts["ram"])},
                    "disk": {"bytes": self.disk_bytes, "limit": self.disk_limit,
                             "state": self.disk_note,
                             "entries": sum(len(s.on_disk) for s in self.spaces.values()),
                             **vars(self.counts["disk"])},
                    "min_tokens": self.min_tokens}

    # ---- the RAM tier -------------------------------------------------------------------------
    def _keep_in_ram(self, snap: Snapshot, data: State) -> None:
        """Hold data for snap (most recently used), then trim the tier to its limit."""
        if snap.data is None:
            snap.data = data
            self.ram_bytes += snap.size
        self.ram[id(snap)] = snap
        self.ram.move_to_end(id(snap))
        self.shrink(self.ram_limit)

    def shrink(self, limit: int) -> int:
        """Drop least recently used snapshots from RAM until the tier holds at most `limit`
        bytes (a snapshot also on disk stays findable there). Returns the bytes freed."""
        freed = 0
        with self.lock:
            while self.ram_bytes > limit and self.ram:
                _, snap = self.ram.popitem(last=False)
                snap.data = None
                self.ram_bytes -= snap.size
                freed += snap.size
                if snap.path is None and not snap.writing:
                    snap.space.forget(snap)
        return freed

    def touch(self, snap: Snapshot) -> None:
        if id(snap) in self.ram:
            self.ram.move_to_end(id(snap))

    # ---- the disk tier ------------------------------------------------------------------------
    def _write_forever(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            snap, data = item
            try:
                self._write(snap, data)
            except Exception:   # the writer must outlive a surprise
                log.exception("prefix cache disk tier: writing a snapshot failed")
            finally:
                with self.lock:
                    snap.writing = False
                    if snap.data is None and snap.path is None:
                        snap.space.forget(snap)

    def _write(self, snap: Snapshot, data: State) -> None:
        if not self.disk_writable or snap not in snap.space.by_hash.get(snap.key, ()):
            return   # dropped meanwhile (a longer snapshot of the same sequence replaced it)
        t0 = time.perf_counter()
        space = snap.space
        header = json.dumps({"space": space.identity, "block_size": space.block_size,
                             "tokens": list(snap.tokens), "size": snap.size,
                             "crc32": zlib.crc32(data)}).encode()
        path = space.directory / f"{snap.key & 0xFFFFFFFFFFFFFFFF:016x}{FILE_SUFFIX}"
        try:
            space.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(path, [MAGIC, HEADER.pack(len(header)), header, data])
        except OSError as exc:
            self.disk_writable = False
            self.disk_note = f"off after a write failed ({exc.strerror or exc})"
            log.warning("prefix cache disk tier: writing %s failed (%s); the disk tier stops "
                        "writing, requests are not affected", path, exc)
            return
        with self.lock:
            snap.path = path
            space.on_disk[path.name] = snap
            self.counts["disk"].written += 1
            self.counts["disk"].write_s += time.perf_counter() - t0
        self._trim_disk()

    def _trim_disk(self) -> None:
        """Delete the least recently used files (by modification time, which a hit renews) until
        the directory holds at most disk_limit bytes; other processes' files count too."""
        assert self.disk_dir is not None
        files = []
        for path in self.disk_dir.glob(f"*/*{FILE_SUFFIX}"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.disk_limit:
                break
            path.unlink(missing_ok=True)
            total -= size
            with self.lock:
                space = self.spaces.get(path.parent.name)
                snap = space.on_disk.pop(path.name, None) if space is not None else None
                if space is not None and snap is not None:
                    snap.path = None
                    if snap.data is None and not snap.writing:
                        space.forget(snap)
        with self.lock:
            self.disk_bytes = total

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the snapshots queued for disk are written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                busy = any(s.writing for sp in self.spaces.values() for s in sp.snapshots())
            if not busy:
                return
            time.sleep(0.01)

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=10)


class Space:
    """The snapshots of one space (module doc): what a context's block manager looks up and its
    engine saves into."""

    def __init__(self, store: PrefixStore, digest: str, identity: dict, block_size: int,
                 whole_only: bool):
        self.store, self.digest, self.identity = store, digest, identity
        self.block_size, self.whole_only = block_size, whole_only
        self.by_hash: dict[int, set[Snapshot]] = {}   # block chain hash -> snapshots holding it
        self.on_disk: dict[str, Snapshot] = {}        # file name -> snapshot
        self.directory = (store.disk_dir / digest if store.disk_dir is not None
                          else Path("/nonexistent"))
        self._dir_mtime = -1

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
            if self.store.disk_writable:
                snap.writing = True
                self.store._queue.put((snap, data))
            self.store._keep_in_ram(snap, data)   # (dropped at once when larger than the tier)

    def _drop(self, snap: Snapshot) -> None:
        store = self.store
        if store.ram.pop(id(snap), None) is not None:
            store.ram_bytes -= snap.size
        snap.data = None
        if snap.path is not None:
            snap.path.unlink(missing_ok=True)
            self.on_disk.pop(snap.path.name, None)
            snap.path = None
        self.forget(snap)

    # ---- looking up ---------------------------------------------------------------------------
    def find(self, hashes: Sequence[int], tokens: Sequence[int],
             max_tokens: int) -> tuple[Snapshot, int] | None:
        """The snapshot holding the most of this prompt's leading blocks, up to max_tokens, and
        how many tokens of it to use (whole blocks; all of it for whole_only spaces)."""
        bs = self.block_size
        self._rescan_if_changed()
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

    def fetch(self, snap: Snapshot, n_tokens: int) -> Restore | None:
        """The state of a snapshot found by find: from RAM, or read and checked from disk (then
        kept in RAM). None when the disk copy is gone or fails a check (logged, deleted)."""
        store = self.store
        t0 = time.perf_counter()
        with store.lock:
            data, path = snap.data, snap.path
            if data is not None:
                store.touch(snap)
                return self._hit("ram", data, n_tokens, t0)
        if path is None:
            return None
        data = self._read(path, snap.tokens)
        with store.lock:
            if data is None:
                store.counts["disk"].bad += 1
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
    def _read(self, path: Path, tokens: tuple[int, ...] | None) -> bytes | None:
        """A snapshot file's state, checked: magic, header, this space, the tokens expected (when
        given), the size and the CRC-32. None (logged; the file deleted) when any fails."""
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("prefix cache disk tier: %s could not be read (%s); skipped", path, exc)
            return None
        header, data, why = self._parse(blob)
        if header is not None and tokens is not None and tuple(header["tokens"]) != tokens:
            why = "its tokens are not the ones indexed"
        if why:
            log.warning("prefix cache disk tier: %s skipped and deleted: %s", path, why)
            path.unlink(missing_ok=True)
            return None
        return data

    def _parse(self, blob: bytes) -> tuple[dict | None, bytes, str]:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + HEADER.size:
            return None, b"", "not a snapshot file (or truncated)"
        (n,) = HEADER.unpack_from(blob, len(MAGIC))
        start = len(MAGIC) + HEADER.size
        try:
            header = json.loads(blob[start:start + n])
            tokens, size, crc = header["tokens"], int(header["size"]), int(header["crc32"])
        except (ValueError, KeyError, TypeError):
            return None, b"", "its header does not parse"
        if header.get("space") != self.identity or header.get("block_size") != self.block_size:
            return None, b"", "written for other numbers (model, build or settings)"
        if not tokens or len(tokens) % self.block_size:
            return None, b"", "its tokens are not whole blocks"
        data = blob[start + n:]
        if len(data) != size:
            return None, b"", f"truncated ({len(data)} of {size} bytes)"
        if zlib.crc32(data) != crc:
            return None, b"", "checksum mismatch"
        return header, data, ""

    def scan_disk(self) -> None:
        """Index the snapshot files of this space (at start, and when another process wrote some):
        headers only; the state is read and checked on a hit."""
        if self.store.disk_dir is None or not self.directory.is_dir():
            return
        try:
            self._dir_mtime = self.directory.stat().st_mtime_ns
            names = [p for p in self.directory.iterdir() if p.suffix == FILE_SUFFIX]
        except OSError:
            return
        for path in names:
            if path.name in self.on_disk:
                continue
            tokens = self._header_tokens(path)
            if tokens is None:
                continue
            snap = Snapshot(self, block_hashes(tokens, self.block_size), tokens,
                            path.stat().st_size, path=path)
            with self.store.lock:
                self.on_disk[path.name] = snap
                self._index(snap)
        with self.store.lock:
            self.store.disk_bytes = sum(s.path.stat().st_size for sp in self.store.spaces.values()
                                        for s in sp.on_disk.values()
                                        if s.path is not None and s.path.exists())

    def _header_tokens(self, path: Path) -> tuple[int, ...] | None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + HEADER.size)
                if not head.startswith(MAGIC) or len(head) < len(MAGIC) + HEADER.size:
                    raise ValueError("not a snapshot file")
                (n,) = HEADER.unpack_from(head, len(MAGIC))
                header = json.loads(f.read(n))
            if header.get("space") != self.identity or header.get("block_size") != self.block_size:
                raise ValueError("written for other numbers")
            tokens = tuple(int(t) for t in header["tokens"])
            if not tokens or len(tokens) % self.block_size:
                raise ValueError("not whole blocks")
            return tokens
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("prefix cache disk tier: %s skipped: %s", path, exc)
            return None

    def _rescan_if_changed(self) -> None:
        if self.store.disk_dir is None:
            return
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            return
        if mtime != self._dir_mtime:
            self.scan_disk()


def space_identity(**facts) -> dict:
    """What decides the numbers a snapshot holds; two contexts share snapshots only when all of
    it is equal. The caller passes the model file's content hash, the llama.cpp build, the KV
    type, the attention path, the KV layout (split or unified, cells per stream), the weights'
    layout and where the model computes."""
    return dict(sorted(facts.items()))


__all__ = ["PrefixStore", "Restore", "Snapshot", "Space", "file_digest", "space_identity"]
