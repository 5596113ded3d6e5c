"""Server-sent events: sse-starlette's response (keep-alive pings, client disconnect, server
shutdown) with a lighter path for each message.

A stream sends one message per generated token, on the event loop, while llama.cpp computes on
every core: whatever the loop spends per message is taken from a llama.cpp thread. So messages
are encoded here, once, straight to bytes (sse-starlette passes bytes through; a dict or str
would go through its ServerSentEvent encoder, a regex split and a StringIO per message), and
without a send timeout a message is sent as it is rather than inside an anyio cancel scope
that would never fire.
"""
from __future__ import annotations

import json
import re

from sse_starlette.sse import EventSourceResponse

_LINES = re.compile(r"\r\n|\r|\n")
# NEL, LS and PS: not line ends in SSE, but Python's str.splitlines breaks lines at them, and so
# do SSE readers built on it (httpx's iter_lines, and so guidellm): escaped in JSON data
_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def json_data(obj) -> str:
    """JSON for a data line: UTF-8 as it is (json.dumps, ensure_ascii=False), except NEL, LS and
    PS, which are escaped (the same JSON value) so that no client splits the line at them."""
    text = json.dumps(obj, ensure_ascii=False)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        text = text.translate(_BREAKS)
    return text


def message(data: str, event: str | None = None) -> bytes:
    """One SSE message: `event: …` (optional), `data: …`, a blank line. JSON from json.dumps
    has no line breaks; other data with line breaks becomes several data lines."""
    head = f"event: {_LINES.sub('', event)}\n" if event is not None else ""
    if "\n" in data or "\r" in data:
        body = "".join(f"data: {line}\n" for line in _LINES.split(data))
    else:
        body = f"data: {data}\n"
    return (head + body + "\n").encode("utf-8")


class EventStream(EventSourceResponse):
    """The SSE response of every streaming route: a ping comment every 15 s, LF line ends."""

    def __init__(self, content, status_code: int = 200, **kwargs):   # (FastAPI's OpenAPI
        kwargs.setdefault("ping", 15)                                 # reads status_code here)
        kwargs.setdefault("sep", "\n")
        super().__init__(content, status_code=status_code, **kwargs)

    async def _send_with_timeout(self, send, message) -> None:
        # sse-starlette (3.7) wraps every send in anyio.move_on_after(send_timeout), a cancel
        # scope per message even when the timeout is None. Without a timeout, send directly.
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)
