"""One request as the engine sees it, and what its queue receives."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from enum import StrEnum

from engine.detok import TextStream
from engine.drafting import DraftState
from engine.logprobs import TokenLogprob
from engine.sampling import Sampler, SamplingParams
from scheduler import FinishReason, Sequence

_request_ids = itertools.count(1)


class ErrorKind(StrEnum):
    """Why a request ended with an error; its value is the API's error code."""
    ENGINE = "engine_error"              # the engine failed: its context, or this request's step
    INVALID = "invalid_request"          # the request's own parameters could not be applied
    SHUTDOWN = "server_shutting_down"    # a drain ended it


@dataclass
class Event:
    """What a request's queue receives: new text, and on the last event the finish reason
    (with `error` and `error_kind` when it ended with an error)."""
    text: str = ""
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token in this event, when asked
    index: int = 0                               # the request's choice index (n > 1)


@dataclass(eq=False)
class RequestState:
    """What the worker owns of a request: written on its thread only. The event loop reads it
    once the request's events say it is there (a first token, the end)."""
    seq: Sequence | None = None
    sampler: Sampler | None = None
    stream: TextStream | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob] | None = None   # when asked (the first: logprob None)
    draft: DraftState | None = None      # speculative decoding's state (engine/drafting.py)


@dataclass(eq=False)
class Request:
    """One choice of one prompt, as the HTTP side asks for it (set when it is made, and `loop`
    and `queue` when it is submitted), and in `state` what the worker makes of it."""
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    timeout: float | None = None
    id: int = field(default_factory=lambda: next(_request_ids))
    arrival_time: float = field(default_factory=time.monotonic)
    index: int = 0                     # choice index; its events carry it
    forks: list[Request] = field(default_factory=list)   # n > 1: the other choices, forked
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    state: RequestState = field(default_factory=RequestState)

    @property
    def group(self) -> list[Request]:
        """This request and its forks: the choices of one prompt, in index order."""
        return [self, *self.forks]

    @property
    def num_output(self) -> int:
        seq = self.state.seq
        return seq.num_output if seq else 0

    @property
    def num_cached(self) -> int:
        seq = self.state.seq
        return seq.num_cached_tokens if seq else 0

    @property
    def num_drafted(self) -> int:
        """Tokens drafted for this request and verified by the model (speculative decoding)."""
        draft = self.state.draft
        return draft.drafted if draft else 0

    @property
    def num_accepted(self) -> int:
        """Of those, the tokens the model accepted."""
        draft = self.state.draft
        return draft.accepted if draft else 0

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.state.finish_reason

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request, if one did."""
        stream = self.state.stream
        return stream.matched if stream is not None else None

    @property
    def finished(self) -> bool:
        return self.state.finish_reason is not None


# What the event loop puts in a worker's inbox.
@dataclass(frozen=True)
class Admit:
    req: Request


@dataclass(frozen=True)
class Cancel:
    req: Request


InboxMessage = Admit | Cancel
