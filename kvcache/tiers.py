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
MAGIC, a 4-byte header length, a JSON header (space identity, block size, tokens, size of the
state), the CRC-32 of everything before it, the state, and the CRC-32 of everything before
that: the whole file. Any change to a byte of a file is caught: the header's checksum when the
directory is scanned (headers only), the whole file's when a hit reads the state. A header must
also agree with where the file lies: its space identity and block size with the space digest
of its folder, its tokens' chain hash with the file name. A file that fails any check (an older
format too) is skipped with a log line, deleted and counted in the tier's `bad`.

Sharing the directory (replicas on one machine): a file is written under a temporary name and
renamed into place, so a reader never sees half of one, and a file deleted while read stays
readable. The rename and the trim that follows it hold a lock on `<dir>/.lock`, so the
directory exceeds the smallest byte limit of the processes using it by at most the file just
renamed. A process that only reads trims too: when a lookup sees that its space's folder
changed, its disk thread trims the directory to its own limit. An error writing (a full or
read-only disk) turns writing off with a log line, and requests go on without it.

This module is plain Python: the engine hands it bytes (engine/llama.py, Context.apply).
"""
from __future__ import annotations

import fcntl
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcache.blocks import block_hashes

log = logging.getLogger("pagedllama.kvcache")

State = bytes | bytearray   # a sequence's state as llama.cpp writes it

MAGIC = b"PGLKV2\n"
OLD_MAGICS = (b"PGLKV1\n",)      # earlier formats: skipped and deleted
U32 = struct.Struct("<I")        # the header's length, and each CRC-32
FILE_SUFFIX = ".kv"
LOCK_NAME = ".lock"
TRIM = "trim"                    # the disk thread's order to trim the directory
KEY_MASK = 0xFFFFFFFFFFFFFFFF
# A folder's modification time within this of the clock may change again without changing
# (file systems keep coarse times): such a folder is listed again on the next lookup.
RACY_NS = 1_000_000_000


def space_digest(identity: dict, block_size: int) -> str:
    """The name of a space's folder: a digest of everything that decides its numbers."""
    text = json.dumps({"block_size": block_size, "space": identity}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_name(key: int) -> str:
    """A snapshot file's name: the chain hash of its last block."""
    return f"{key & KEY_MASK:016x}{FILE_SUFFIX}"


def encode(identity: dict, block_size: int, tokens: Sequence[int], data: State) -> list[State]:
    """A snapshot file's bytes (module doc), in parts: the head, the state, the last checksum."""
    header = json.dumps({"space": identity, "block_size": block_size, "tokens": list(tokens),
                         "size": len(data)}).encode()
    head = MAGIC + U32.pack(len(header)) + header
    head += U32.pack(zlib.crc32(head))
    return [head, data, U32.pack(zlib.crc32(data, zlib.crc32(head)))]


@contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Hold the directory's lock (flock on `.lock`) against other processes and stores; where
    the lock file cannot be opened (a read-only directory) nothing is held."""
    try:
        f = open(directory / LOCK_NAME, "ab")
    except OSError:
        f = None
    try:
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        if f is not None:
            f.close()   # releases the lock


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


def write_temp(path: Path, data: State | Sequence[State]) -> Path:
    """Write `data` (bytes, or parts of them one after the other) to a temporary file beside
    `path`, to be renamed there; returns its name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in ([data] if isinstance(data, (bytes, bytearray)) else data):
                f.write(part)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: Path, data: State | Sequence[State]) -> None:
    """Write `data` to a temporary file beside `path` and rename it there: a reader, or another
    process writing the same file, sees the old file or the new one, never a part of one."""
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class BadFile(Exception):
    """A snapshot file that fails a check (module doc); the message says which."""


class UnreadableFile(BadFile):
    """A snapshot file that could not be read (permissions, an I/O error): skipped, not
    deleted."""


class GoneFile(Exception):
    """A snapshot file deleted (by a trim, here or in another process) before it was read."""


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
        # the disk thread's work: a snapshot to write, TRIM, or None to end
        self._queue: queue.Queue[tuple[Snapshot, State] | str | None] = queue.Queue()
        self._queued = 0            # items put on the queue and not done yet
        self._trim_queued = False
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
        self.request_trim()   # a directory left over its limit (a smaller limit than before)

    def space(self, identity: dict, block_size: int, whole_only: bool) -> Space:
        """The snapshots of one set of numbers (space_identity), made once per process and kept
        across unload and reload of its model."""
        digest = space_digest(identity, block_size)
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
    def _enqueue(self, item: tuple[Snapshot, State] | str) -> None:
        with self.lock:
            self._queued += 1
        self._queue.put(item)

    def request_trim(self) -> None:
        """Have the disk thread trim the directory to this process's limit (once, however often
        it is asked before it starts)."""
        with self.lock:
            if (self._writer is None or not self.disk_writable or self._trim_queued
                    or self.disk_dir is None):
                return
            self._trim_queued = True
        self._enqueue(TRIM)

    def _write_forever(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, str):
                    with self.lock:
                        self._trim_queued = False
                    self._trim_locked()
                else:
                    self._write_item(*item)
            except Exception:   # the disk thread must outlive a surprise
                log.exception("prefix cache disk tier: %s failed",
                              "trimming" if isinstance(item, str) else "writing a snapshot")
            finally:
                with self.lock:
                    self._queued -= 1

    def _write_item(self, snap: Snapshot, data: State) -> None:
        try:
            self._write(snap, data)
        finally:
            with self.lock:
                snap.writing = False
                if snap.data is None and snap.path is None:
                    snap.space.forget(snap)

    def _write(self, snap: Snapshot, data: State) -> None:
        if not self.disk_writable or snap not in snap.space.by_hash.get(snap.key, ()):
            return   # dropped meanwhile (a longer snapshot of the same sequence replaced it)
        assert self.disk_dir is not None
        t0 = time.perf_counter()
        space = snap.space
        path = space.directory / file_name(snap.key)
        parts = encode(space.identity, space.block_size, snap.tokens, data)
        try:
            space.directory.mkdir(parents=True, exist_ok=True)
            tmp = write_temp(path, parts)
            try:
                with dir_lock(self.disk_dir):
                    os.replace(tmp, path)
                    with self.lock:
                        snap.path, snap.file_size = path, sum(len(p) for p in parts)
                        scanned = space.on_disk.get(path.name)
                        if scanned is not None and scanned is not snap and scanned.data is None:
                            space.forget(scanned)   # indexed by a scan between rename and here
                        space.on_disk[path.name] = snap
                        self.counts["disk"].written += 1
                        self.counts["disk"].write_s += time.perf_counter() - t0
                    self._trim_disk()
            finally:
                tmp.unlink(missing_ok=True)   # left only when the rename failed
        except OSError as exc:
            self.disk_writable = False
            self.disk_note = f"off after a write failed ({exc.strerror or exc})"
            log.warning("prefix cache disk tier: writing %s failed (%s); the disk tier stops "
                        "writing, requests are not affected", path, exc)

    def _trim_locked(self) -> None:
        if self.disk_dir is not None and self.disk_writable:
            with dir_lock(self.disk_dir):
                self._trim_disk()

    def _trim_disk(self) -> None:
        """Delete the least recently used files (by modification time, which a hit renews) until
        the directory holds at most disk_limit bytes; other processes' files count too. Called
        holding the directory's lock."""
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
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prefix cache disk tier: %s could not be deleted (%s)", path, exc)
                continue
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
        """Wait until the snapshots queued for disk are written and queued trims done (tests,
        shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self._queued:
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
        try:
            data = self._load(path, snap.tokens, state=True)[2]
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
    def _load(self, path: Path, expected: tuple[int, ...] | None,
              state: bool) -> tuple[tuple[int, ...], int, bytearray | None]:
        """A snapshot file's tokens, its state's size and, with `state`, the state, checked
        (module doc): the header always, the whole file's checksum when the state is read, and
        the tokens against `expected` when given. Raises BadFile (why) or GoneFile."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise GoneFile(str(path)) from None
        except OSError as exc:
            raise UnreadableFile(f"it could not be read ({exc.strerror or exc})") from None
        with f:
            try:
                st = os.fstat(f.fileno())
                head = f.read(len(MAGIC) + U32.size)
                if head[:len(MAGIC)] in OLD_MAGICS:
                    raise BadFile("written in an older format")
                if len(head) < len(MAGIC) + U32.size or not head.startswith(MAGIC):
                    raise BadFile("not a snapshot file (or truncated)")
                (n,) = U32.unpack_from(head, len(MAGIC))
                if len(head) + n + 2 * U32.size > st.st_size:
                    raise BadFile("truncated (or its header length is damaged)")
                rest = f.read(n + U32.size)
                crc = zlib.crc32(rest[:n], zlib.crc32(head))
                if len(rest) != n + U32.size or U32.unpack_from(rest, n)[0] != crc:
                    raise BadFile("header checksum mismatch")
                tokens, size = self._check_header(path, rest[:n])
                if expected is not None and tokens != expected:
                    raise BadFile("its tokens are not the ones indexed")
                if st.st_size != len(head) + len(rest) + size + U32.size:
                    raise BadFile(f"truncated or too long ({st.st_size} bytes, "
                                  f"{len(head) + len(rest) + size + U32.size} expected)")
                if not state:
                    return tokens, size, None
                data = bytearray(size)
                got = f.readinto(data)
                tail = f.read(U32.size + 1)
                if got != size or len(tail) != U32.size:
                    raise BadFile("truncated")
                crc = zlib.crc32(data, zlib.crc32(rest[n:], crc))
                if U32.unpack(tail)[0] != crc:
                    raise BadFile("checksum mismatch")
                return tokens, size, data
            except OSError as exc:
                raise UnreadableFile(f"it could not be read ({exc.strerror or exc})") from None

    def _check_header(self, path: Path, raw: bytes) -> tuple[tuple[int, ...], int]:
        """A header's tokens and state size, if it belongs where it lies: this space (the
        folder's digest), this block size, whole blocks, the file named by its tokens."""
        try:
            header = json.loads(raw)
            space, block_size = header["space"], header["block_size"]
            tokens, size = header["tokens"], header["size"]
        except (ValueError, KeyError, TypeError):
            raise BadFile("its header does not parse") from None
        if not isinstance(space, dict) or type(block_size) is not int or type(size) is not int \
                or size < 0 or not isinstance(tokens, list) \
                or not all(type(t) is int for t in tokens):
            raise BadFile("its header does not parse")
        if space_digest(space, block_size) != path.parent.name:
            raise BadFile("its space identity or block size is not its folder's")
        if space != self.identity or block_size != self.block_size:
            raise BadFile("written for other numbers (model, build or settings)")
        if not tokens or len(tokens) % block_size:
            raise BadFile("its tokens are not whole blocks")
        if file_name(block_hashes(tokens, block_size)[-1]) != path.name:
            raise BadFile("its name is not the chain hash of its tokens")
        return tuple(tokens), size

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
                tokens, size, _ = self._load(path, None, state=False)
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

    def _rescan_if_changed(self) -> None:
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


__all__ = ["PrefixStore", "Restore", "Snapshot", "Space", "file_digest", "space_identity"]
