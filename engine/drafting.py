"""Draftless drafts: guesses of a sequence's next tokens from text it has seen, for the model to
check in one step (speculative decoding without a draft model; docs/scheduling.md,
"Speculative decoding").

Two sources, tried in this order:
- the sequence's own tokens (prompt lookup): where the last n tokens (n from the longest size
  down) occurred before in its prompt or output, the tokens that followed them there. A
  `SequenceIndex` keeps, for every n-gram of the sequence, where it last ended: one dict insert
  per size and token, one lookup per size and draft.
- a table shared by the sequences of a context (`SharedTable`, in the spirit of llama.cpp's
  `ngram-mod`): a fixed number of slots, each the token that last followed an n-gram of any
  prompt or output, keyed by the n-gram's hash (checked in full, so collisions never draft);
  a draft follows it token by token. Answers that repeat across requests (the same JSON shape,
  the same code) draft from it.

Memory is bounded: a sequence's index holds at most `len(sizes)` entries per token of the
sequence (which n_ctx bounds) and is dropped with it; the shared table has a fixed size.

A sequence's acceptance (`Acceptance`) is the chance that a drafted token is accepted given
that the ones before it were, estimated from its recent verifications; the speculation policy
(scheduler/speculation.py) turns it and the measured step costs into how many drafted tokens
each sequence verifies in a step. Pure Python: no llama_cpp here.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.speculation import expected_tokens

# n-gram sizes of prompt lookup, longest first: a longer match predicts better
LOOKUP_SIZES = (4, 3, 2)
# the shared table's n-gram size and slots (2**20 slots: 12 MB)
SHARED_NGRAM = 6
SHARED_SLOTS = 1 << 20


class SequenceIndex:
    """Where each n-gram of one sequence's tokens last ended, for n in `sizes`: the position of
    the token that followed it. Tokens are indexed as they are appended (`update`)."""

    __slots__ = ("sizes", "maps", "next_end")

    def __init__(self, sizes: Sequence[int] = LOOKUP_SIZES):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in self.sizes]
        self.next_end = 1   # the next end position to index (an n-gram ending there)

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (each has a token after it)."""
        end = len(tokens)
        for e in range(self.next_end, end):
            for n, m in zip(self.sizes, self.maps):
                if e >= n:
                    m[tuple(tokens[e - n:e])] = e
        self.next_end = max(self.next_end, end)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` that occurred before (none: an empty list). `tokens` must be what `update` saw,
        possibly with more appended."""
        self.update(tokens)
        end = len(tokens)
        for n, m in zip(self.sizes, self.maps):
            if end <= n:
                continue
            at = m.get(tuple(tokens[end - n:end]))
            if at is not None:
                return list(tokens[at:min(at + k, end)])
        return []


class SharedTable:
    """A bounded n-gram -> next-token table shared by the sequences of one context: `slots`
    slots addressed by the n-gram's hash, each holding the full hash (checked on lookup) and
    the token that last followed that n-gram. Newer text overwrites older in a taken slot."""

    def __init__(self, n: int = SHARED_NGRAM, slots: int = SHARED_SLOTS):
        if slots & (slots - 1):
            raise ValueError("slots must be a power of two")
        self.n, self.mask = n, slots - 1
        # made by repetition: an array built from bytes over-allocates by 1/16
        self.keys = array("q", [0]) * slots
        self.values = array("i", [-1]) * slots
        self.used = 0

    @property
    def size_bytes(self) -> int:
        return self.bytes_for(len(self.values))

    @staticmethod
    def bytes_for(slots: int = SHARED_SLOTS) -> int:
        """What a table of `slots` slots takes: a full hash and a token each."""
        return (array("q").itemsize + array("i").itemsize) * slots

    def add(self, tokens: Sequence[int], start: int = 0) -> None:
        """Enter every n-gram of `tokens` that ends at or after `start` and has a token after
        it."""
        n, mask, keys, values = self.n, self.mask, self.keys, self.values
        for e in range(max(start, n), len(tokens)):
            h = _key(tokens[e - n:e])
            slot = h & mask
            if values[slot] < 0:
                self.used += 1
            keys[slot], values[slot] = h, tokens[e]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens after `tokens`, each the one that last followed the n tokens before
        it (its own drafted tokens included)."""
        n = self.n
        if len(tokens) < n:
            return []
        window = list(tokens[-n:])
        out: list[int] = []
        mask, keys, values = self.mask, self.keys, self.values
        while len(out) < k:
            h = _key(window)
            slot = h & mask
            token = values[slot]
            if token < 0 or keys[slot] != h:
                break
            out.append(token)
            window.append(token)
            del window[0]
        return out


def _key(ngram: Sequence[int]) -> int:
    """A 64-bit signed key of an n-gram (Python's tuple hash of ints: the same in every run)."""
    return hash(tuple(ngram))


def verify(draft: Sequence[int], sample: Callable[[int], int | None],
           emit: Callable[[int | None], bool]) -> int:
    """Check a draft against the model: for each position i (0: after the sequence's last
    token, i: after draft[:i]) `sample(i)` draws the model's token from that position's
    logits, as decoding one token at a time would, and `emit` appends it (True: the sequence
    ended there). Drafted tokens are accepted while the draw equals them; the first draw that
    differs (or the draw after a draft accepted whole) is the model's own next token. Returns
    how many drafted tokens were accepted.

    Greedy, this is the longest prefix of the draft the model agrees with, and its next token.
    Sampled, it is the speculative sampling rule for a draft that puts all its probability on
    x = draft[i]: accept x with probability min(1, p(x) / 1) = p(x) (the draw equals x), and on
    a rejection draw from (p - 1_x)+ renormalized, p without x (the draw, given it is not x).
    Every token emitted is distributed as the model's next token given the ones before it."""
    accepted = 0
    for i in range(len(draft) + 1):
        token = sample(i)
        if emit(token) or i == len(draft) or token != draft[i]:
            break
        accepted += 1
    return accepted


@dataclass
class Acceptance:
    """A sequence's recent drafts and how many of their tokens the model went on to produce.

    `rate`: the chance that a drafted token is accepted given that the drafted tokens before it
    were (a geometric model: a draft of k tokens of which j were right counts j acceptances and,
    when j < k, one rejection). `gains`: for each length m, how many of a draft's first m tokens
    were right on average (min(j, m) of a draft of at least m tokens), which is what a
    verification of m drafted tokens yields beyond the model's own token, without a model of
    how acceptances follow each other: n-gram drafts are mostly right whole or wrong from their
    first token, where a geometric rate overstates short drafts and understates long ones.
    Older drafts weigh less (`decay` per draft); the prior counts as `prior_weight` drafts of
    acceptance `prior_rate` (its gains: `prior_gains`, else the geometric ones)."""
    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.7
    prior_accepted: float = 1.0
    prior_rejected: float = 1.0
    prior_gains: tuple[float, ...] = ()
    prior_weight: float = 2.0
    weights: list[float] = field(default_factory=list)   # per m: drafts of at least m tokens
    sums: list[float] = field(default_factory=list)      # per m: their right tokens within m

    @property
    def rate(self) -> float:
        a, r = self.accepted + self.prior_accepted, self.rejected + self.prior_rejected
        return a / (a + r)

    def gain(self, m: int) -> float:
        """A draft's right tokens within its first m, on average (m >= 1)."""
        if m <= len(self.prior_gains):
            prior = self.prior_gains[m - 1]
        else:
            r = self.prior_accepted / (self.prior_accepted + self.prior_rejected)
            prior = expected_tokens(r, m) - 1.0
        if m > len(self.weights):
            return prior
        w = self.weights[m - 1]
        return (self.sums[m - 1] + self.prior_weight * prior) / (w + self.prior_weight)

    def gains(self, k: int) -> tuple[float, ...]:
        return tuple(self.gain(m) for m in range(1, k + 1))

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        d = self.decay
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (1.0 if accepted < drafted else 0.0)
        weights, sums = self.weights, self.sums
        if len(weights) < drafted:
            weights.extend([0.0] * (drafted - len(weights)))
            sums.extend([0.0] * (drafted - len(sums)))
        for i in range(len(weights)):
            weights[i] *= d
            sums[i] *= d
            if i < drafted:
                weights[i] += 1.0
                sums[i] += min(accepted, i + 1)


# steps a sequence skips its lookup after a draft of which no token was right, at most: it
# doubles with each such draft and starts again at 0 after one that was right
MAX_BACKOFF = 8
# how verified drafts' accepted tokens compare with what was expected of them (`Drafter.gains`):
# the weight left to older verifications, the prior's weight (in expected tokens, at 1), and
# the range the factor is held to
REALIZED_DECAY = 0.95
REALIZED_PRIOR = 2.0
REALIZED_FADE = 0.99   # per draft scored
REALIZED_RANGE = (0.25, 1.25)


@dataclass
class DraftState:
    """What the drafter keeps for one sequence."""
    index: SequenceIndex = field(default_factory=SequenceIndex)
    acceptance: Acceptance = field(default_factory=Acceptance)
    shared_from: int = 0   # tokens of the sequence already entered in the shared table
    drafted: int = 0       # tokens drafted and verified, over the sequence's life
    accepted: int = 0      # of those, accepted
    # a draft being scored against the tokens the model goes on to produce (verified or not):
    # where it starts in the sequence, and its tokens
    pending_at: int = 0
    pending: list[int] = field(default_factory=list)
    backoff: int = 0       # steps to skip the lookup after drafts that were wrong
    skip: int = 0          # steps left to skip
    expected: tuple[float, ...] = ()   # the last draft's expected accepted tokens, by length


class Drafter:
    """Drafts for the sequences of one context: each sequence's own index, then the shared
    table. `max_tokens`: the most tokens one draft may hold.

    Every draft is scored against the tokens the model then produces, whether the scheduler had
    it verified or not (the model's tokens are the same either way), one draft at a time per
    sequence: so acceptance is learnt where verifying would not pay, and a sequence whose text
    turns repetitive starts drafting when its drafts prove right. A new sequence's acceptance
    starts from the context's recent one. A sequence whose drafts were wrong looks up less often
    (`MAX_BACKOFF`): on text that never repeats, drafting costs little.

    The drafts that the policy picks to verify are those whose estimates are highest, so their
    estimates run high: what verifications accepted against what was expected of them scales
    every estimate (`gains`), so that the policy counts on the gains drafts have shown."""

    def __init__(self, max_tokens: int = 8, sizes: Sequence[int] = LOOKUP_SIZES,
                 shared_n: int = SHARED_NGRAM, shared_slots: int = SHARED_SLOTS,
                 shared: bool = True):
        self.max_tokens = max_tokens
        self.sizes = tuple(sizes)
        self.shared = SharedTable(shared_n, shared_slots) if shared else None
        # the context's recent acceptance: a new sequence's prior (weighing two drafts)
        self.prior = Acceptance(decay=0.9)
        self.realized = 0.0   # verified drafts' accepted tokens, older ones weighing less
        self.promised = 0.0   # what was expected of them

    @property
    def realization(self) -> float:
        """Verified drafts' accepted tokens over what was expected of them, lately."""
        lo, hi = REALIZED_RANGE
        factor = (self.realized + REALIZED_PRIOR) / (self.promised + REALIZED_PRIOR)
        return min(hi, max(lo, factor))

    def gains(self, state: DraftState, k: int) -> tuple[float, ...]:
        """Accepted tokens to expect of the sequence's draft cut to 1, 2, ..., k tokens: its
        acceptance's, scaled by what verifications lately accepted against the expected."""
        state.expected = state.acceptance.gains(k)
        factor = self.realization
        return tuple(g * factor for g in state.expected)

    def start(self) -> DraftState:
        """A new sequence's state. Its tokens go into the shared table (and its own index) when
        it first drafts, and the rest of them when it ends (`finish`): a sequence that never
        drafts (the steps were compute-bound) costs nothing."""
        state = DraftState(SequenceIndex(self.sizes))
        rate = self.prior.rate
        state.acceptance = Acceptance(prior_accepted=rate * 2, prior_rejected=(1 - rate) * 2,
                                      prior_gains=self.prior.gains(self.max_tokens))
        return state

    def finish(self, state: DraftState, tokens: Sequence[int]) -> None:
        """A sequence ended: the rest of its tokens go into the shared table, if it drafted."""
        self._score(state, tokens, final=True)
        if state.shared_from:
            self._share(state, tokens)

    def draft(self, state: DraftState, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k (default max_tokens) tokens that may follow `tokens` (the sequence's prompt
        and output, its last token sampled but not yet computed)."""
        self._score(state, tokens)
        k = self.max_tokens if k is None else min(k, self.max_tokens)
        if k <= 0:
            return []
        if state.skip > 0:
            state.skip -= 1
            return []
        self._share(state, tokens)
        own = state.index.lookup(tokens, k)
        if len(own) >= k or self.shared is None:
            out = own
        else:
            other = self.shared.lookup(tokens, k)
            out = other if len(other) > len(own) else own
        if out and not state.pending:
            state.pending_at, state.pending = len(tokens), list(out)
        return out

    def observe(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens accepted `accepted` of them: counted, and set
        against what was expected of it (acceptance learns from every draft's score, `_score`)."""
        state.drafted += drafted
        state.accepted += accepted
        if 0 < drafted <= len(state.expected):
            self.realized = REALIZED_DECAY * self.realized + accepted
            self.promised = REALIZED_DECAY * self.promised + state.expected[drafted - 1]

    def _score(self, state: DraftState, tokens: Sequence[int], final: bool = False) -> None:
        """Score the pending draft once the tokens after it show how much of it was right."""
        draft = state.pending
        if not draft:
            return
        at, n = state.pending_at, len(draft)
        produced = len(tokens) - at
        j = 0
        while j < n and j < produced and tokens[at + j] == draft[j]:
            j += 1
        if j < n and j == produced:   # right so far
            if not final:
                return
            n = j                     # the sequence ended inside it: a draft of what it saw
        state.pending = []
        if n <= 0:
            return
        state.acceptance.observe(n, j)
        self.prior.observe(n, j)
        # the prior regains weight while nothing is verified: a factor learnt on other text
        # does not hold drafting off for good
        self.realized *= REALIZED_FADE
        self.promised *= REALIZED_FADE
        if j == 0:
            state.backoff = min(MAX_BACKOFF, 2 * state.backoff + 1)
            state.skip = state.backoff
        else:
            state.backoff = 0

    def _share(self, state: DraftState, tokens: Sequence[int]) -> None:
        if self.shared is not None and len(tokens) > state.shared_from:
            self.shared.add(tokens, state.shared_from)
            state.shared_from = len(tokens)
