"""A context's request output: what becomes of each token sampled for a request, and how a
request ends. The worker (engine/worker.py) calls it from its step loop, on its own thread.

`sample_call` and `verify_call` take a decode call's chunks (every one that wants logits is
sampled, then every verification piece verified: engine/speculation.py), `sample` samples a
request's next token from a row of the step's logits, `emit` appends a
token and reads its logprobs, `prompt_logprobs` scores the prompt tokens a chunk predicts,
`finish` ends a request for any reason, `failed` ends one whose own step raised. Each returns
the request's event for the step's hand-off (a `Delivery`), or writes into its state.

Invariants:
- A sampled token is appended, and checked against the request's stop conditions (end of
  generation, stop strings, max_tokens, the context's length), in one place (`append`): plain
  sampling and the verification of drafts (engine/speculation.py) go through it alike.
- `finish` is the one way a request ends, whatever ends it: it releases the sequence (its KV
  frees become the block manager's ops), the request's drafts and sampler, and counts it in
  `finished` (the worker calls it once a request).
- Logprobs are read from the logits before the next decode overwrites them, and only for
  requests that ask.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.llama import Context
from engine.logprobs import TokenLogprob, token_logprob
from engine.model import Model
from engine.request import ErrorKind, Event, Request
from engine.speculation import Speculation
from scheduler import Chunk, FinishReason, Scheduler, Status

log = logging.getLogger("pagedllama.engine")

Delivery = tuple[Request, Event]


class Output:
    """The requests' output of one context; `finished` counts the requests it ended."""

    def __init__(self, name: str, model: Model, context: Context, scheduler: Scheduler,
                 speculation: Speculation, max_seq_len: int,
                 on_token: Callable[[Request, float], None],
                 on_finish: Callable[[Request], None]):
        """`on_token`, `on_finish`: the metrics hooks, for each token appended and each request
        ended."""
        self.name, self.model, self.context = name, model, context
        self.scheduler, self.speculation, self.max_seq_len = scheduler, speculation, max_seq_len
        self.on_token, self.on_finish = on_token, on_finish
        self.finished = 0

    def sample(self, req: Request, index: int, now: float) -> Delivery:
        seq, sampler = req.state.seq, req.state.sampler
        assert seq is not None and sampler is not None, "an admitted request"
        if seq.max_tokens == 0:   # scoring only (echo): the prompt's logprobs were the point
            return self.finish(req, FinishReason.LENGTH)
        return self.emit(req, sampler.sample(self.context, index), index, now)

    def emit(self, req: Request, token: int | None, index: int, now: float) -> Delivery:
        """A token sampled from the logits at `index`: appended (`append`), with its logprobs
        when the request asks for them."""
        delivery = self.append(req, token, now)
        if req.params.logprobs is not None and token is not None:
            delivery[1].logprobs = [token_logprob(self.context.logits(index), token,
                                                  req.params.logprobs, self.model.piece)]
        return delivery

    def prompt_logprobs(self, chunk: Chunk, first: int) -> None:
        """Logprobs of the prompt tokens this chunk predicts (the logits at position p score
        token p + 1). A chunk computed again after a preemption adds nothing twice."""
        seq = chunk.seq
        state = seq.owner.state
        lps = state.prompt_logprobs
        if lps is None:
            t0 = seq.prompt[0]
            lps = state.prompt_logprobs = [TokenLogprob(t0, self.model.piece(t0), None)]
        k = seq.owner.params.logprobs or 0
        for pos in range(chunk.start, min(chunk.end, seq.num_prompt - 1)):
            if pos + 1 == len(lps):
                lps.append(token_logprob(self.context.logits(first + pos - chunk.start),
                                         seq.prompt[pos + 1], k, self.model.piece))

    def append(self, req: Request, token: int | None, now: float) -> Delivery:
        """The one place a sampled token is appended, stop conditions are checked and a request
        that reached one is finished."""
        state, p = req.state, req.params
        seq, stream = state.seq, state.stream
        assert seq is not None and stream is not None, "an admitted request"
        if token is None:   # the grammar allows no token: end here rather than hang or fail
            log.warning("engine %s: request %d reached a grammar dead end after %d tokens; "
                        "finishing it with 'stop'", self.name, req.id, seq.num_output)
            return self.finish(req, FinishReason.STOP, stream.flush())
        seq.tokens.append(token)
        if state.first_token_time is None:
            state.first_token_time = now
        self.on_token(req, now)
        state.last_token_time = now
        if token in self.model.eog_ids and (not p.ignore_eos or p.grammar):
            return self.finish(req, FinishReason.STOP, stream.flush(), num_tokens=1)
        text, stopped = stream.push(token)
        if stopped:
            return self.finish(req, FinishReason.STOP, text, num_tokens=1)
        if seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.max_seq_len:
            return self.finish(req, FinishReason.LENGTH, text + stream.flush(), num_tokens=1)
        return req, Event(text, 1)

    # ---- one llama_decode call's chunks ------------------------------------------------------
    def sample_call(self, group: list) -> list[Delivery]:
        """Sample every chunk that wants logits, now: the next decode overwrites them. What
        fails for one request (its sampler, grammar, stop strings, logprobs) ends that request
        alone (`failed`); the others go on."""
        now, offset, events = time.monotonic(), 0, []
        for chunk in group:
            first, offset = offset, offset + chunk.end - chunk.start
            if chunk.drafted:
                continue   # a verification piece (verify_call)
            if chunk.seq.prompt_logits:
                try:
                    self.prompt_logprobs(chunk, first)
                except Exception as exc:
                    events.append(self.failed(chunk.seq.owner, exc))
                    continue
            if chunk.wants_logits:
                reqs = [chunk.seq.owner]
                if chunk.seq.forks:   # its prompt is computed: the other choices start now
                    reqs += [s.owner for s in self.scheduler.fork(chunk.seq)]
                logits = self.context.logits(offset - 1)
                base = logits.copy() if len(reqs) > 1 else None
                for req in reqs:
                    if base is not None:
                        logits[:] = base
                    try:
                        events.append(self.sample(req, offset - 1, now))
                    except Exception as exc:
                        events.append(self.failed(req, exc))
        return events

    def verify_call(self, group: list) -> list[Delivery]:
        """Verify the call's verification pieces, after its other pieces are sampled
        (engine/speculation.py): their tokens go through Output.emit as any token does."""
        now, offset, events = time.monotonic(), 0, []
        for chunk in group:
            first, offset = offset, offset + chunk.end - chunk.start
            if chunk.drafted:
                try:
                    events.append(self._verify_one(chunk.seq.owner, chunk, first, now))
                except Exception as exc:
                    events.append(self.failed(chunk.seq.owner, exc))
        return events

    def _verify_one(self, req: Request, chunk, first: int, now: float) -> Delivery:
        sampler = req.state.sampler
        assert sampler is not None, "an admitted request"
        return req, self.speculation.verify(
            chunk, first, lambda row: sampler.sample(self.context, row),
            lambda token, row: self.emit(req, token, row, now)[1])

    # ---- ending ----------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, text: str = "", num_tokens: int = 0,
               error: str | None = None, kind: ErrorKind | None = None) -> Delivery:
        """End a request for any reason and make its last event. Safe for a request that never
        got a sequence or a sampler (its admission failed)."""
        state = req.state
        if state.seq is not None and state.seq.status is not Status.FINISHED:
            self.scheduler.abort(state.seq, reason)
        self.speculation.end(req)
        state.finish_reason, state.finish_time = reason, time.monotonic()
        if state.sampler is not None:
            try:
                state.sampler.close()
            except Exception:   # what is left of a broken sampler must not keep the request
                log.exception("engine %s: closing request %d's sampler failed", self.name,
                              req.id)
        self.finished += 1
        self.on_finish(req)
        if error is not None and kind is None:
            kind = ErrorKind.ENGINE
        return req, Event(text, num_tokens, reason, error, kind)

    def failed(self, req: Request, exc: Exception) -> Delivery:
        """End one request whose own step raised: a 500 engine_error for it alone."""
        log.error("engine %s: request %d failed; ending it alone", self.name, req.id,
                  exc_info=exc)
        return self.finish(req, FinishReason.ERROR, error=f"engine error: {describe(exc)}",
                           kind=ErrorKind.ENGINE)


def describe(exc: Exception) -> str:
    """An exception as one line for a client: its message, or its type when it has none."""
    return str(exc) or type(exc).__name__
