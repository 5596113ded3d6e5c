"""The Batch API's runner: it validates new batches, runs their lines through the routes' own
code at background priority, records each line, and ends each batch (output and error files),
with everything durable in the store (server/batch/store.py).

**Background priority.** A batch line is a request like any other (the same service path, so
it shares cached prefixes), submitted at the lowest priority (`BATCH_PRIORITY`, the scheduler's
BACKGROUND: with every policy such a sequence runs only in steps where nothing else of its
context runs or waits, pauses where it stands meanwhile, and is preempted first). The runner
itself keeps batch work out of the way: a new line starts on a model only while
- no client's request holds any model (`Entry.users`, the leases of requests in flight, less
  the runner's own: the models of one process share its cores), and none has for `QUIET_S`
  (2 s: an agent's next turn, a chat user's next message mostly come within that; a line's
  prompt started between two chats delayed the next one, as measured by benchmarks/batch.py);
- none of its contexts has a request waiting (the runner's own included: the lines started
  at once, up to the concurrency, are admitted before more start; a model not loaded yet gets
  one line, which loads it);
- fewer than PAGEDLLAMA_BATCH_CONCURRENCY lines are in flight (all batches together);
and never while the server drains.

**Durable.** A line is marked running before it starts; its output line is recorded with its
counts in one transaction, once (store.finish_line). A line that ends without an answer of its
own (429 or 503: the server was busy, loading or draining; 499: its batch was cancelled or
expired) is pending again, and runs later. At start-up lines left running are pending again
(`Store.recover`) and every unfinished batch resumes; a batch found finalizing is finalized
again (one transaction writes its files and status). A store failure (a full disk, a corrupt
page) fails the batch it hit with the store's message, never the server.

A line runs for a client of its own (`LineClient`, the service's Client as a batch line is
one), which holds its model as an HTTP client's request does, is "disconnected" to cancel the
line, and names the batch and line in the request log (`batch=ID#LINE`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from scheduler.sequence import BACKGROUND
from server.batch import shapes
from server.batch.store import ACTIVE, StorageError, Store
from server.config import BatchSettings
from server.errors import APIError, error_body
from server.service.catalog import Entry, Lease
from server.service.client import Client, Releasable
from server.service.service import Service

log = logging.getLogger("pagedllama.batch")
request_log = logging.getLogger("pagedllama.request")

BATCH_PRIORITY = BACKGROUND   # the lowest priority a request can have (JSON's largest exact int)
TICK_S = 0.05                # how often the runner looks at the models and its batches
QUIET_S = 2.0                # a model's time without interactive requests before lines start
BUSY_PAUSE_S = 1.0           # after a 429 / 503, a model gets no line for this long
TRANSIENT = frozenset({429, 499, 503})   # a line that ends so has no answer: it runs again

# (endpoint, the line's body, its client) -> the route's answer; an APIError as the route
# would answer it (server/api/batches.py: answer_line)
Execute = Callable[[str, dict, Client], Awaitable[dict]]


class Draining(Protocol):
    """The server's drain (server/http/drain.py): no line starts while it drains."""
    draining: bool


class LineClient:
    """The client a batch line runs for (server/service/client.py): the route's path, the
    model leases it takes (held until the line ends, as an HTTP client's are held until its
    answer is sent), "disconnected" once the line is cancelled, and its batch and line in the
    request log."""

    def __init__(self, path: str, tag: str):
        self.path, self.tag = path, tag
        self.leases: list[Releasable] = []
        self.logged = False       # the service wrote the line's request log line
        self._gone = False

    async def is_disconnected(self) -> bool:
        return self._gone

    def hold(self, lease: Releasable) -> None:
        self.leases.append(lease)

    def log_name(self) -> str:
        return f"POST {self.path}"

    def log_notes(self) -> str:
        self.logged = True
        return f" batch={self.tag}"

    def cancel(self) -> None:
        self._gone = True

    def holds(self, entry: Entry) -> int:
        return sum(1 for lease in self.leases
                   if isinstance(lease, Lease) and lease.held and lease.entry is entry)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


@dataclass(eq=False)
class Line:
    idx: int
    custom_id: str
    request: str
    model: str | None
    client: LineClient | None = None
    task: asyncio.Task | None = None


@dataclass(eq=False)
class Active:
    """A batch not yet ended, as the runner works on it."""
    row: dict
    left: int = 0                        # lines not yet done
    queue: deque[Line] = field(default_factory=deque)   # pending lines fetched, in order
    after: int = 0                       # the last line number fetched from the store
    exhausted: bool = False              # every pending line has been fetched
    running: dict[int, Line] = field(default_factory=dict)
    ending: str | None = None            # "cancelled", "expired": stop, then finalize so
    busy: asyncio.Task | None = None     # its validation or finalization, under way

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def status(self) -> str:
        return self.row["status"]


class BatchRunner:
    """Owns the store (opened on first use, or at start-up when a database exists, to resume)
    and the batches not yet ended. The routes (server/api/batches.py) call its methods; its loop
    runs the lines."""

    def __init__(self, settings: BatchSettings, service: Service, drain: Draining,
                 execute: Execute, clock: Callable[[], float] = time.time):
        self.settings, self.service, self.drain, self.execute = settings, service, drain, execute
        self.clock = clock
        self.store: Store | None = None
        self.store_error: StorageError | None = None
        self.active: dict[str, Active] = {}
        self.unsaved: dict[str, dict] = {}   # batches failed whose failure the store refused
        self.by_model: Counter[str | None] = Counter()
        self.last_interactive = -math.inf    # when a client's request last held a model
        self.paused_until: dict[str | None, float] = {}
        self.counts: Counter[str] = Counter()   # lines done since start, and their tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._wake = asyncio.Event()
        self._opening = asyncio.Lock()
        self._loop_task: asyncio.Task | None = None
        self._stopping = False

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

    async def start(self) -> None:
        if self.settings.directory.joinpath("batches.sqlite3").exists():
            try:
                await self.open()
            except StorageError as exc:
                log.error("batch store: %s (the Batch API answers 503 until it can open it)",
                          exc.message)
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Stop running lines (each stays running in the store and runs again at the next
        start) and close the store."""
        self._stopping = True
        tasks = [t for t in (self._loop_task,) if t is not None]
        tasks += [line.task for b in self.active.values() for line in b.running.values()
                  if line.task is not None]
        tasks += [b.busy for b in self.active.values() if b.busy is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            await self._call(self.store.close)
            self.store = None
        self._pool.shutdown(wait=True)

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

    # ---- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._stopping:
            try:
                if self.store is not None:
                    self._tick()
            except Exception:   # the loop goes on: a bug here must not stop every batch
                log.exception("batch runner")
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass
            self._wake.clear()

    def _tick(self) -> None:
        now = self.clock()
        self._watch_models()
        for b in list(self.active.values()):
            if b.busy is not None:
                continue
            if b.status == "validating" and not b.ending:
                if now >= b.row["expires_at"]:
                    b.ending = "expired"
                else:
                    self._spawn(b, self._validate(b))
                    continue
            if b.status == "in_progress" and not b.ending and now >= b.row["expires_at"]:
                b.ending = "expired"
            if b.status == "cancelling":
                b.ending = "cancelled"
            if b.ending:
                for line in b.running.values():
                    line.client.cancel()
                if not b.running:
                    self._spawn(b, self._finalize(b, b.ending))
            elif b.status == "finalizing" or (b.status == "in_progress" and b.left <= 0
                                               and not b.running):
                self._spawn(b, self._finalize(b, "completed"))
        self._start_lines(now)

    def _spawn(self, b: Active, work: Awaitable) -> None:
        """Run a batch's validation, finalization or line fetch (one at a time: `busy`); one
        that fails unexpectedly is logged and tried again a second later."""
        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("batch %s", b.id)
                await asyncio.sleep(1.0)
            finally:
                b.busy = None
                self._wake.set()
        b.busy = asyncio.create_task(run())

    def _closing(self) -> bool:
        return self._stopping or self.service.closing or self.drain.draining

    def _mine(self, entry: Entry) -> int:
        return sum(line.client.holds(entry) for b in self.active.values()
                   for line in b.running.values() if line.client is not None)

    def _watch_models(self) -> None:
        """Note when a model last had a client's request (one the runner did not make)."""
        catalog = self.service.catalog
        if catalog is not None and any(entry.users - self._mine(entry) > 0
                                       for entry in catalog.entries.values()):
            self.last_interactive = time.monotonic()

    def _room(self, model: str | None) -> bool:
        """Whether a line of `model` may start now (the module's docstring)."""
        now = time.monotonic()
        if self.paused_until.get(model, 0.0) > now or now - self.last_interactive < QUIET_S:
            return False
        catalog = self.service.catalog
        entry = catalog.entries.get(model) if catalog is not None and model else None
        if entry is None:   # no such model: its lines fail at once, one at a time
            return self.by_model[model] == 0
        lm = entry.loaded
        if lm is None:      # not loaded: one line loads it
            return self.by_model[model] == 0
        if lm.preparing:
            return False
        return not any(w.snapshot().waiting for w in lm.workers)

    def _start_lines(self, now: float) -> None:
        if self._closing():
            return
        running = sum(len(b.running) for b in self.active.values())
        blocked: set[str | None] = set()
        for b in list(self.active.values()):
            if running >= self.settings.concurrency:
                return
            if b.status != "in_progress" or b.ending or b.busy is not None:
                continue
            while b.queue and running < self.settings.concurrency:
                line = b.queue[0]
                if line.model in blocked or not self._room(line.model):
                    blocked.add(line.model)
                    break
                b.queue.popleft()
                self._start(b, line)
                running += 1
            if not b.queue and not b.exhausted:   # the next pending lines (the loop comes back)
                self._spawn(b, self._fetch(b))

    async def _fetch(self, b: Active) -> None:
        try:
            rows = await self._call(self.store.pending_lines, b.id, b.after, 64)
        except StorageError as exc:
            await self._fail(b, exc)
            return
        finally:
            b.busy = None
        for idx, custom_id, request in rows:
            if idx not in b.running:
                b.queue.append(Line(idx, custom_id, request, shapes.line_model(request)))
        if rows:
            b.after = rows[-1][0]
        else:
            b.exhausted = True
        self._wake.set()

    def _start(self, b: Active, line: Line) -> None:
        line.client = LineClient(b.row["endpoint"], f"{b.id}#{line.idx}")
        b.running[line.idx] = line
        self.by_model[line.model] += 1
        line.task = asyncio.create_task(self._run(b, line), name=f"batch-line-{b.id}#{line.idx}")

    async def _run(self, b: Active, line: Line) -> None:
        t0 = time.monotonic()
        status, body = 0, None
        try:
            await self._call(self.store.mark_running, b.id, line.idx)
            try:
                body = await self.execute(b.row["endpoint"], shapes.line_body(line.request),
                                          line.client)
                status = 200
            except APIError as exc:
                status, body = exc.status, exc.body()
            except StorageError:
                raise
            except Exception as exc:   # a bug in a route: this line's 500, the batch goes on
                log.exception("batch %s line %d", b.id, line.idx)
                status, body = 500, error_body(500, f"internal error: {type(exc).__name__}",
                                               "internal_error")
            finally:
                line.client.release()
            if status in TRANSIENT:
                await self._call(self.store.release_line, b.id, line.idx)
                if status != 499:
                    self.paused_until[line.model] = time.monotonic() + BUSY_PAUSE_S
                if not b.ending and not self._stopping:
                    b.queue.appendleft(Line(line.idx, line.custom_id, line.request, line.model))
            else:
                await self._record(b, line, status, body)
            if not line.client.logged:
                request_log.info("POST %s %s batch=%s#%d status=%d total=%.3fs",
                                 b.row["endpoint"], "ok" if status == 200 else "error", b.id,
                                 line.idx, status, time.monotonic() - t0)
        except StorageError as exc:
            await self._fail(b, exc)
        except Exception:   # a bug here: the line goes to the error file, the batch goes on
            log.exception("batch %s line %d", b.id, line.idx)
            try:
                await self._record(b, line, 500,
                                   error_body(500, "internal error", "internal_error"))
            except Exception:
                log.exception("batch %s line %d", b.id, line.idx)
        finally:
            b.running.pop(line.idx, None)
            self.by_model[line.model] -= 1
            self._wake.set()

    async def _record(self, b: Active, line: Line, status: int, body: dict) -> None:
        ok = status == 200
        usage = shapes.usage_of(body) if ok else (0, 0, 0, 0)
        recorded = await self._call(self.store.finish_line, b.id, line.idx, ok,
                                    shapes.answered_line(line.custom_id, status, body), usage)
        if not recorded:
            return
        b.left -= 1
        b.row["completed" if ok else "failed"] += 1
        self.counts["completed" if ok else "failed"] += 1
        for key, n in zip(("input", "cached", "output"), usage):
            self.counts[key] += n

    async def _validate(self, b: Active) -> None:
        """Check the input file's lines and store them (in_progress), or fail the batch with
        its errors."""
        try:
            content = await self._call(self.store.file_content, b.row["input_file_id"])
            if content is None:
                lines, model, errors = [], None, [{
                    "code": "file_not_found", "line": None, "param": "input_file_id",
                    "message": f"the input file {b.row['input_file_id']} was deleted before the "
                               "batch was validated"}]
            else:
                lines, model, errors = await asyncio.to_thread(
                    shapes.parse_input, content, b.row["endpoint"], self.settings.max_lines)
            if errors:
                await self._call(self.store.set_status, b.id, "failed", self.clock(), errors,
                                 only_from=("validating",))
            else:
                await self._call(self.store.start_batch, b.id, lines, model, self.clock())
            row = await self._call(self.store.batch, b.id)
        except StorageError as exc:
            b.busy = None
            await self._fail(b, exc)
            return
        b.row, b.left = row, row["total"] - row["completed"] - row["failed"]
        b.busy = None
        if row["status"] == "failed":
            log.info("batch %s failed validation: %s", b.id, errors[0]["message"])
            self.active.pop(b.id, None)
        else:
            log.info("batch %s: %d lines to %s", b.id, row["total"], row["endpoint"])
        self._wake.set()

    async def _finalize(self, b: Active, status: str) -> None:
        """Write the batch's output and error files and end it in `status`."""
        code = {"expired": "batch_expired", "cancelled": "batch_cancelled"}.get(status)

        def unfinished(idx: int, custom_id: str) -> str:
            why = ("the batch expired before this request ran" if status == "expired"
                   else "the batch was cancelled before this request ran")
            return shapes.unanswered_line(custom_id, code, why)

        try:
            if status == "completed" and b.status != "finalizing":
                await self._call(self.store.set_status, b.id, "finalizing", self.clock())
                b.row["status"] = "finalizing"
            row = await self._call(self.store.finalize, b.id, status, self.clock(),
                                   unfinished if code else None)
        except StorageError as exc:
            b.busy = None
            await self._fail(b, exc)
            return
        self.active.pop(b.id, None)
        log.info("batch %s %s: %d completed, %d failed", b.id, status, row["completed"],
                 row["failed"])

    async def _fail(self, b: Active, exc: StorageError) -> None:
        """The store failed this batch: it ends `failed` with the store's message (kept in
        memory if the store cannot take even that: it then resumes at the next start)."""
        if self.active.get(b.id) is not b:   # failed already
            return
        log.error("batch %s failed: %s", b.id, exc.message)
        b.ending = b.ending or "failed"
        for line in b.running.values():
            line.client.cancel()
        errors = [{"code": exc.code, "line": None, "param": None, "message": exc.message}]
        try:
            await self._call(self.store.set_status, b.id, "failed", self.clock(), errors)
        except StorageError:
            row = dict(b.row, status="failed", failed_at=int(self.clock()),
                       errors=json.dumps(errors))
            self.unsaved[b.id] = row
        self.active.pop(b.id, None)
