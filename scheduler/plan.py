"""What a step plans: the typed values the scheduler hands the engine for each step.

A `Chunk` is one sequence's piece of the step's batch (tokens [start, end) of it: one decode
token, a prompt piece, or a decode token with drafted tokens to verify) and what it needs of
the model's logits; a `StepPlan` is the step's chunks, the KV operations to apply before them,
the sequences preempted on the way, and what the step was sized by. Apart from the planner
(scheduler/scheduler.py) because they are what crosses the layer: the engine reads them
(engine/worker.py, engine/output.py, engine/speculation.py) and nothing of how they were
decided.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import KVOp
from scheduler.sequence import Sequence


@dataclass
class Chunk:
    seq: Sequence
    start: int
    end: int
    claims: list[int] = field(default_factory=list)   # block hashes this chunk computes first
    drafted: int = 0    # drafted tokens at its end, to verify (the sequence's draft)

    @property
    def wants_logits(self) -> bool:
        return self.end >= len(self.seq.tokens)

    @property
    def num_logits(self) -> int:
        """How many of the chunk's last tokens need logits: the last, to sample from; every
        token of a prompt chunk whose prompt logprobs were asked for (echo with logprobs); every
        token of a verification piece (the sequence's last token and its drafted ones)."""
        if self.drafted or (self.seq.prompt_logits and self.start < self.seq.num_prompt):
            return self.end - self.start
        return int(self.wants_logits)

    @property
    def tokens(self) -> list[int]:
        return self.seq.piece(self.start, self.end)


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    ops: list[KVOp] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)   # taken off the context this step
    allowance: int | None = None   # prompt tokens this step may take (None: the budget decides)
    finish_within: int = 0         # a prompt with at most this many tokens left may finish now
    finishing: int = 0             # prompt tokens planned that way, outside the allowance
    budget: int = 0                # tokens this step may take in all (set by schedule)
    wave: bool = False             # a wave step: every prompt that wants computing, whole
    draft_s: float = 0.0           # the decoding calls' predicted seconds where drafts verify
    background: bool = False       # background work alone: a client's request may stop it

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks if not c.seq.is_decoding)
