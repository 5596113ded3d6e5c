"""The HTTP edge, before any route runs: draining, the API key, the body's size and read time.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects). For each
HTTP request, in order, without parsing anything:
1. while the server drains (SIGTERM), a new API request is a 503 with Retry-After;
2. a route that needs the API key and lacks it is a 401 (constant-time compare), body unread;
   the key comes as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
   (Anthropic's);
3. a Content-Length over the body limit is a 413, body unparsed;
4. the body is read with a timeout per read (408 when a client sends less than it announced)
   and a running size check (413 for chunked bodies), then replayed to the app.
The body limit is PAGEDLLAMA_MAX_BODY_BYTES, except on POST /v1/files (the Batch API's
uploads), whose limit is the batch file limit (PAGEDLLAMA_BATCH_MAX_FILE_BYTES) plus room for
the multipart framing.
A body left unread by a refusal is discarded by uvicorn's h11 protocol (the connection stays
open, no reset), under server/http/protocol.py's time limits. API requests are counted while they
run, so the drain knows when they are done. A refusal comes in the shape of the API the path
belongs to (server/http/errors.py).
"""
from __future__ import annotations

import asyncio
import hmac
import json

from server.http.errors import anthropic_error, error_body, is_anthropic, is_ollama, ollama_error
from server.http.limits import EdgeLimits

OBSERVABILITY = ("/metrics", "/stats", "/dashboard", "/docs", "/docs/oauth2-redirect", "/redoc",
                 "/openapi.json")


# Outside /v1/: the other routes behind PAGEDLLAMA_API_KEY (native generation, llama-server's
# tokenizer routes, loading and unloading models: /models/..., Ollama's /api/...). /health and
# the router probes (server/api/router_info.py) are not API routes: open, never refused while
# draining (a load balancer reads /health's "draining").
NATIVE_API = frozenset({"/generate_stream", "/tokenize", "/detokenize"})


def is_api(path: str) -> bool:
    """Routes that need the API key, are refused while draining, and are counted by the drain."""
    return path.startswith(("/v1/", "/models/", "/api/")) or path in NATIVE_API


def needs_key(path: str, key: str | None, limits: EdgeLimits) -> bool:
    if not key:
        return False
    return is_api(path) or (limits.protect_metrics and path in OBSERVABILITY)


def authorized(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """`Authorization: Bearer KEY` or `x-api-key: KEY` (either one right is enough)."""
    return key_matches(bearer_token(headers), key) or key_matches(header(headers, b"x-api-key"),
                                                                  key)


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for n, value in headers if n == name), None)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    # the scheme is case-insensitive (RFC 7235: "bearer" is "Bearer")
    scheme, _, token = (header(headers, b"authorization") or b"").partition(b" ")
    return token if scheme.lower() == b"bearer" else None


def key_matches(given: bytes | None, key: str) -> bool:
    """Compared in constant time."""
    return given is not None and hmac.compare_digest(given, key.encode())


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


UPLOADS = "/v1/files"   # POST: a file upload, under its own body limit


def body_limit(scope, limits: EdgeLimits) -> tuple[int, str]:
    """The body limit of a request, and the setting that sets it."""
    if scope["path"] == UPLOADS and scope.get("method") == "POST":
        return limits.max_upload_bytes, "PAGEDLLAMA_BATCH_MAX_FILE_BYTES"
    return limits.max_body_bytes, "PAGEDLLAMA_MAX_BODY_BYTES"


async def read_body(receive, limits: EdgeLimits, max_bytes: int | None = None) -> bytes:
    max_bytes = limits.max_body_bytes if max_bytes is None else max_bytes
    parts, size, more = [], 0, True
    while more:
        message = await asyncio.wait_for(receive(), limits.read_timeout)
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        parts.append(chunk)
        more = message.get("more_body", False)
    return b"".join(parts)


def replay(body: bytes, receive):
    """A receive that gives the body once, then waits on the real one (for disconnects)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receive_again


async def respond(send, status: int, message: str, code: str, headers: dict | None = None,
                  path: str = "") -> None:
    if is_anthropic(path):
        status, body = anthropic_error(status, message)
    elif is_ollama(path):
        body = ollama_error(message)
    else:
        body = error_body(status, message, code)
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    value = next((v for name, v in headers if name == b"content-length"), None)
    return int(value) if value is not None and value.isdigit() else None


class Edge:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = getattr(scope.get("app"), "state", None)
        settings = getattr(state, "settings", None)
        if scope["type"] != "http" or settings is None:
            return await self.app(scope, receive, send)
        drain, limits, path = state.drain, settings.edge, scope["path"]
        api = is_api(path)
        if api and drain.draining:
            return await respond(send, 503, "The server is shutting down; retry on another "
                                 "instance.", "server_shutting_down",
                                 {"Retry-After": drain.retry_after}, path)
        if needs_key(path, settings.api_key, limits) and not authorized(scope["headers"],
                                                                        settings.api_key):
            return await respond(send, 401, "invalid or missing API key", "invalid_api_key",
                                 {"WWW-Authenticate": "Bearer"}, path)
        length = content_length(scope["headers"])
        if length is not None and length > body_limit(scope, limits)[0]:
            return await respond(send, 413, _too_large(scope, limits), "request_too_large",
                                 path=path)
        drain.active += api
        try:
            await self._read_then_call(scope, receive, send, limits)
        finally:
            drain.active -= api

    async def _read_then_call(self, scope, receive, send, limits: EdgeLimits) -> None:
        try:
            body = await read_body(receive, limits, body_limit(scope, limits)[0])
        except ClientGone:
            return
        except BodyTooLarge:
            return await respond(send, 413, _too_large(scope, limits), "request_too_large",
                                 path=scope["path"])
        except TimeoutError:
            return await respond(send, 408, f"the request body did not arrive within "
                                 f"{limits.read_timeout:g} s", "request_timeout",
                                 {"Connection": "close"}, scope["path"])
        await self.app(scope, replay(body, receive), send)


def _too_large(scope, limits: EdgeLimits) -> str:
    limit, setting = body_limit(scope, limits)
    return f"The request body is larger than this server accepts ({limit} bytes, {setting})."
