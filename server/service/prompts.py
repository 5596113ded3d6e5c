"""Prompt preparation, bounded: a cheap lower bound on a text's token count, and a small pool of
threads for chat-template rendering and tokenization.

Why: llama.cpp's tokenizer is superlinear on text full of special-token strings (seconds for a
few hundred kilobytes of them: docs/api.md, "Hostile prompts cost little"), so a few such
prompts must neither delay other requests nor be tokenized at all when they cannot fit:
- `TokenBound` rejects a prompt that cannot fit without tokenizing it: each token covers at
  most its own text's length of input, so sum over the text's bytes of 1 / (longest token text
  holding that byte) is at most the token count (Model.byte_weights). One numpy pass.
- `PromptPool` runs the work on two lanes of one thread each: prompts up to `small_bytes` on
  one, longer ones on the other, so a normal prompt never queues behind a hostile one; each
  lane takes its cheapest job first, and a job whose request has gone (client disconnect) is
  dropped before it starts. Two threads at most, whatever arrives.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class TokenBound:
    """A lower bound on the number of tokens a text becomes (0 when the model gives none)."""

    def __init__(self, weights: np.ndarray | None):
        self.weights = weights

    def at_least(self, text: str) -> int:
        if self.weights is None or not text:
            return 0
        counts = np.bincount(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), minlength=256)
        return int(np.floor(counts @ self.weights + 1e-9))


@dataclass(order=True)
class _Job:
    cost: int
    order: int
    fn: Callable[[], Any] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)


class _Lane:
    """One thread running queued jobs, cheapest first."""

    def __init__(self, name: str):
        self.heap: list[_Job] = []
        self.ready = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, job: _Job) -> None:
        with self.ready:
            heapq.heappush(self.heap, job)
            self.ready.notify()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify()
        self.thread.join(timeout=5)

    @property
    def pending(self) -> int:
        return len(self.heap)

    def _next(self) -> _Job | None:
        with self.ready:
            while not self.heap and not self.closed:
                self.ready.wait()
            return None if self.closed else heapq.heappop(self.heap)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job.future.cancelled():      # its request went away while it waited
                continue
            try:
                result, error = job.fn(), None
            except BaseException as exc:      # handed to the awaiting request
                result, error = None, exc
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class PromptPool:
    def __init__(self, small_bytes: int = 32 * 1024):
        self.small_bytes = small_bytes
        self.small, self.large = _Lane("prompts-small"), _Lane("prompts-large")
        self._order = itertools.count()

    async def run(self, cost: int, fn: Callable[[], Any]) -> Any:
        """fn() on a lane thread (the small lane if cost <= small_bytes); cancelling the await
        drops the job if it has not started."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        lane = self.small if cost <= self.small_bytes else self.large
        lane.put(_Job(cost, next(self._order), fn, future, loop))
        return await future

    @property
    def pending(self) -> int:
        return self.small.pending + self.large.pending

    def close(self) -> None:
        self.small.close()
        self.large.close()
