"""What a context reports about itself: a ContextStats snapshot and its step-time split."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    """Where a context's step loop spends its time (cumulative seconds)."""
    steps: int = 0
    decode_calls: int = 0
    micro_batches: int = 0     # llama.cpp's micro-batches in those calls (runs of seq ids)
    plan_s: float = 0.0        # scheduling, KV ops, admission (Python)
    decode_s: float = 0.0      # inside llama_decode (batch fill included)
    sample_s: float = 0.0      # progress, prefix-cache commits, sampling, stop checks, text
    deliver_s: float = 0.0     # frees, handing events to the event loop
    stopped_steps: int = 0     # background steps stopped (or skipped) for a client's request
    cut_steps: int = 0         # of those, the ones cut inside llama_decode (it returned 2)
    stopped_s: float = 0.0     # the decode time those stopped steps threw away

    def per_step_ms(self) -> dict:
        n = max(1, self.steps)
        return {"steps": self.steps, "decode_calls_per_step": round(self.decode_calls / n, 3),
                "micro_batches_per_step": round(self.micro_batches / n, 3),
                "stopped_steps": self.stopped_steps, "cut_steps": self.cut_steps,
                "stopped_ms": round(1000 * self.stopped_s, 1),
                **{k: round(1000 * getattr(self, k) / n, 3)
                   for k in ("plan_s", "decode_s", "sample_s", "deliver_s")}}


@dataclass(frozen=True)
class ContextStats:
    """One context's counts (plain reads by the event loop; may be one step stale)."""
    name: str
    threads: int                       # llama.cpp threads in use now (0: idle, elastic)
    configured_threads: int            # its own share of the process's threads
    max_threads: int                   # the most it may use (all the shares, with elastic threads)
    other_cpu_cores: float | None      # cores other processes used lately (None: not watched)
    thread_changes: int
    step_ms: dict                      # StepTimes.per_step_ms()
    running: int
    waiting: int
    outstanding: int
    steps: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_cached_blocks: int
    live_seqs: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    failed: str | None
    spec_drafts: int = 0               # verifications of drafted tokens (speculative decoding)
    spec_draft_tokens: int = 0         # drafted tokens verified
    spec_accepted_tokens: int = 0      # of those, accepted
    spec_accepted_per_pos: tuple[int, ...] = ()   # accepted, by position in the draft
