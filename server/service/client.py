"""What the service needs from whoever asked for a request: whether they are still there, a
place to keep the request's hold on its model until the exchange ends, and how the request log
names the request. The HTTP edge's client (server/http/client.py) and a Batch API line
(server/batch/runner.py) are both one; the service knows neither."""
from __future__ import annotations

from typing import Protocol


class Releasable(Protocol):
    """A hold on a model (server/service/catalog.py: Lease)."""

    def release(self) -> None: ...


class Client(Protocol):
    """Whoever asked for a request, as the service sees them."""

    async def is_disconnected(self) -> bool:
        """Whether they have gone (a client that disconnected, a batch line cancelled)."""
        ...

    def hold(self, lease: Releasable) -> None:
        """Keep `lease` until the exchange ends (the answer sent, however it ended)."""
        ...

    def log_name(self) -> str:
        """How the request log names the request: its method and path ("POST /v1/…")."""
        ...

    def log_notes(self) -> str:
        """What the request log line adds at its end (" batch=ID#LINE"; "" for nothing); the
        service asks once, as it writes the line."""
        ...
