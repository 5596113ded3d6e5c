"""The Batch API's runner: it validates new batches, runs their lines through the routes' own
code at background priority, records each line, and ends each batch (output and error files),
with everything durable in the store (server/batch/store.py). What the routes ask of it at once
(files, a new batch, a cancel, the counts) is server/batch/access.py's (`BatchAccess`, which
`BatchRunner` extends); its records of the batches it works on, server/batch/lines.py's.

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
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

from scheduler.sequence import BACKGROUND
from server.batch import shapes
from server.batch.access import BatchAccess
from server.batch.lines import Active, Line, LineClient
from server.batch.store import StorageError
from server.config import BatchSettings
from server.errors import APIError, error_body
from server.service.catalog import Entry
from server.service.client import Client
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


class BatchRunner(BatchAccess):
    """Owns the store (opened on first use, or at start-up when a database exists, to resume)
    and the batches not yet ended. The routes (server/api/batches.py) call its methods
    (BatchAccess); its loop runs the lines."""

    def __init__(self, settings: BatchSettings, service: Service, drain: Draining,
                 execute: Execute, clock: Callable[[], float] = time.time):
        super().__init__(settings, clock)
        self.service, self.drain, self.execute = service, drain, execute
        self.by_model: Counter[str | None] = Counter()
        self.last_interactive = -math.inf    # when a client's request last held a model
        self.paused_until: dict[str | None, float] = {}
        self._loop_task: asyncio.Task | None = None
        self._stopping = False

    # ---- start and stop --------------------------------------------------------------------------
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
