"""uvicorn's h11 protocol with the connection limits it lacks.

uvicorn (0.54, h11) waits forever for a request head that trickles in, never closes a
connection that sends nothing (its keep-alive timer starts only after a first response), and
answers a head over h11's size limit with a 400 and an immediate close, which the client sees
as a reset while it is still sending. This subclass:
- closes a connection that sends nothing for `keepalive_timeout`, from the start;
- answers 408 and closes when a request head is not complete `read_timeout` after its first
  byte (slowloris), and closes a connection still sending a body `read_timeout` after its
  answer went out;
- answers 431 when the head exceeds `max_header_bytes`, then reads and drops what the client
  still sends until it closes (at most `read_timeout`), so the client reads the 431 instead of
  a reset.

Installed from the app's lifespan (`install`), so plain `uvicorn server.main:app` gets it; the
body's own read timeout and size limit are in server/http/edge.py, where they need no uvicorn.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.limits import EdgeLimits

log = logging.getLogger("pagedllama.server")


class EdgeProtocol(H11Protocol):
    limits = EdgeLimits()          # set by install()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = h11.Connection(h11.SERVER,
                                   max_incomplete_event_size=self.limits.max_header_bytes)
        self.timeout_keep_alive = self.limits.keepalive_timeout
        self._read_timer: asyncio.TimerHandle | None = None
        self._head_status: int | None = None
        self._lingering = False
        parse = self.conn.next_event

        def next_event():
            try:
                return parse()
            except h11.RemoteProtocolError as exc:
                self._head_status = exc.error_status_hint
                raise
        self.conn.next_event = next_event

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._read_timer is None and self._waiting_for_client():
            self._read_timer = self.loop.call_later(self.limits.read_timeout, self._read_timeout)
        super().data_received(data)
        if self._read_timer is not None and not self._waiting_for_client():
            self._cancel_read_timer()

    def _waiting_for_client(self) -> bool:
        """A request head being received, or a body the app no longer reads (answered)."""
        their, ours = self.conn.their_state, self.conn.our_state
        return their is h11.IDLE or (their is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE))

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            self._send_plain(408, b"Request Timeout", b"request head not received in time")
        self.transport.close()

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def send_400_response(self, msg: str) -> None:
        if self._head_status != 431:
            return super().send_400_response(msg)
        self._send_plain(431, b"Request Header Fields Too Large",
                         b"request line and headers exceed %d bytes" % self.limits.max_header_bytes)
        self._linger()

    def _send_plain(self, status: int, reason: bytes, body: bytes) -> None:
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                             reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass

    def _linger(self) -> None:
        """Close our side, keep reading (and dropping) until the client closes or time is up."""
        self._lingering = True
        self._cancel_read_timer()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.limits.read_timeout, self.transport.close)


def uvicorn_server():
    """The running uvicorn Server, found as sse-starlette finds it: uvicorn installs its bound
    handle_exit as the SIGTERM handler while it serves. None when not under uvicorn."""
    handler = signal.getsignal(signal.SIGTERM)
    server = getattr(handler, "__self__", None)
    return server if hasattr(server, "should_exit") and hasattr(server, "config") else None


def install(limits: EdgeLimits) -> bool:
    """Make the running uvicorn serve new connections with EdgeProtocol. uvicorn reads
    config.http_protocol_class for every connection, and the lifespan runs before it listens."""
    server = uvicorn_server()
    current = getattr(getattr(server, "config", None), "http_protocol_class", None)
    if current is None or not issubclass(current, H11Protocol):
        log.warning("HTTP connection limits not installed (not uvicorn's h11 protocol: %s); "
                    "body limits and timeouts still apply", current)
        return False
    EdgeProtocol.limits = limits
    server.config.http_protocol_class = EdgeProtocol
    return True
