"""Handing a step's events from the worker thread to the event loop without giving the loop the
GIL in the middle of the worker's step.

`loop.call_soon_threadsafe` queues the callback and wakes the loop by writing a byte to its
self-pipe with `socket.send`, which releases the GIL around the system call. The loop, woken by
that byte, takes the GIL at once and streams the step's tokens (SSE framing, h11, the socket
write) while the worker waits to get the GIL back before it can plan and start the next
`llama_decode`. `hand_over` queues the callback the same way but writes the byte through libc's
`write` called via `ctypes.PyDLL`, whose calls keep the GIL: the loop wakes, waits for the GIL,
and gets it when the worker releases it, i.e. when the next `llama_decode` starts (or the
worker goes idle). The loop's work then runs beside the decode instead of before it (the
measured effect: docs/measurement-log.md, "Where the hand-off's time goes").

Only asyncio's selector loops (its default; uvicorn runs one unless uvloop is installed) have
the self-pipe this uses; any other loop (uvloop) gets `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

# libc's write(2) through PyDLL: a foreign call that keeps the GIL (CDLL's calls release it)
_write_keeping_gil = ctypes.PyDLL(None).write
_write_keeping_gil.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
_write_keeping_gil.restype = ctypes.c_ssize_t


def hand_over(loop: asyncio.AbstractEventLoop, callback: Callable, arg) -> None:
    """Run callback(arg) on the loop, from another thread; the loop runs it once this thread
    next releases the GIL. RuntimeError when the loop is closed, as call_soon_threadsafe."""
    csock = getattr(loop, "_csock", None)
    if csock is None or not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
        loop.call_soon_threadsafe(callback, arg)
        return
    loop._check_closed()   # type: ignore[attr-defined]  # asyncio's own, as call_soon_threadsafe
    loop._call_soon(callback, (arg,), None)   # type: ignore[attr-defined]
    # non-blocking: a full pipe (-1, EAGAIN) means the loop has wake-ups pending already
    _write_keeping_gil(csock.fileno(), b"\0", 1)
