"""A request holds the models it uses until its HTTP exchange ends.

`Service.get` takes a lease on the model a request names (server/service/catalog.py: a model
with leases is never unloaded) and records it in the request's ASGI scope; `ModelLeases`, an
ASGI middleware around the app, releases the request's leases when the app has answered it,
streamed answers included, however the exchange ended (finished, refused, failed or
disconnected)."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from server.service.catalog import Lease

SCOPE_KEY = "pagedllama.model_leases"


class ModelLeases:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Lease] = []
        scope[SCOPE_KEY] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()


def hold(scope: Scope, lease: Lease) -> None:
    """Keep a lease until the request's exchange ends. Outside the middleware (a request made
    in-process without it) the lease is released at once: nothing would release it later."""
    leases = scope.get(SCOPE_KEY)
    if leases is None:
        lease.release()
    else:
        leases.append(lease)
