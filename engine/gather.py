"""Waiting a moment for the rest of a wave before a step is planned.

After k requests end in one step, their clients' next requests come back together but one by
one over some milliseconds (each is parsed and tokenized first); a step planned at the first
would start it alone and split the wave (scheduler/scheduler.py, docs/scheduling.md). So once
one is here, and while they would make a wave, the worker waits for k (until GATHER_S after
those ended), and for any prompt still being prepared (from the first request on, at most
GATHER_S), but never longer than GATHER_GAP_S after the last arrival: behind a router, or when
clients stop, they may not come here. Only the few streams beside a wave wait on this; a request
that comes alone expects none.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from scheduler import Scheduler

GATHER_S = 0.25       # how long after requests ended together a step waits for the next ones
GATHER_GAP_S = 0.05   # and at most how long after the last of them came


class WaveGather:
    """Used by one worker thread: `expect` after a step, `wait` before the next plan."""

    def __init__(self, scheduler: Scheduler, wakeup: threading.Event,
                 drain_inbox: Callable[[], None]):
        self.scheduler, self.wakeup, self.drain_inbox = scheduler, wakeup, drain_inbox
        # how many requests for this model are having their prompt prepared now (set by the
        # service): a step that starts a burst of prompts waits for them
        self.incoming: Callable[[], int] = lambda: 0
        self._expect = (0, 0.0)   # requests that ended together, and until when

    def expect(self, ended: int) -> None:
        """`ended` requests finished in one step: their next ones may come as a wave."""
        if ended > 1:
            self._expect = (ended, time.monotonic() + GATHER_S)

    def wait(self) -> None:
        waiting, scheduler = self.scheduler.waiting, self.scheduler
        if not waiting:
            return
        (expect, until), self._expect = self._expect, (0, 0.0)
        now = time.monotonic()
        if now >= until:
            expect, until = 0, now + GATHER_S
        decoding = sum(1 for s in scheduler.running if s.is_decoding)
        if not scheduler.is_wave(decoding, max(expect - len(waiting), self.incoming())):
            return
        last = now   # the last arrival: a wave still coming in has no long gaps
        while len(waiting) < expect or self.incoming():
            left = min(until, last + GATHER_GAP_S) - time.monotonic()
            if left <= 0 or not self.wakeup.wait(left):
                return
            self.wakeup.clear()
            before = len(waiting)
            self.drain_inbox()
            if len(waiting) > before:
                last = time.monotonic()
