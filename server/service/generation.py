"""One request on its way through the engine and back: `Generation` (what `Service.generate`
returns) streams its events (`stream`) or runs it to its end (`collect`). Each choice's last
event is a `Final`: its finish reason, usage, stop string and timings, so that no answer shape
reads the engine's request. Leaving early (the client went away, the stream was cancelled)
cancels every choice in the engine, which frees their KV; a drain ends what runs (`Running`).
Each request ends with one line in the request log."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from engine import ErrorKind, Event, Request, Worker
from engine.logprobs import TokenLogprob
from scheduler import FinishReason
from server.errors import APIError
from server.service.client import Client
from server.service.loading import LoadedModel

log = logging.getLogger("pagedllama.request")
SHUTDOWN = FinishReason.ABORT   # the finish reason of a request a drain ended (ErrorKind.SHUTDOWN)
_ERROR_STATUS = {ErrorKind.ENGINE: 500, ErrorKind.INVALID: 400, ErrorKind.SHUTDOWN: 503}


class Outcome(StrEnum):
    """How a request's generation ended, for its log line."""
    OK = "ok"                        # every choice finished
    DISCONNECTED = "disconnected"    # the client went away: its choices were cancelled
    SHUTDOWN = "shutdown"            # a drain ended it
    ERROR = "error"                  # the engine failed it


class Part(NamedTuple):
    """One prompt of a request: the context (worker) it runs on and its first choice (the other
    n - 1 are its forks, `req.group`)."""
    worker: Worker
    req: Request


@dataclass(frozen=True)
class Usage:
    """Token counts: the prompt's, the generated ones, and the prompt's taken from the cache."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Final(Event):
    """A choice's last event: with its finish reason (and error, if one ended it), its usage,
    the stop string that ended it, whether it filled the context, and its timings."""
    usage: Usage = Usage()
    stop_string: str | None = None
    context_full: bool = False       # the prompt and answer fill the model's context
    ttft_s: float | None = None      # from arrival to the first token
    total_s: float | None = None     # from arrival to the end


@dataclass
class Collected:
    """One choice run to its end, not streamed."""
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob]
    index: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    usage: Usage = Usage()
    stop_string: str | None = None
    context_full: bool = False
    ttft_s: float | None = None      # as its Final's
    total_s: float | None = None


def error_status(event: Event) -> tuple[int, str]:
    """The HTTP status and error code of an event that carries an error."""
    kind = event.error_kind or ErrorKind.ENGINE
    return _ERROR_STATUS[kind], kind.value


@dataclass(eq=False)
class Live:
    """A request's engine requests (every choice of every prompt: forks too) handed to workers
    and not yet answered (what a drain ends)."""
    choices: list[Part]
    finished: set[int] = field(default_factory=set)   # choice indices whose last event came


class Running:
    """The requests under way, which a drain ends."""

    def __init__(self) -> None:
        self.live: set[Live] = set()
        self.closing = False      # set once a drain has ended what ran: nothing new starts
        self.shutdown_message = ""

    def end_all(self, message: str) -> int:
        """End every running request now (the end of a drain): each choice of each gets a final
        error event (503 `server_shutting_down`) and is cancelled in its engine. Returns how
        many requests."""
        self.closing, self.shutdown_message = True, message
        live = list(self.live)
        for item in live:
            self.end(item)
        return len(live)

    def end(self, item: Live) -> None:
        """Every choice not yet finished gets its final error event and is cancelled."""
        for worker, r in item.choices:
            if r.index not in item.finished:
                r.queue.put_nowait(Event(error=self.shutdown_message, finish_reason=SHUTDOWN,
                                         error_kind=ErrorKind.SHUTDOWN, index=r.index))
                worker.cancel(r)


@dataclass(eq=False)
class Generation:
    """One request on its way through the engine: the model, per prompt the context (worker)
    and engine request (with its forks when n > 1; their events share one queue), and the
    client it answers (for disconnects and the log line)."""
    lm: LoadedModel
    parts: list[Part]
    client: Client
    running: Running
    ignored_tools: tuple[str, ...] = ()   # named in the request log

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return len(self.parts[0].req.group)

    def usage(self) -> Usage:
        """The usage so far: every prompt counts once, every choice's (fork's) completion
        tokens count."""
        reqs = [part.req for part in self.parts]
        return Usage(sum(len(r.prompt) for r in reqs),
                     sum(c.num_output for r in reqs for c in r.group),
                     sum(r.num_cached for r in reqs))

    @property
    def admitted(self) -> bool:
        """Whether the engine has opened the (first) request: its cache hit is known."""
        seq = self.parts[0].req.state.seq
        return seq is not None and seq.alloc is not None

    def prompt_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The prompt logprobs of choice `index` (its prompt's first choice computed them)."""
        return self.parts[index // self.n].req.state.prompt_logprobs

    def stream(self) -> AsyncIterator[Event]:
        """The engine events as they come (text pieces, then per choice a `Final`), of every
        choice (Event.index)."""
        return self._events(poll_disconnect=False)

    async def collect(self) -> list[Collected]:
        """Run the request to its end, not streamed: per choice its whole text, finish reason
        and logprobs (when asked). Raises APIError 500 on an engine error, 503 when a drain
        ended it, and 499 if the client went away."""
        out = {r.index: Collected("", None, [], r.index) for part in self.parts
               for r in part.req.group}
        texts: dict[int, list[str]] = {i: [] for i in out}
        async for event in self._events(poll_disconnect=True):
            if event.error:   # 500 engine_error, or 503 when a drain ended it
                status, code = error_status(event)
                raise APIError(status, event.error, code)
            c = out[event.index]
            texts[event.index].append(event.text)
            c.logprobs += event.logprobs or []
            c.finish_reason = event.finish_reason
            if isinstance(event, Final):
                c.usage, c.stop_string = event.usage, event.stop_string
                c.context_full = event.context_full
                c.ttft_s, c.total_s = event.ttft_s, event.total_s
        if any(c.finish_reason is None for c in out.values()):   # client went away
            raise APIError(499, "client disconnected", "client_disconnected")
        for i, c in out.items():
            c.text = "".join(texts[i])
            c.prompt_logprobs = self.prompt_logprobs(i)
        return [out[i] for i in sorted(out)]

    def _final(self, event: Event, r: Request) -> Final:
        state, arrival = r.state, r.arrival_time
        return Final(**vars(event), usage=Usage(len(r.prompt), r.num_output, r.num_cached),
                     stop_string=r.stop_string,
                     context_full=len(r.prompt) + r.num_output >= self.lm.max_seq_len,
                     ttft_s=state.first_token_time - arrival if state.first_token_time else None,
                     total_s=state.finish_time - arrival if state.finish_time else None)

    async def _events(self, poll_disconnect: bool) -> AsyncIterator[Event]:
        """The events of every choice (they share one queue) until each has finished."""
        outcome, next_check = Outcome.OK, time.monotonic() + 0.5
        choices = [Part(worker, r) for worker, req in self.parts for r in req.group]
        by_index = {r.index: r for _, r in choices}
        queue = self.parts[0].req.queue
        live = Live(choices)
        self.running.live.add(live)
        if self.running.closing:          # submitted just before a drain ended everything
            self.running.end(live)
        try:
            while len(live.finished) < len(choices):
                if poll_disconnect:   # nothing is being sent: ask about the client
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + 0.5
                        if await self.client.is_disconnected():
                            outcome = Outcome.DISCONNECTED
                            return
                    try:
                        event = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except TimeoutError:
                        continue
                else:
                    event = await queue.get()
                if event.index in live.finished:
                    continue   # a choice a drain ended, whose own events were on their way
                if event.error:
                    outcome = (Outcome.SHUTDOWN if event.error_kind is ErrorKind.SHUTDOWN
                               else Outcome.ERROR)
                if event.finish_reason:
                    live.finished.add(event.index)
                    event = self._final(event, by_index[event.index])
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if outcome is Outcome.OK:
                outcome = Outcome.DISCONNECTED
            raise
        finally:
            self.running.live.discard(live)
            for worker, r in choices:
                if r.finish_reason is None or outcome is Outcome.DISCONNECTED:
                    worker.cancel(r)
            self._log(outcome)

    def _log(self, outcome: Outcome) -> None:
        now, (worker, req), parts = time.monotonic(), self.parts[0], self.parts
        choices = [r for _, p in parts for r in p.group]
        first = req.state.first_token_time
        ttft = f"{first - req.arrival_time:.3f}s" if first else "-"
        drafted = sum(r.num_drafted for r in choices)
        spec = (f" drafted={drafted} accepted={sum(r.num_accepted for r in choices)}"
                if drafted else "")
        seq = req.state.seq
        steps = seq.prompt_steps if seq is not None else 0
        cached = sum(p.num_cached for _, p in parts)
        tier = seq.cached_tier if seq is not None and cached else "kv"
        ignored = self.ignored_tools
        log.info("%s %s model=%s prompt=%d cached=%d%s prompt_steps=%d completion=%d%s%s "
                 "ttft=%s total=%.3fs finish=%s%s%s", self.client.log_name(), outcome,
                 worker.name, sum(len(p.prompt) for _, p in parts), cached,
                 f" cached_from={tier}" if cached else "", steps,
                 sum(r.num_output for r in choices),
                 spec,
                 f" choices={len(choices)}" if len(choices) > 1 else "", ttft,
                 now - req.arrival_time, req.finish_reason or "cancelled",
                 f" ignored_tools={','.join(ignored)}" if ignored else "",
                 self.client.log_notes())
