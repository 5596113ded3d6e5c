"""The HTTP client of a request, as the service sees it (server/service/client.py): whether it
has disconnected, the model leases its request holds until the exchange ends, and its method and
path for the request log.

`ModelLeases`, an ASGI middleware around the app, keeps the leases a request takes in its scope
and releases them when the app has answered it, streamed answers included, however the exchange
ended (finished, refused, failed or disconnected)."""
from __future__ import annotations

from typing import Protocol

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

SCOPE_KEY = "pagedllama.model_leases"


class Releasable(Protocol):
    def release(self) -> None: ...


class ModelLeases:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Releasable] = []
        scope[SCOPE_KEY] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()


class HTTPClient:
    """The client of one HTTP request."""

    def __init__(self, http: Request):
        self.http = http

    async def is_disconnected(self) -> bool:
        return await self.http.is_disconnected()

    def hold(self, lease: Releasable) -> None:
        """Keep a lease until the exchange ends. Outside the middleware (an app made in-process
        without it) the lease is released at once: nothing would release it later."""
        leases = self.http.scope.get(SCOPE_KEY)
        if leases is None:
            lease.release()
        else:
            leases.append(lease)

    def log_name(self) -> str:
        return f"{self.http.method} {self.http.url.path}"

    def log_notes(self) -> str:
        return ""
