"""What recent steps cost, to size prompt chunks by time rather than by a fixed number of tokens.

A step computes the decoding streams' tokens and prompt pieces; the engine times them apart (with
split KV they are separate llama_decode calls) and reports them here. The scheduler then gives
the prompts as many tokens as fit the step's target time beside the decode tokens: a long
prompt arriving beside running streams finishes in a few long steps instead of a hundred short
ones, and the streams' gaps stay near the target (docs/scheduling.md, "Chunked prefill").

Costs move with the context (a prompt token late in a long prompt attends to more of it) and
with the machine (other processes), so they are exponentially weighted averages of the last few
steps, not constants. A change of the context's thread count (the contention governor gives
threads up and takes them back: engine/threads.py) changes every cost at once, faster than any
average follows (`StepCosts.follow_threads`): on fewer threads every figure is multiplied at once
by the old count over the new one (a prompt's arithmetic divides between the threads: a piece
sized for two threads takes about twice the step target on one); on more threads the figures
stay until steps on them are timed (a second thread made steps 1.3 to 2 times faster,
depending on the machine: taking the gain before measuring it overshot the target).

Speculative decoding (scheduler/speculation.py) needs what a call of decoding tokens costs by
its size: a call of n decode or verification tokens takes about a + b·n seconds (a: streaming
the weights once, the graph, the threads' meeting points; b: a token's arithmetic), fitted over
recent calls (`CallModel`), and the step's own overhead outside llama_decode (the worker's
Python), which every token of a step shares. Small calls are not linear on every machine (with
a small model on two cores a call of 2 tokens took 1.8 times a call of 1, where a + b·n fitted
over all sizes said 1.4): each call size keeps how far its calls lately were from the line
(`StepCosts.sized`), and `call_cost` is the line times that, for the sizes seen.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("pagedllama.scheduler")

# weight of the newest call in a size's measured correction, and the range it is held to (one
# call that a neighbour slowed must not turn a size's cost upside down)
SIZE_ALPHA = 0.2
SIZE_RANGE = (0.5, 3.0)
# steps that verified drafts, their seconds over what the policy predicted: the newest one's
# weight, the range, and how far toward 1 it returns with each step of decoding without drafts
DRAFT_ALPHA = 0.2
DRAFT_RANGE = (0.7, 3.0)
DRAFT_FADE = 0.99
# the measured gate (StepCosts.drafts_pay): weight of a step's tokens a second in its average,
# and one step in how many goes through a closed gate
RATE_ALPHA = 0.05
EXPLORE_EVERY = 20


@dataclass
class CallModel:
    """seconds ≈ a + b·tokens for a llama_decode call of decoding tokens (1-token pieces and
    verification pieces), fitted by exponentially weighted least squares over recent calls, with
    b held toward a prior (what a prompt token costs) by `ridge`: while every call has the same
    size (no speculation yet) the prior decides b and the calls decide a."""
    decay: float = 0.97     # weight left to an observation after each newer one
    ridge: float = 0.5      # the prior's weight, in observations one token apart
    s0: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    t0: float = 0.0
    t1: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.s0 = d * self.s0 + 1.0
        self.s1 = d * self.s1 + tokens
        self.s2 = d * self.s2 + tokens * tokens
        self.t0 = d * self.t0 + seconds
        self.t1 = d * self.t1 + tokens * seconds

    def fit(self, prior_b: float | None) -> tuple[float, float] | None:
        """(a, b), or None before any call was seen or when neither the calls nor a prior
        give b. a >= 0 and b > 0."""
        if self.s0 < 1e-9:
            return None
        lam = self.ridge if prior_b is not None else 0.0
        b0 = prior_b or 0.0
        var = self.s0 * (self.s2 + lam) - self.s1 * self.s1
        if var <= 1e-9 * self.s0 * self.s0:
            return None
        b = (self.s0 * (self.t1 + lam * b0) - self.s1 * self.t0) / var
        if b <= 0.0:
            b = b0 if b0 > 0 else 1e-6
        a = max(0.0, (self.t0 - b * self.s1) / self.s0)
        return a, b


@dataclass
class PromptModel:
    """seconds ≈ c0·T + c1·A for the prompt pieces of a call: T their tokens, A their attention
    work, Σ tokens·(depth + tokens/2) over the pieces (a token attends to the cells before it,
    so a piece deep in a long prompt costs more a token than the same piece at its start).
    Fitted by exponentially weighted least squares over recent calls. Until calls at several
    depths have been seen, c1 is held toward a prior (`attention_prior` of c0 per cell of
    depth): a first long prompt is not taken to cost at its end what it cost at its start."""
    decay: float = 0.9          # weight left to an observation after each newer one
    ridge: float = 1.0          # the prior's weight (1: a millionth of the calls' own)
    attention_prior: float = 1 / 1024   # c1 / c0 before the calls say: twice the cost at 1,024
    stt: float = 0.0
    sta: float = 0.0
    saa: float = 0.0
    sty: float = 0.0
    say: float = 0.0

    def observe(self, tokens: int, work: float, seconds: float) -> None:
        d = self.decay
        self.stt = d * self.stt + tokens * tokens
        self.sta = d * self.sta + tokens * work
        self.saa = d * self.saa + work * work
        self.sty = d * self.sty + tokens * seconds
        self.say = d * self.say + work * seconds

    def fit(self) -> tuple[float, float] | None:
        """(c0, c1), both >= 0, or None before any call."""
        if self.stt <= 0:
            return None
        flat = self.sty / self.stt                  # c0 with depth ignored
        prior = self.attention_prior * flat
        lam = self.ridge * 1e-6 * self.saa + 1e-30  # c1 held toward the prior, scale-free
        saa, say = self.saa + lam, self.say + lam * prior
        det = self.stt * saa - self.sta * self.sta
        if det <= 1e-12 * self.stt * saa:
            return flat, prior
        c0 = (self.sty * saa - self.sta * say) / det
        c1 = (self.stt * say - self.sta * self.sty) / det
        if c0 <= 0 or c1 < 0:
            return flat, prior
        return c0, c1

    def seconds(self, pieces: list[tuple[int, int]]) -> float | None:
        """What prompt pieces of (tokens, depth) should take; None before any call."""
        model = self.fit()
        if model is None:
            return None
        c0, c1 = model
        return sum(n * (c0 + c1 * (d + n / 2)) for n, d in pieces)

    def tokens_within(self, seconds: float, depth: int) -> int | None:
        """The most tokens of one piece starting at `depth` that take at most `seconds`."""
        model = self.fit()
        if model is None:
            return None
        c0, c1 = model
        if seconds <= 0:
            return 0
        per_token = c0 + c1 * depth       # n·(per_token + c1·n/2) = seconds
        if c1 <= 0:
            return int(seconds / per_token) if per_token > 0 else None
        n = (-per_token + (per_token * per_token + 2 * c1 * seconds) ** 0.5) / c1
        return max(0, int(n))


def attention_work(pieces: list[tuple[int, int]]) -> float:
    """Σ tokens·(depth + tokens/2) of prompt pieces of (tokens, depth)."""
    return sum(n * (d + n / 2) for n, d in pieces)


def _mix_into(table: dict, key, value: float, alpha: float = SIZE_ALPHA) -> None:
    old = table.get(key)
    table[key] = value if old is None else old + alpha * (value - old)


@dataclass
class StepCosts:
    alpha: float = 0.3                    # weight of the newest observation
    decode_s: float | None = None         # seconds of the decode tokens' part of a step
    prompt_token_s: float | None = None   # seconds per prompt token
    overhead_s: float | None = None       # seconds of a step outside llama_decode
    calls: CallModel = field(default_factory=CallModel)
    # call size -> its calls' seconds over the line's prediction (weighted average, SIZE_ALPHA)
    sized: dict[int, float] = field(default_factory=dict)
    # the same by shape, (pieces, tokens a piece): two pieces of 2 tokens cost more than one of 4
    shaped: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_factor: float = 1.0   # steps with drafts: measured over predicted seconds, lately
    # steps of decoding alone, by (sequences decoding, whether drafts were verified): the
    # tokens they produced per second, lately (RATE_ALPHA); the gate of `drafts_pay`
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)
    _closed: dict[int, int] = field(default_factory=dict)   # steps the gate said no, by size
    prompts: PromptModel = field(default_factory=PromptModel)   # prompt pieces by length, depth
    threads: int | None = None   # the thread count the figures are for (None: not told)

    def follow_threads(self, threads: int) -> None:
        """The context computes with `threads` threads from now on (module doc): fewer, and every
        time figure grows by the old count over the new one; more, and they stay as measured."""
        old, self.threads = self.threads, threads
        if old is None or threads >= old:
            return
        k = old / threads
        if self.decode_s is not None:
            self.decode_s *= k
        if self.prompt_token_s is not None:
            self.prompt_token_s *= k
        calls, prompts = self.calls, self.prompts
        calls.t0, calls.t1 = calls.t0 * k, calls.t1 * k
        prompts.sty, prompts.say = prompts.sty * k, prompts.say * k
        self.rates = {key: rate / k for key, rate in self.rates.items()}

    def observe_decode(self, seconds: float, tokens: int | None = None,
                       pieces: int | None = None) -> None:
        """A call of decoding tokens only (`tokens` of them, when known, in `pieces` pieces of
        one length, when known)."""
        self.decode_s = self._mix(self.decode_s, seconds)
        if tokens:
            model = self.call_model()
            if model is not None and model[0] + model[1] * tokens > 0:
                lo, hi = SIZE_RANGE
                ratio = min(hi, max(lo, seconds / (model[0] + model[1] * tokens)))
                _mix_into(self.sized, tokens, ratio)
                if pieces and tokens % pieces == 0:
                    _mix_into(self.shaped, (pieces, tokens // pieces), ratio)
            self.calls.observe(tokens, seconds)

    def observe_draft_step(self, predicted: float, seconds: float) -> None:
        """A step that verified drafts (its calls decoding tokens only) took `seconds` where the
        policy predicted `predicted`; 0 predicted: a step of decoding without drafts."""
        if predicted > 0:
            lo, hi = DRAFT_RANGE
            ratio = min(hi, max(lo, seconds / predicted))
            self.draft_factor += DRAFT_ALPHA * (ratio - self.draft_factor)
        else:
            self.draft_factor = 1.0 + DRAFT_FADE * (self.draft_factor - 1.0)

    def observe_decoding_step(self, decoding: int, tokens: int, seconds: float,
                              drafted: bool) -> None:
        """A step of `decoding` sequences decoding alone (no prompt piece) produced `tokens`
        tokens in `seconds`, all of it counted (planning, llama_decode, sampling, delivery)."""
        if seconds > 0 and decoding > 0:
            _mix_into(self.rates, (decoding, drafted), tokens / seconds, RATE_ALPHA)

    def drafts_pay(self, decoding: int) -> bool:
        """Whether steps of `decoding` sequences that verified drafts produced at least as many
        tokens a second as those that did not, as measured lately: the last word after the
        policy's prediction, so that drafting never runs slower than not drafting. Until both
        were seen it lets drafts through; when closed it still lets one step in EXPLORE_EVERY
        through, so a workload that turns repetitive is noticed."""
        with_drafts, without = (self.rates.get((decoding, True)),
                                self.rates.get((decoding, False)))
        if with_drafts is None or without is None or with_drafts >= without:
            self._closed.pop(decoding, None)
            return True
        closed = self._closed.get(decoding, 0) + 1
        self._closed[decoding] = 0 if closed >= EXPLORE_EVERY else closed
        return closed >= EXPLORE_EVERY

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_s = self._mix(self.overhead_s, max(0.0, seconds))

    def call_model(self) -> tuple[float, float] | None:
        """(a, b) of a call of decoding tokens (CallModel), b's prior a prompt token's cost."""
        return self.calls.fit(self.prompt_token_s)

    def call_cost(self) -> Callable[[int, int], float] | None:
        """What a call of `pieces` pieces of `length` decoding tokens takes: the call model's
        line, times what calls of that shape (else of that many tokens) measured against it
        lately (none seen: the line). None before the model."""
        model = self.call_model()
        if model is None:
            return None
        a, b = model
        sized, shaped = self.sized, self.shaped

        def cost(pieces: int, length: int = 1) -> float:
            n = pieces * length
            if n <= 0:
                return 0.0
            ratio = shaped.get((pieces, length))
            return (a + b * n) * (sized.get(n, 1.0) if ratio is None else ratio)
        return cost

    def decode_time(self, tokens: int) -> float | None:
        """What a call of this many decoding tokens should take: by the call model once it has
        seen calls of several sizes, else what decode calls took lately."""
        model = self.calls.fit(None)
        if model is not None:
            return model[0] + model[1] * tokens
        return self.decode_s

    def observe_prompt(self, tokens: int, seconds: float,
                       pieces: list[tuple[int, int]] | None = None) -> None:
        """Prompt tokens took `seconds`; `pieces`, their (tokens, depth) where known, teach the
        cost model how a token's cost grows with the cells before it (PromptModel)."""
        if tokens > 0:
            self.prompt_token_s = self._mix(self.prompt_token_s, seconds / tokens)
            if pieces and seconds > 0:
                self.prompts.observe(tokens, attention_work(pieces), seconds)

    def prompt_time(self, tokens: int, pieces: list[tuple[int, int]] | None = None) -> float | None:
        """What these prompt tokens (at these depths, where given) should take."""
        if pieces:
            by_depth = self.prompts.seconds(pieces)
            if by_depth is not None:
                return by_depth
        return None if self.prompt_token_s is None else self.prompt_token_s * tokens

    def expected(self, decode: int, prompt_tokens: int,
                 pieces: list[tuple[int, int]] | None = None) -> float | None:
        """What a call of `decode` decoding tokens (1-token and verification pieces) and
        `prompt_tokens` prompt tokens (in `pieces` of (tokens, depth), where known) should take
        by recent steps; None until both parts are known."""
        total = 0.0
        if decode:
            part = self.decode_time(decode)
            if part is None:
                return None
            total += part
        if prompt_tokens:
            part = self.prompt_time(prompt_tokens, pieces)
            if part is None:
                return None
            total += part
        return total

    def prompt_tokens_within(self, target_s: float, decoding: bool,
                             depth: int = 0) -> int | None:
        """How many prompt tokens, starting `depth` cells into a prompt, a step may take to last
        about `target_s` (with the decode tokens' part and the step's own overhead when
        sequences decode); None until a prompt token's cost is known."""
        if self.prompt_token_s is None or self.prompt_token_s <= 0:
            return None
        left = target_s - (((self.decode_s or 0.0) + (self.overhead_s or 0.0)) if decoding
                           else 0.0)
        by_depth = self.prompts.tokens_within(left, depth)
        return max(0, int(left / self.prompt_token_s) if by_depth is None else by_depth)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)


@dataclass
class StepWatch:
    """The steps that carried prompt work beside decoding streams under the step target: how
    many, the largest one's llama_decode seconds, and how many went past the target (and past
    1.5 times it), so that the target's promise is measured by the server itself. A step's
    seconds are its calls' (`call`), summed until the next plan starts one (`start`)."""
    target_s: float = 0.0
    steps: int = 0
    max_s: float = 0.0
    over: int = 0          # past the target
    over_half: int = 0     # past 1.5 times the target
    seconds: float = 0.0   # the step being planned or run: its calls so far
    watched: bool = False  # whether that step counts
    max_wall_s: float = 0.0   # the largest watched step from its plan to the next plan
    planned_at: float = 0.0   # when the step being run was planned (perf_counter)

    def start(self, watched: bool, now: float | None = None) -> None:
        """A new step is planned: the one before it is counted, if it was watched."""
        now = time.perf_counter() if now is None else now
        if self.watched:
            wall = now - self.planned_at
            self.steps += 1
            self.max_s = max(self.max_s, self.seconds)
            self.max_wall_s = max(self.max_wall_s, wall)
            self.over += self.seconds > self.target_s
            self.over_half += self.seconds > 1.5 * self.target_s
            if max(self.seconds, wall) > 1.5 * self.target_s:
                log.info("a step beside decoding streams took %.3f s in llama_decode, %.3f s "
                         "from its plan to the next (target %.3f s)", self.seconds, wall,
                         self.target_s)
        self.watched, self.seconds, self.planned_at = watched, 0.0, now

    def call(self, seconds: float) -> None:
        self.seconds += seconds

    def report(self) -> dict:
        return {"target_ms": round(1000 * self.target_s, 1), "steps": self.steps,
                "max_ms": round(1000 * self.max_s, 1),
                "max_wall_ms": round(1000 * self.max_wall_s, 1), "over_target": self.over,
                "over_1_5x_target": self.over_half}
