"""Contention-aware thread counts: fewer llama.cpp threads while other processes keep our cores
busy, all of them again when they leave.

Why (docs/shared-machines.md, "Why a busy neighbour stalls llama.cpp"): llama.cpp's threads
meet at a barrier after every graph op. When one of them shares its core with another runnable
thread, the kernel deschedules it for a whole time slice and every other thread waits at the
next barrier: next to ONE busy process, 2 threads on 2 cores keep ~1 % of their speed, while 1
thread keeps all of its own. One thread has no barriers.

The signal is how much CPU *other* processes use on the cores we may run on: the machine's busy
time on those cores (/proc/stat) minus this process's own CPU time (/proc/self/stat), per window.
It works in both directions, which the alternatives do not: our step time or our threads'
run-queue delay show a neighbour arriving, but with one thread neither changes when it leaves.

Policy (ThreadGovernor, pure arithmetic on recorded figures so that it is unit-tested without a
clock): the cores left to this process are `cores - others`; a context may use
`floor(left * share + margin)` threads (share: its part of the process's threads), at least 1,
at most what it was configured with. Going down takes `down_windows` windows in a row (two:
half a second of a burst, e.g. a benchmark client starting its next level, costs little at
either thread count, but dropping for it cost 1-3 s on fewer threads each time); when a window's
figure leaves no doubt (others beyond the threshold by `sure` cores more), one window is enough.
Going up takes `up_windows` windows in a row (so a neighbour that pauses briefly does not make
us flap). Only time in which the context computes counts: the worker pauses the governor
when it goes idle, so CPU others use while we wait for requests (a benchmark client preparing the
next one, another server answering its own) is no contention and does not cost the next request
a prefill on fewer threads; the thread count is kept across the pause.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU figures at one moment, in clock ticks (USER_HZ)."""
    time: float            # seconds (monotonic)
    busy: int              # busy ticks of the cores we may use, every process
    own: int               # this process's user + system ticks (all its threads)


@dataclass(frozen=True)
class ThreadChange:
    threads: int
    previous: int
    others: float          # cores other processes used over the window
    reason: str


class ThreadGovernor:
    """Decides a context's thread count from successive CPU samples."""

    def __init__(self, configured: int, cores: int, share: float = 1.0, margin: float = 0.5,
                 window: float = 0.5, up_windows: int = 2, down_windows: int = 2,
                 sure: float = 0.5, ticks_per_second: int = 100):
        self.configured, self.cores, self.share = configured, cores, share
        self.margin, self.window, self.up_windows = margin, window, up_windows
        self.down_windows, self.sure = down_windows, sure
        self.hz = ticks_per_second
        self.threads = configured
        self.others = 0.0                   # cores others used in the last window
        self._last: CpuSample | None = None
        self._up_votes = 0
        self._down_votes = 0
        self._acc_time = 0.0                # busy time of the window so far (across pauses)
        self._acc_others = 0                # others' ticks in that time
        self._idle: list[CpuSample] = []    # samples of the current idle time (idle_sample)

    def target(self, others: float) -> int:
        left = max(0.0, self.cores - others)
        return max(1, min(self.configured, math.floor(left * self.share + self.margin)))

    def due(self, now: float) -> bool:
        """Whether a new sample would complete a window (so /proc is read twice a second)."""
        return self._last is None or now - self._last.time + self._acc_time >= self.window

    def observe(self, sample: CpuSample) -> ThreadChange | None:
        """Feed a sample taken while the context computes; returns a change when the thread
        count should change now."""
        if self._last is None:   # the start of a window, or the end of a pause
            self._last = sample
            return self._resume(sample)
        self._add(sample)
        if self._acc_time < self.window:
            return None
        self.others = max(0.0, self._acc_others / (self._acc_time * self.hz))
        self._acc_time, self._acc_others = 0.0, 0
        return self._decide(self.target(self.others))

    def slowed(self, factor: float) -> ThreadChange | None:
        """A step took `factor` times what steps of its shape take lately: on a machine whose
        cores we share, what a neighbour that arrived does to threads that meet at barriers.
        One thread fewer at once, without waiting for the windows to say so; the windows then
        bring the threads back when the cores are free (as after any drop)."""
        if self.threads <= 1:
            return None
        previous = self.threads
        self.threads -= 1
        self._up_votes = self._down_votes = 0
        return ThreadChange(self.threads, previous, self.others,
                            f"a step took {factor:.0f}x its usual time")

    def pause(self, sample: CpuSample) -> None:
        """The context goes idle: keep the busy part of the window, ignore what follows until
        the next observe (which starts measuring again)."""
        if self._last is not None:
            self._add(sample)
            self._last = None

    def idle_sample(self, sample: CpuSample) -> None:
        """A sample taken while the context is idle (twice a second): what the machine did just
        before the next request is what decides, at that request, whether threads given up
        earlier come back (`_resume`)."""
        self._idle = [s for s in self._idle if sample.time - s.time < 2 * self.window]
        self._idle.append(sample)

    def _resume(self, sample: CpuSample) -> ThreadChange | None:
        """The context computes again after an idle time. Threads given up before it come back
        at once when the other processes left room for them in the last window of it: a drop
        must not outlive the neighbour that caused it through an idle time, into the first
        steps of the next request (a long prompt's first piece took 1.0 s instead of 0.5 on
        one thread, the neighbour gone for seconds). Never fewer threads from idle time: what
        others do between our requests (a benchmark client, say) is no contention."""
        idle, self._idle = self._idle, []
        start = next((s for s in reversed(idle) if sample.time - s.time >= self.window), None)
        if start is None or self.threads >= self.configured:
            return None
        seconds = sample.time - start.time
        others = max(0.0, ((sample.busy - start.busy) - (sample.own - start.own))
                     / (seconds * self.hz))
        target = self.target(others)
        if target <= self.threads:
            return None
        previous, self.threads = self.threads, target
        self._up_votes = self._down_votes = 0
        return ThreadChange(target, previous, others,
                            f"other processes used {others:.2f} of {self.cores} cores in the "
                            f"last {seconds:.1f} s before this request")

    def _add(self, sample: CpuSample) -> None:
        last = self._last
        assert last is not None, "a window was started"
        self._acc_time += sample.time - last.time
        self._acc_others += (sample.busy - last.busy) - (sample.own - last.own)
        self._last = sample

    def _decide(self, target: int) -> ThreadChange | None:
        previous = self.threads
        if target < previous:
            self._up_votes = 0
            self._down_votes += 1
            # a window whose excess is not beyond doubt asks for exactly one thread fewer
            # (sure <= 1 core), given after down_windows such windows in a row
            sure = self.target(self.others - self.sure)
            if sure < previous:                  # no doubt: at once, as far as is beyond doubt
                target = sure
            elif self._down_votes < self.down_windows:
                return None
            self._down_votes = 0
            self.threads = target
            return ThreadChange(target, previous, self.others,
                                f"other processes used {self.others:.2f} of {self.cores} cores")
        self._down_votes = 0
        if target > previous:
            self._up_votes += 1
            if self._up_votes >= self.up_windows:
                self._up_votes = 0
                self.threads = target
                return ThreadChange(target, previous, self.others,
                                    f"other processes now use {self.others:.2f} of "
                                    f"{self.cores} cores")
            return None
        self._up_votes = 0
        return None


class CpuMeter:
    """Reads CpuSample figures from /proc for the cores this process may run on (Linux)."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0))
        self.hz = os.sysconf("SC_CLK_TCK")
        self._names = {f"cpu{i}" for i in self.cpus}

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")

    def sample(self, now: float) -> CpuSample:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                if parts[0] in self._names:
                    # user nice system idle iowait irq softirq steal: busy = all but idle, iowait
                    v = [int(x) for x in parts[1:9]]
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])    # utime, stime (fields 14 and 15)
        return CpuSample(now, busy, own)


class CoreBudget:
    """Threads shared by the contexts of one process (elastic threads).

    Each context owns a share of the process's threads (config: cores split between contexts).
    A context that computes while every other one is idle may use all of them; as soon as
    another has work, each computes on its own share again. A context asks before each step
    (`acquire`) and hands the threads back after it (`release`), so the threads in use never
    exceed `total`: a context that needs threads another one still holds waits for the end of
    that step (at most one step), never computes beside it on shared cores (which would stall
    both at llama.cpp's barriers). `idle` marks a context without work.

    Why: one context with all the threads serves one request fastest; one 1-thread context per
    core serves many faster (no barriers between threads; docs/scaling-out.md, "One context
    or replicas on one machine"). Lending idle contexts' threads gives each load the better of
    the two."""

    def __init__(self, total: int):
        self.total = total
        self._cond = threading.Condition(threading.RLock())
        self._active: set[str] = set()
        self._in_use = 0

    def grant(self, name: str, share: int, cap: int) -> int:
        """Threads `name` may use now: up to `cap` alone, else its own share (never above cap)."""
        alone = self._active <= {name}
        return max(1, min(cap, self.total if alone else share))

    def acquire(self, name: str, share: int, cap: int) -> int:
        """Blocks until the threads this context may use are free; returns how many it took."""
        with self._cond:
            while (n := self.try_acquire(name, share, cap)) is None:
                self._cond.wait()
            return n

    def try_acquire(self, name: str, share: int, cap: int) -> int | None:
        """Marks `name` as having work and takes its threads if they are free (else None)."""
        with self._cond:
            self._active.add(name)
            n = self.grant(name, share, cap)
            if self._in_use + n > self.total:
                return None
            self._in_use += n
            return n

    def release(self, n: int) -> None:
        with self._cond:
            self._in_use -= n
            self._cond.notify_all()

    def idle(self, name: str) -> None:
        with self._cond:
            if name in self._active:
                self._active.discard(name)
                self._cond.notify_all()

    @property
    def in_use(self) -> int:
        return self._in_use


def own_share(cap: int, configured: int, share: float) -> int:
    """Threads a context computes with beside other busy contexts: its part (`share` of the
    process's threads) of the `cap` the governor leaves the process, at most its configured
    count, at least 1. On a quiet machine that is its configured count; while other processes
    use cores, the contexts' shares shrink together (as the governor scales them without a
    budget)."""
    return max(1, min(configured, math.floor(cap * share + 0.5)))
