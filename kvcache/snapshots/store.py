"""PrefixStore: the process's RAM tier of snapshots and the disk thread that writes and trims
their files (the package doc says how, and how processes share the directory)."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvcache.snapshots.files import (
    FILE_SUFFIX,
    TRIM,
    State,
    dir_lock,
    encode,
    file_name,
    space_digest,
    write_temp,
)
from kvcache.snapshots.space import Snapshot, Space, TierCounts

log = logging.getLogger("pagedllama.kvcache")


class PrefixStore:
    """The process's RAM and disk tiers, shared by every context (package doc). Thread-safe:
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


