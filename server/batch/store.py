"""The Batch API's durable state: one SQLite database, `batches.sqlite3`, in a folder of the state
dir (PAGEDLLAMA_STATE_DIR/batch). This module alone knows its format.

Three tables:
- `files`: uploaded input files and the output and error files of finished batches (their
  content as a BLOB);
- `batches`: one row per batch: its status and the time it entered each, its request counts and
  token usage (updated in the transaction that records each line), its output and error files;
- `lines`: one row per request line of a batch, copied from its input file when the batch is
  validated (deleting the input file later loses nothing): its line number, `custom_id`, the
  line as uploaded, its state (pending, running, done) and, once done, its output line.

A line's result is written in the same transaction that marks it done and counts it, and only
if it was not done already, so a line is recorded once however often it runs. A line taken to
run is marked running; at start-up (`recover`) running lines are pending again: the process
that ran them is gone, and they run again. Writes are synchronous (WAL, synchronous=FULL): a
recorded line survives a crash or a power cut.

One process at a time: the folder's lock file is held (flock) while the store is open; a second
server on the same state dir gets StorageError("storage_busy") and serves without batches.

Failures are StorageError with a code: `storage_full` (the disk, or SQLite's size limit, is
full), `storage_corrupt` (not a database, or a damaged page), `storage_busy`, `storage_error`
(other I/O). A database found corrupt when it is opened is moved aside
(`batches.sqlite3.corrupt-<time>`) and a fresh one started; `note` says so.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMA_VERSION = 1
DB_NAME = "batches.sqlite3"
LOCK_NAME = "batches.lock"

PENDING, RUNNING, DONE = 0, 1, 2
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
# the column that keeps when a batch entered a status
STATUS_TIME = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
               "completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
               "cancelling": "cancelling_at", "cancelled": "cancelled_at"}
USAGE = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    lines INTEGER,
    batch_id TEXT,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    model TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    request TEXT NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,
    ok INTEGER,
    result TEXT,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, idx);
"""


class StorageError(Exception):
    """The store could not read or write; `code` says why (see the module's docstring)."""

    def __init__(self, message: str, code: str = "storage_error"):
        super().__init__(message)
        self.message, self.code = message, code


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _code(exc: BaseException) -> str:
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc).lower()
    if name.startswith("SQLITE_FULL") or "disk is full" in text or "no space" in text:
        return "storage_full"
    if (name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text
            or "not a database" in text):
        return "storage_corrupt"
    return "storage_error"


_WHY = {"storage_full": "the disk is full", "storage_corrupt": "the database file is corrupt",
        "storage_error": "an I/O error"}


class Store:
    """The database, opened (and locked) for this process. Not async: the runner calls it on a
    thread of its own (server/batch/runner.py), one call at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / DB_NAME
        self.note: str | None = None      # what opening it did beyond opening (moved aside)
        self._mutex = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.directory / LOCK_NAME, "a+")
        except OSError as exc:
            raise StorageError(f"cannot open the batch store in {self.directory}: {exc}",
                               "storage_full" if _code(exc) == "storage_full"
                               else "storage_error") from exc
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_file.close()
            raise StorageError(f"another server process uses the batch store in "
                               f"{self.directory} (PAGEDLLAMA_STATE_DIR)", "storage_busy") from exc
        try:
            self.db = self._open()
        except StorageError as exc:
            if exc.code != "storage_corrupt":
                self._unlock()
                raise
            aside = self._move_aside()
            self.note = f"{self.path} was corrupt ({exc.message}); moved to {aside.name}"
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=OFF")
            check = [r[0] for r in db.execute("PRAGMA quick_check(5)")]
            if check != ["ok"]:
                raise sqlite3.DatabaseError("database disk image is malformed: "
                                            + "; ".join(map(str, check)))
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StorageError(f"{self.path} was written by a newer pagedllama (format "
                                   f"{version}; this one reads {SCHEMA_VERSION})")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            return db
        except sqlite3.Error as exc:
            if db is not None:
                db.close()
            raise StorageError(f"opening {self.path}: {_WHY[_code(exc)]} ({exc})",
                               _code(exc)) from exc

    def _move_aside(self) -> Path:
        aside = self.path.with_name(f"{DB_NAME}.corrupt-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            src = self.path.with_name(DB_NAME + suffix)
            if src.exists():
                os.replace(src, aside.with_name(aside.name + suffix))
        return aside

    def _unlock(self) -> None:
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        finally:
            self._lock_file.close()

    def close(self) -> None:
        with self._mutex:
            try:
                self.db.close()
            finally:
                self._unlock()

    @contextmanager
    def _tx(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed whole, or not at all (StorageError)."""
        with self._mutex:
            try:
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    yield self.db
                    self.db.execute("COMMIT")
                except BaseException:
                    if self.db.in_transaction:
                        self.db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StorageError(f"{doing}: {_WHY[_code(exc)]} ({exc})", _code(exc)) from exc

    def _read(self, doing: str, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._mutex:
            try:
                return self.db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StorageError(f"{doing}: {_WHY[_code(exc)]} ({exc})", _code(exc)) from exc

    # ---- files -------------------------------------------------------------------------------
    def add_file(self, purpose: str, filename: str, content: bytes, lines: int | None = None,
                 now: float | None = None) -> dict:
        file_id = new_id("file-")
        with self._tx("storing a file") as db:
            _insert_file(db, file_id, purpose, filename, content, lines, None, now)
        return self.file(file_id) or {}

    def file(self, file_id: str) -> dict | None:
        rows = self._read("reading a file", "SELECT seq, id, purpose, filename, bytes, created_at, "
                          "lines, batch_id FROM files WHERE id = ?", (file_id,))
        return dict(rows[0]) if rows else None

    def file_content(self, file_id: str) -> bytes | None:
        rows = self._read("reading a file", "SELECT content FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    def files(self, purpose: str | None = None, after: str | None = None, limit: int = 100,
              order: str = "desc") -> tuple[list[dict], bool]:
        """A page of files, newest first (`order` "asc": oldest first), after the file `after`;
        and whether there are more."""
        where, args = ["1 = 1"], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq {'<' if order == 'desc' else '>'} "
                         "(SELECT seq FROM files WHERE id = ?)")
            args.append(after)
        rows = self._read("listing files", "SELECT seq, id, purpose, filename, bytes, created_at, "
                          f"lines, batch_id FROM files WHERE {' AND '.join(where)} "
                          f"ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?",
                          (*args, limit + 1))
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._tx("deleting a file") as db:
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # ---- batches -----------------------------------------------------------------------------
    def add_batch(self, endpoint: str, input_file_id: str, completion_window: str,
                  window_seconds: float, metadata: dict | None, now: float | None = None) -> dict:
        now = int(time.time() if now is None else now)
        batch_id = new_id("batch_")
        with self._tx("storing a batch") as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, "
                       "metadata, status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, "
                       "'validating', ?, ?)",
                       (batch_id, endpoint, input_file_id, completion_window,
                        None if metadata is None else json.dumps(metadata), now,
                        now + max(1, round(window_seconds))))
        return self.batch(batch_id) or {}

    def batch(self, batch_id: str) -> dict | None:
        rows = self._read("reading a batch", "SELECT * FROM batches WHERE id = ?", (batch_id,))
        return dict(rows[0]) if rows else None

    def batches(self, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """A page of batches, newest first, after the batch `after`; and whether there are
        more."""
        where, args = "", ()
        if after is not None:
            where, args = "WHERE seq < (SELECT seq FROM batches WHERE id = ?)", (after,)
        rows = self._read("listing batches", f"SELECT * FROM batches {where} ORDER BY seq DESC "
                          "LIMIT ?", (*args, limit + 1))
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[dict]:
        """The batches not yet in a final status, oldest first."""
        marks = ", ".join("?" * len(ACTIVE))
        return [dict(r) for r in self._read(
            "listing batches", f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq",
            ACTIVE)]

    def count_active(self) -> int:
        marks = ", ".join("?" * len(ACTIVE))
        return self._read("counting batches", "SELECT COUNT(*) FROM batches WHERE status IN "
                          f"({marks})", ACTIVE)[0][0]

    def start_batch(self, batch_id: str, lines: list[tuple[int, str, str]], model: str | None,
                    now: float | None = None) -> bool:
        """A validated batch's lines (line number, custom_id, the line), stored with the batch
        in_progress, in one transaction. False (nothing written) unless it was validating."""
        with self._tx("storing the batch's lines") as db:
            cur = db.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, "
                "model = ? WHERE id = ? AND status = 'validating'",
                (int(time.time() if now is None else now), len(lines), model, batch_id))
            if cur.rowcount == 0:
                return False
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, request) "
                           "VALUES (?, ?, ?, ?)", [(batch_id, *line) for line in lines])
        return True

    def set_status(self, batch_id: str, status: str, now: float | None = None,
                   errors: list[dict] | None = None, only_from: tuple[str, ...] = ()) -> bool:
        """Move a batch to `status` (stamping its time), with `errors` (a failed batch's); only
        from the statuses `only_from` when given. Whether it moved."""
        when = STATUS_TIME.get(status)
        sets = ["status = ?"] + ([f"{when} = ?"] if when else [])
        args: list = [status] + ([int(time.time() if now is None else now)] if when else [])
        if errors is not None:
            sets.append("errors = ?")
            args.append(json.dumps(errors))
        cond = ""
        if only_from:
            cond = f" AND status IN ({', '.join('?' * len(only_from))})"
        with self._tx("updating a batch") as db:
            return db.execute(f"UPDATE batches SET {', '.join(sets)} WHERE id = ?{cond}",
                              (*args, batch_id, *only_from)).rowcount > 0

    def status_counts(self) -> dict[str, int]:
        return {r[0]: r[1] for r in self._read(
            "counting batches", "SELECT status, COUNT(*) FROM batches GROUP BY status")}

    # ---- lines -------------------------------------------------------------------------------
    def pending_lines(self, batch_id: str, after: int = 0,
                      limit: int = 64) -> list[tuple[int, str, str]]:
        """Pending lines after line number `after`, in order: (line number, custom_id, line)."""
        return [tuple(r) for r in self._read(
            "reading lines", "SELECT idx, custom_id, request FROM lines WHERE batch_id = ? AND "
            "state = ? AND idx > ? ORDER BY idx LIMIT ?", (batch_id, PENDING, after, limit))]

    def mark_running(self, batch_id: str, idx: int) -> bool:
        with self._tx("marking a line running") as db:
            return db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND idx = ? AND "
                              "state = ?", (RUNNING, batch_id, idx, PENDING)).rowcount > 0

    def release_line(self, batch_id: str, idx: int) -> bool:
        """A running line that did not finish (the server was busy or is stopping): pending."""
        with self._tx("releasing a line") as db:
            return db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND idx = ? AND "
                              "state = ?", (PENDING, batch_id, idx, RUNNING)).rowcount > 0

    def finish_line(self, batch_id: str, idx: int, ok: bool, result: str,
                    usage: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bool:
        """Record a line's output line (`ok`: for the output file, else the error file), mark it
        done and count it, in one transaction; False, and nothing written, if it was done
        already."""
        with self._tx("recording a line") as db:
            if db.execute("UPDATE lines SET state = ?, ok = ?, result = ? WHERE batch_id = ? "
                          "AND idx = ? AND state != ?",
                          (DONE, int(ok), result, batch_id, idx, DONE)).rowcount == 0:
                return False
            db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                       + ", ".join(f"{k} = {k} + ?" for k in USAGE) + " WHERE id = ?",
                       (int(ok), int(not ok), *usage, batch_id))
        return True

    def line_states(self, batch_id: str) -> dict[int, int]:
        """How many lines are in each state (PENDING, RUNNING, DONE)."""
        return {r[0]: r[1] for r in self._read(
            "counting lines", "SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY "
            "state", (batch_id,))}

    def recover(self) -> int:
        """At start-up: lines left running by a process that is gone are pending again."""
        with self._tx("recovering lines") as db:
            return db.execute("UPDATE lines SET state = ? WHERE state = ?",
                              (PENDING, RUNNING)).rowcount

    def finalize(self, batch_id: str, status: str, now: float | None = None,
                 unfinished: Callable[[int, str], str] | None = None) -> dict:
        """End a batch in `status` in one transaction: the lines not done (with `unfinished`:
        their error line from (line number, custom_id)) recorded as failed, the output file
        (the lines that succeeded) and the error file (the others) written in input order,
        and the batch's status, time and files set."""
        now = int(time.time() if now is None else now)
        with self._tx("writing the batch's output files") as db:
            if unfinished is not None:
                left = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id = ? AND "
                                  "state != ? ORDER BY idx", (batch_id, DONE)).fetchall()
                db.executemany("UPDATE lines SET state = ?, ok = 0, result = ? WHERE batch_id = ? "
                               "AND idx = ?", [(DONE, unfinished(idx, cid), batch_id, idx)
                                               for idx, cid in left])
                db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?",
                           (len(left), batch_id))
            files = {}
            for ok, kind in ((1, "output"), (0, "error")):
                results = [r[0] for r in db.execute(
                    "SELECT result FROM lines WHERE batch_id = ? AND state = ? AND ok = ? ORDER "
                    "BY idx", (batch_id, DONE, ok))]
                if results:
                    files[kind] = new_id("file-")
                    _insert_file(db, files[kind], "batch_output", f"{batch_id}_{kind}.jsonl",
                                 ("\n".join(results) + "\n").encode(), len(results), batch_id,
                                 now)
            when = STATUS_TIME[status]
            db.execute(f"UPDATE batches SET status = ?, {when} = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?",
                       (status, now, files.get("output"), files.get("error"), batch_id))
        return self.batch(batch_id) or {}


def _insert_file(db: sqlite3.Connection, file_id: str, purpose: str, filename: str,
                 content: bytes, lines: int | None, batch_id: str | None,
                 now: float | None) -> None:
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, lines, batch_id, "
               "content) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (file_id, purpose, filename, len(content), int(time.time() if now is None else now),
                lines, batch_id, sqlite3.Binary(content)))
