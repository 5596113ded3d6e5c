"""SIGTERM drains the server instead of cutting its streams.

uvicorn's own SIGTERM handling closes the listening socket and sse-starlette ends every stream
at once (mid-chunk: no finish_reason, no [DONE]). We take SIGTERM first:
1. stop admitting: new API requests get 503 with Retry-After (server/http/edge.py), /health answers
   503 "draining" so a load balancer stops routing here; the socket stays open meanwhile;
2. running requests finish, for up to `seconds` (PAGEDLLAMA_DRAIN_SECONDS);
3. what still runs is ended: a stream gets a final SSE error event and [DONE], a non-streamed
   request a 503 error body;
4. the signal goes on to uvicorn's handler, which shuts down as usual and exits.
A second SIGTERM skips what is left of the wait. SIGINT (Ctrl-C) stays uvicorn's: immediate.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("pagedllama.server")
LAST_EVENTS_SECONDS = 5.0   # after ending what still runs: its last events and [DONE] go out
SHUTDOWN_MESSAGE = "The server is shutting down; the request was ended before it finished."


class Drain:
    def __init__(self, seconds: float, end_all: Callable[[str], int]):
        self.seconds = seconds
        self.end_all = end_all           # ends every running request; returns how many
        self.draining = False
        self.active = 0                  # API requests in flight (counted by server/http/edge.py)
        self.retry_after = str(max(1, round(seconds)))
        self._previous = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def install(self) -> bool:
        """Take SIGTERM (only possible on the main thread, as under uvicorn)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return True

    def uninstall(self) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum, frame) -> None:
        self._loop.call_soon_threadsafe(self.begin)

    def begin(self) -> None:
        if self.draining:
            self._hurry.set()
            return
        self.draining = True
        log.info("SIGTERM: draining (%d request(s) running; up to %.0f s)", self.active,
                 self.seconds)
        self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self._wait_idle(self.seconds)
        ended = self.end_all(SHUTDOWN_MESSAGE)
        if ended:
            log.warning("drain: ended %d request(s) still running", ended)
        await self._wait_idle(LAST_EVENTS_SECONDS)
        log.info("drain: done, shutting down")
        self._exit()

    async def _wait_idle(self, seconds: float) -> None:
        deadline = self._loop.time() + seconds
        while self.active > 0 and not self._hurry.is_set():
            left = deadline - self._loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._hurry.wait(), min(left, 0.05))
            except TimeoutError:
                pass

    def _exit(self) -> None:
        previous = self._previous if self._previous is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)
        else:
            signal.raise_signal(signal.SIGTERM)
