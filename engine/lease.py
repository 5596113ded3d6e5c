"""A context's threads: how many it computes with now, and where they come from.

Two mechanisms decide it (engine/threads.py): the contention governor, which gives threads up
while other processes keep our cores busy (llama.cpp's threads meet at a barrier after every
op, so one thread sharing its core stalls all of them: docs/shared-machines.md), and, with
several contexts in the process, the CoreBudget they share (elastic threads: a context that
computes alone uses the idle ones' threads too). The lease applies both between decodes, the
only time llama.cpp lets the thread count change.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from engine.llama import Context
from engine.threads import CoreBudget, CpuMeter, ThreadGovernor, own_share

log = logging.getLogger("pagedllama.engine")
T = TypeVar("T")


class ThreadLease:
    """The threads of one context: the governor's figure, the budget's grant, and the count the
    context computes with (`current`). Used by the context's worker thread only."""

    def __init__(self, name: str, configured: int, share: float, adaptive: bool,
                 budget: CoreBudget | None):
        self.name, self.configured, self.budget = name, configured, budget
        self.share = share
        # the most threads this context may use: its own, or all of the budget's when it lends
        self.max_threads = budget.total if budget else configured
        self.meter = (CpuMeter() if adaptive and self.max_threads >= 2 and CpuMeter.available()
                      else None)
        # lending makes the whole process's threads this context's to use, so its share is all
        governed_share = 1.0 if budget else share
        self.governor = (ThreadGovernor(self.max_threads, len(self.meter.cpus), governed_share,
                                        ticks_per_second=self.meter.hz) if self.meter else None)
        self.current = configured    # what the context computes with now
        self.changes = 0

    @property
    def threads(self) -> int:
        """The most threads this context may use now (the governor's figure); with elastic
        threads it computes on fewer while other contexts have work (`current`)."""
        return self.governor.threads if self.governor else self.max_threads

    @property
    def other_cores(self) -> float | None:
        """Cores other processes used lately (None: not watched)."""
        return round(self.governor.others, 3) if self.governor else None

    def adapt(self, context: Context) -> None:
        """Between decodes: follow the governor's thread count."""
        now = time.monotonic()
        governor, meter = self.governor, self.meter
        if governor is None or meter is None or not governor.due(now):
            return
        change = governor.observe(meter.sample(now))
        if change is None:
            return
        if self.budget is None:   # else the next lease sets it
            self._set(context, change.threads)
        self.changes += 1
        log.info("engine %s: threads %d -> %d (%s)", self.name, change.previous, change.threads,
                 change.reason)

    def slowed(self, context: Context, factor: float) -> None:
        """A step took `factor` times its usual time (engine/threads.py, ThreadGovernor.slowed)."""
        if self.governor is None:
            return
        change = self.governor.slowed(factor)
        if change is None:
            return
        if self.budget is None:
            self._set(context, change.threads)
        self.changes += 1
        log.info("engine %s: threads %d -> %d (%s)", self.name, change.previous, change.threads,
                 change.reason)

    def run(self, context: Context, step: Callable[[], T]) -> T:
        """Run a step on the threads the budget grants now (all of this context's when there is
        no budget), and hand them back after it."""
        if self.budget is None:
            return step()
        cap = self.threads   # the governor's figure for the whole process
        n = self.budget.acquire(self.name, own_share(cap, self.configured, self.share), cap)
        try:
            if n != self.current:
                self._set(context, n)
            return step()
        finally:
            self.budget.release(n)

    def pause(self) -> None:
        """Going idle: what other processes do until the next request is no contention."""
        if self.governor is not None and self.meter is not None:
            self.governor.pause(self.meter.sample(time.monotonic()))
        if self.budget is not None:
            self.budget.idle(self.name)

    def idle_sample(self) -> None:
        """While idle: a CPU sample for the governor (ThreadGovernor.idle_sample)."""
        if self.governor is not None and self.meter is not None:
            self.governor.idle_sample(self.meter.sample(time.monotonic()))

    def idle(self) -> None:
        """The worker ends: it no longer keeps the other contexts on their own share."""
        if self.budget is not None:
            self.budget.idle(self.name)

    def in_use(self, has_work: bool) -> int:
        """The threads this context computes with; with elastic threads an idle context holds
        none (its next step takes what the budget grants then)."""
        return 0 if self.budget is not None and not has_work else self.current

    def _set(self, context: Context, n: int) -> None:
        context.set_threads(n)
        self.current = n
