"""What the Batch API's runner holds in memory of the batches it works on: each batch not yet
ended (`Active`: its row, the pending lines fetched from the store, the lines running), each
line fetched (`Line`), and the client a running line runs for (`LineClient`).

Apart from the runner (server/batch/runner.py) because both halves of it use them: what the
routes ask (server/batch/access.py: a new batch becomes an `Active`, a cancelled one is marked
on it) and the loop that runs the lines. The store (server/batch/store.py) holds what is
durable; these records only what the process does with it now.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from server.service.catalog import Entry, Lease
from server.service.client import Releasable


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
