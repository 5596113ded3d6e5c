"""When a finished sequence's prefix is copied to the prefix cache's tiers (the RAM tier, and
from there the disk tier's writer thread).

Copying a sequence's KV state out of llama.cpp (llama_state_seq_get_data) is one call on the
step loop's thread that cannot be cut into parts: about 60 µs a token for SmolLM2-135M in a busy
server (0.48 s for 7,976 tokens). Made while streams run, it lands between two of their steps;
made while the context is idle, a request arriving meanwhile waits for it. So a copy is made
when it fits the step target beside the step just run: the step's seconds (from its plan to its
hand-off; 0 when the context is idle) plus the copy's estimated seconds within the target. When
it does not fit beside a step, the next step is planned shorter by the copy's estimate
(`reserve_s`: the scheduler gives prompt pieces that much less of the target), so that the copy
fits after it. A copy whose estimate alone is past the share of the target that a reservation
may take (`MAX_RESERVE`) is not made while busy: it waits for a second of idle time
(engine/worker.py), or for the operation that would change its cells (kvcache/tier_link.py).

A copy's seconds a token are learned from the copies made (a weighted average that follows a
slower copy at once), starting from a prior that overestimates the small models' figure.
"""
from __future__ import annotations

from dataclasses import dataclass

PRIOR_TOKEN_S = 1e-4     # seconds a token's state takes to copy, until a copy is timed
ALPHA = 0.3              # weight of the newest copy in the learned figure
MAX_RESERVE = 0.5        # the largest share of the step target a copy may reserve


@dataclass
class SavePacer:
    """Decides, between two steps, whether a waiting prefix is copied now (module doc)."""
    target_s: float                  # the scheduler's step target (0: no copies while busy)
    token_s: float = PRIOR_TOKEN_S   # seconds a token's state takes to copy, learned
    copies: int = 0                  # copies it allowed (busy, or idle with a disk tier)
    copy_s: float = 0.0              # their seconds in all
    max_gap_s: float = 0.0           # the largest step plus copy seen (a stream's gap)

    def estimate(self, n_tokens: int) -> float:
        return n_tokens * self.token_s

    def fits(self, step_s: float, n_tokens: int) -> bool:
        """Whether a copy of n_tokens fits the target beside a step that took step_s."""
        return (self.target_s > 0 and self.estimate(n_tokens) <= self.target_s * MAX_RESERVE
                and step_s + self.estimate(n_tokens) <= self.target_s)

    def reserve_s(self, n_tokens: int) -> float:
        """Seconds the next step leaves free for a copy of n_tokens that did not fit (0 when it
        never fits while busy)."""
        estimate = self.estimate(n_tokens)
        return estimate if 0 < estimate <= self.target_s * MAX_RESERVE else 0.0

    def observe(self, n_tokens: int, seconds: float, step_s: float) -> None:
        """A copy of n_tokens took `seconds`, after a step of step_s."""
        self.copies += 1
        self.copy_s += seconds
        self.max_gap_s = max(self.max_gap_s, step_s + seconds)
        if n_tokens <= 0:
            return
        seen = seconds / n_tokens
        self.token_s = seen if seen > self.token_s else self.token_s + ALPHA * (seen - self.token_s)
