"""The Batch API's files and batches as the routes ask for them (server/api/batches.py): the
store, opened on first use (or at start-up when a database exists) with its unfinished batches
resumed, every call on its own thread; uploads, listings and deletions of files; a new batch
checked against the limits; a batch cancelled; the counts shown on /stats and /metrics.

Apart from the runner (server/batch/runner.py, `BatchRunner`, a `BatchAccess`), whose loop works
each batch to its end (validation, the lines run at background priority, finalization): this is
what a request to the Batch API does at once, and it never waits for a line.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from server.batch.lines import Active
from server.batch.store import ACTIVE, StorageError, Store
from server.config import BatchSettings
from server.errors import APIError

log = logging.getLogger("pagedllama.batch")


class BatchAccess:
    """The store and the batches not yet ended, as the routes reach them (module doc)."""

    def __init__(self, settings: BatchSettings, clock: Callable[[], float] = time.time):
        self.settings, self.clock = settings, clock
        self.store: Store | None = None
        self.store_error: StorageError | None = None
        self.active: dict[str, Active] = {}
        self.unsaved: dict[str, dict] = {}   # batches failed whose failure the store refused
        self.counts: Counter[str] = Counter()   # lines done since start, and their tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._wake = asyncio.Event()   # the runner's loop looks at its batches again
        self._opening = asyncio.Lock()

    # ---- the store, on its own thread ------------------------------------------------------------
    async def _call(self, fn: Callable, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool,
                                                                partial(fn, *args, **kwargs))

    async def open(self) -> Store:
        """The store, opened (and its unfinished batches resumed) if it is not yet: a
        StorageError when it cannot be."""
        async with self._opening:
            if self.store is None:
                await self._open()
        assert self.store is not None
        return self.store

    async def _open(self) -> None:
        try:
            store = await self._call(Store, self.settings.directory)
        except StorageError as exc:
            self.store_error = exc
            raise
        if store.note:
            log.error("batch store: %s", store.note)
        try:
            rerun = await self._call(store.recover)
            rows = await self._call(store.active_batches)
        except StorageError as exc:
            self.store_error = exc
            await self._call(store.close)
            raise
        self.store, self.store_error = store, None
        for row in rows:
            self.active[row["id"]] = Active(row, left=row["total"] - row["completed"]
                                            - row["failed"])
        if self.active or rerun:
            log.info("batch store %s: %d unfinished batch(es) resumed, %d line(s) left running "
                     "by the last process run again", store.path, len(self.active), rerun)
        self._wake.set()

    # ---- what the routes ask ---------------------------------------------------------------------
    async def upload(self, purpose: str, filename: str, content: bytes, lines: int) -> dict:
        store = await self.open()
        return await self._call(store.add_file, purpose, filename, content, lines)

    async def file(self, file_id: str) -> dict | None:
        return await self._call((await self.open()).file, file_id)

    async def file_content(self, file_id: str) -> bytes | None:
        return await self._call((await self.open()).file_content, file_id)

    async def files(self, purpose: str | None, after: str | None, limit: int,
                    order: str) -> tuple[list[dict], bool]:
        return await self._call((await self.open()).files, purpose, after, limit, order)

    async def delete_file(self, file_id: str) -> bool:
        return await self._call((await self.open()).delete_file, file_id)

    async def create(self, endpoint: str, input_file_id: str, window: str, window_s: float,
                     metadata: dict | None) -> dict:
        """A new batch (validating), if the limits allow: an APIError otherwise."""
        store = await self.open()
        source = await self._call(store.file, input_file_id)
        if source is None:
            raise APIError(404, f"No such file: {input_file_id!r}", "file_not_found",
                           "input_file_id")
        if source["purpose"] != "batch":
            raise APIError(400, f"File {input_file_id!r} has purpose {source['purpose']!r}; a "
                           "batch's input file is uploaded with purpose \"batch\"",
                           "invalid_value", "input_file_id")
        if (source["lines"] or 0) > self.settings.max_lines:
            raise APIError(400, f"File {input_file_id!r} has {source['lines']} request lines; a "
                           f"batch may have at most {self.settings.max_lines} "
                           "(PAGEDLLAMA_BATCH_MAX_LINES)", "too_many_lines", "input_file_id")
        active = sum(1 for b in self.active.values() if b.status in ACTIVE)
        if active >= self.settings.max_active:
            raise APIError(429, f"{active} batches are not finished yet; this server runs at "
                           f"most {self.settings.max_active} at once "
                           "(PAGEDLLAMA_BATCH_MAX_ACTIVE): wait for one to end, or cancel one",
                           "too_many_active_batches")
        row = await self._call(store.add_batch, endpoint, input_file_id, window, window_s,
                               metadata, self.clock())
        self.active[row["id"]] = Active(row)
        self._wake.set()
        return row

    async def batch(self, batch_id: str) -> dict | None:
        if batch_id in self.unsaved:
            return self.unsaved[batch_id]
        return await self._call((await self.open()).batch, batch_id)

    async def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows, more = await self._call((await self.open()).batches, after, limit)
        return [self.unsaved.get(r["id"], r) for r in rows], more

    async def cancel(self, batch_id: str) -> dict | None:
        """Cancel a batch: it stops starting lines, cancels those running, and ends
        `cancelled` with what it finished (an APIError 409 for a batch that has ended)."""
        store = await self.open()
        row = await self._call(store.batch, batch_id)
        if row is None:
            return None
        if row["status"] in ("cancelling", "cancelled"):
            return row
        moved = await self._call(store.set_status, batch_id, "cancelling", self.clock(),
                                 only_from=("validating", "in_progress"))
        if not moved:
            raise APIError(409, f"Batch {batch_id!r} is {row['status']}: only a validating or "
                           "in-progress batch can be cancelled", "batch_not_cancellable")
        b = self.active.get(batch_id)
        if b is not None:
            b.row["status"], b.ending = "cancelling", "cancelled"
        self._wake.set()
        return await self._call(store.batch, batch_id)

    # ---- what it shows ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """For /stats, /metrics and the dashboard."""
        running = sum(len(b.running) for b in self.active.values())
        statuses = Counter(b.status for b in self.active.values())
        return {
            "store": str(self.settings.directory), "store_open": self.store is not None,
            "store_error": self.store_error.message if self.store_error else None,
            "concurrency": self.settings.concurrency,
            "batches": dict(statuses), "batches_active": len(self.active),
            "lines_running": running,
            "lines_pending": sum(b.left for b in self.active.values()) - running,
            "lines_completed": self.counts["completed"], "lines_failed": self.counts["failed"],
            "prompt_tokens": self.counts["input"], "cached_tokens": self.counts["cached"],
            "completion_tokens": self.counts["output"],
        }
