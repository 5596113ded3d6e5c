"""What recent steps cost, to size prompt chunks by time rather than by a fixed number of tokens.

A step computes the decoding streams' tokens and prompt pieces; the engine times them apart (with
split KV they are separate llama_decode calls) and reports them here. The scheduler then gives
the prompts as many tokens as fit the step's target time beside the decode tokens: a long
prompt arriving beside running streams finishes in a few long steps instead of a hundred short
ones, and the streams' gaps stay near the target (docs/scheduling.md, "Chunked prefill").

Costs move with the context (a prompt token late in a long prompt attends to more of it) and
with the machine (other processes, thread changes), so they are exponentially weighted averages
of the last few steps, not constants.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCosts:
    alpha: float = 0.3                    # weight of the newest observation
    decode_s: float | None = None         # seconds of the decode tokens' part of a step
    prompt_token_s: float | None = None   # seconds per prompt token

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = self._mix(self.decode_s, seconds)

    def observe_prompt(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.prompt_token_s = self._mix(self.prompt_token_s, seconds / tokens)

    def expected(self, decode: bool, prompt_tokens: int) -> float | None:
        """What a call of the decoding streams' tokens (`decode`) and `prompt_tokens` prompt
        tokens should take by recent steps; None until both parts are known."""
        total = 0.0
        if decode:
            if self.decode_s is None:
                return None
            total += self.decode_s
        if prompt_tokens:
            if self.prompt_token_s is None:
                return None
            total += self.prompt_token_s * prompt_tokens
        return total

    def prompt_tokens_within(self, target_s: float, decoding: bool) -> int | None:
        """How many prompt tokens a step may take to last about `target_s` (with the decode
        tokens' part when sequences decode); None until a prompt token's cost is known."""
        if self.prompt_token_s is None or self.prompt_token_s <= 0:
            return None
        left = target_s - ((self.decode_s or 0.0) if decoding else 0.0)
        return max(0, int(left / self.prompt_token_s))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
