"""The scheduler's record of one request: tokens, progress and place in the queue."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from kvcache import SeqAlloc

_arrivals = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    """Why a request ended. A StrEnum: compares equal to (and serializes as) its value."""
    STOP = "stop"          # end-of-generation token or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # the client went away (cancelled)
    TIMEOUT = "timeout"    # the request's deadline passed
    ERROR = "error"        # the context failed


class Preemption(StrEnum):
    """What preempting a running sequence does with its KV: saves it to RAM (restored when the
    sequence runs again) or drops it (the sequence computes it again)."""
    SWAP = "swap"
    RECOMPUTE = "recompute"


# Priority of background work (Batch API lines): such a sequence runs only in steps where no
# other sequence of its context is running or waiting (Scheduler: paused, not preempted), and is
# the first preempted when another needs its slot or blocks, whatever the policy.
BACKGROUND = 2**53 - 1


@dataclass(eq=False)
class Sequence:
    """tokens = prompt + generated; num_computed = tokens whose KV is in the context.
    A running sequence needs tokens[num_computed:] computed: 1 token = a decode step."""
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    deadline: float | None = None          # time.monotonic() after which it is ended
    owner: Any = None                      # the engine's request object
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    alloc: SeqAlloc | None = None
    hashes: list[int] | None = None        # chain hashes of the prompt's full blocks
    saved_key: int | None = None           # state swapped to RAM under this key
    num_cached_tokens: int = 0             # prompt tokens taken from the prefix cache
    cached_tier: str = "kv"                # where from: the KV streams, "ram" or "disk"
    prompt_steps: int = 0                  # steps that computed a piece of its prompt
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    # n > 1: the choices after the first wait as forks of the first; when its prompt is computed
    # they start from a copy of its KV (Scheduler.fork) instead of computing the prompt again
    forks: list[Sequence] = field(default_factory=list)   # pending forks of this sequence
    fork_of: Sequence | None = None      # set while this one waits to be forked off it
    prompt_logits: bool = False            # logits of every prompt position (echo + logprobs)
    # speculative decoding (scheduler/speculation.py): tokens guessed to follow tokens[-1],
    # given before each step (Scheduler.set_draft) and cut to what the step verifies;
    # never part of `tokens` until the model accepts them
    draft: list[int] = field(default_factory=list)
    draft_rate: float = 0.0                # how likely a drafted token is accepted
    draft_gains: tuple[float, ...] = ()    # accepted tokens of its first m, m = 1, 2, ...

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    def piece(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the sequence with its draft after its tokens."""
        n = len(self.tokens)
        if end <= n:
            return self.tokens[start:end]
        return self.tokens[start:] + self.draft[:end - n]

    @property
    def background(self) -> bool:
        return self.priority >= BACKGROUND

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1

    @property
    def num_slots(self) -> int:
        """Sequence slots this one takes, its pending forks included."""
        return 1 + len(self.forks)

    @property
    def allocated(self) -> SeqAlloc:
        """Its KV allocation: a running sequence has one."""
        assert self.alloc is not None, "the sequence is not running"
        return self.alloc

    @property
    def seq_id(self) -> int:
        return self.allocated.seq_id
