"""How many drafted tokens each decoding sequence verifies in a step, from what steps cost.

A step's decoding tokens go through llama.cpp in one call per piece length (split KV: a
micro-batch takes the same number of tokens from each sequence; engine/batch_shape.py),
and a call of n decoding tokens costs about a + b·n seconds (scheduler/costs.py, `CallModel`:
a streams the weights once, b is a token's arithmetic), plus the step's overhead outside
llama.cpp. A sequence that verifies m drafted tokens, each accepted with probability r given the
ones before it (engine/drafting.py, `Acceptance`), gets 1 + r + ... + r^m tokens from its
piece instead of 1, for m·b seconds more, and a separate call (a) unless every decoding
sequence verifies the same m.

So the policy picks one draft length m for the step (pieces of one length share a call) and
the sequences that verify m drafted tokens, to get the most tokens per second of the step's
decoding part; it drafts only when that beats the step without drafts by `margin`. Where the
step is compute-bound (many streams: a + b·N is mostly b·N) a drafted token is worth its cost
only if it is accepted nearly always, and the policy stops drafting by itself; with one stream
the weights' streaming and the overhead dominate and a draft pays from r ≈ b / (a + b + o).
Nothing here is a fixed rule on the number of streams or of prompt tokens: only the measured
costs decide.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Drafts only when the step's predicted tokens per second beat those without drafts by this
# much: estimates are noisy, and a draft that does not pay costs every stream of the step.
MARGIN = 0.05


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that has a draft: how many tokens it may verify (its draft's length,
    within its limits) and how likely each drafted token is accepted."""
    key: int           # the caller's name for it (its index)
    available: int     # drafted tokens it may verify
    rate: float        # acceptance (engine/drafting.py)
    # observed drafts' accepted tokens within their first m, on average, for m = 1, 2, ...
    # (engine/drafting.py, `Acceptance.gains`); empty: the geometric model of `rate`
    gains: tuple[float, ...] = ()

    def gain(self, m: int) -> float:
        """Accepted tokens a verification of m drafted tokens should yield."""
        if m <= len(self.gains):
            return self.gains[m - 1]
        return expected_tokens(self.rate, m) - 1.0


@dataclass(frozen=True)
class Choice:
    length: int                  # drafted tokens each chosen sequence verifies (0: none)
    keys: frozenset[int]         # the chosen sequences
    tokens_per_s: float          # predicted for the step's decoding part
    baseline_tokens_per_s: float  # the same without drafts
    decode_s: float = 0.0        # the calls' predicted seconds, before `draft_factor`


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification of k drafted tokens yields on average (accepted ones and the
    model's own next token): 1 + rate + ... + rate^k."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def choose(candidates: Sequence[Candidate], decoding: int, a: float, b: float,
           overhead: float = 0.0, margin: float = MARGIN, max_length: int = 16,
           cost: Callable[[int, int], float] | None = None,
           draft_factor: float = 1.0) -> Choice:
    """The draft length and the sequences that verify it, for a step in which `decoding`
    sequences decode (the candidates among them). a, b: a call's cost (a + b·tokens), or
    `cost`: what a call of p pieces of l decoding tokens takes as measured (scheduler/costs.py,
    `StepCosts.call_cost`: small calls are not linear); overhead: the step's time outside
    llama.cpp; draft_factor: what steps that verified drafts took against their prediction
    lately (`StepCosts.draft_factor`), applied to a step with drafts."""
    if cost is None:
        def cost(pieces: int, length: int = 1) -> float:
            return a + b * pieces * length if pieces * length > 0 else 0.0
    base_time = overhead + cost(decoding, 1)
    base = decoding / base_time if base_time > 0 else 0.0
    best = Choice(0, frozenset(), base, base)
    if not candidates or decoding <= 0 or b <= 0:
        return best
    longest = min(max(c.available for c in candidates), max_length)
    for m in range(1, longest + 1):   # a draft may be cut to any length
        able = [c for c in candidates if c.available >= m]
        gain, chosen = 0.0, []
        able.sort(key=lambda c: -c.gain(m))
        for c in able:
            gain += c.gain(m)
            chosen.append(c.key)
            n = len(chosen)
            # a call of 1-token pieces (unless every sequence verifies), one of pieces of m + 1
            calls = cost(decoding - n, 1) + cost(n, m + 1)
            rate = (decoding + gain) / (overhead + draft_factor * calls)
            if rate > best.tokens_per_s:
                best = Choice(m, frozenset(chosen), rate, base, calls)
    if best.length and best.tokens_per_s < base * (1.0 + margin):
        return Choice(0, frozenset(), base, base)
    return best


def worth_drafting(decoding: int, a: float, b: float, overhead: float = 0.0,
                   rate: float = 0.95, length: int = 8, margin: float = MARGIN,
                   cost: Callable[[int, int], float] | None = None,
                   draft_factor: float = 1.0) -> bool:
    """Whether drafts accepted at `rate` could pay at all in a step of `decoding` sequences
    (every one of them verifying `length` tokens: the best case). False spares the step the
    drafting itself where the step is compute-bound."""
    c = [Candidate(i, length, rate) for i in range(decoding)]
    return choose(c, decoding, a, b, overhead, margin, length, cost, draft_factor).length > 0
