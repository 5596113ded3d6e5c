"""Continuous-batching scheduler for one llama.cpp context.

Each step it plans one batch within a token budget: one decode token for every running sequence
that is generating, then prompt chunks for sequences still prefilling, then admits waiting
sequences while sequence slots, seq ids, KV blocks and budget last. It thinks in "tokens computed
so far": a running sequence needs tokens[num_computed:], and a decode is just one pending token.
The queues, and every move of a sequence between them (opening, preemption, forks, aborts), are
scheduler/queues.py's (`Queues`, which `Scheduler` extends); what a step plans, the values the
engine reads, scheduler/plan.py's (`Chunk`, `StepPlan`).

Invariants the engine's exactness rests on (docs/prefix-cache.md, "Exact answers"): the
engine's kernels compute the same numbers for any cut of a prompt into pieces of 2 or more
tokens, and other numbers for a token computed as a piece of its own. So a prompt piece may span
any number of grid cells, but a prompt never leaves a 1-token piece where a cold run has none
(`_max_reuse`, in scheduler/queues.py; `_merged_end`): a cached answer is then bitwise the cold
answer.

How many prompt tokens a step takes (docs/scheduling.md): while nothing decodes, the whole
budget; while sequences decode, as many as fit the step's target time beside the decode tokens
(step_target_s, from the costs of recent steps: StepCosts), and at least one grid cell
(prefill_chunk) for every sequence that wants a prompt chunk, given in policy order so that the
first prompts finish steps earlier; a sequence waiting on another's in-flight blocks lends its
share to that one. While only a few sequences decode (few_decoding), a prompt with at most
finish_piece tokens left computes them in one piece: a few streams lose less to one longer step
than the prompt saves.

Waves (wave_batch_tokens above max_batch_tokens): when more than few_decoding prompts want
computing, at least wave_ratio times as many as the decoding streams, and all fit
wave_batch_tokens, the step takes them all, whole: their streams decode in step and finish
together, and their clients' next requests come back together as the next wave (the worker
waits a moment for them: engine/gather.py).

n > 1 is one prefill and a fork (scheduler/queues.py): pending forks are never admitted by
themselves; the engine forks them (`fork`) once the first has computed the prompt.

Background work (priority BACKGROUND: Batch API lines) comes after everything else in the
policy's order, whatever the policy: it is admitted last, preempted first, and a waiting
foreground sequence may preempt it. While any foreground sequence is running or waiting, a
step plans nothing for background sequences: they are paused where they are (their KV and seq
ids kept), so the foreground streams get every step at the cost they have alone. While
background work runs alone, a client's request arriving stops the step running
(engine/worker.py; the step's pieces are planned again: `stopped`), so it waits for no
background step (`background_stops`; where that cannot happen, a context on a GPU, it waits for
one short step at most). Background steps are short (prompt tokens within BACKGROUND_STEP_S,
one grid cell at least; no waves) while clients' requests come and go: a long step would be
stopped by the next request before it ends, and the work lost each time (a batch beside short
chats then made no progress at all). Once no client's request has run or waited for
BACKGROUND_QUIET_S, background work alone is planned as a client's requests are: lines that
start together are a wave, computed whole and decoded in step (short steps cost a batch alone
~15 % of its speed: more steps, each with several llama.cpp calls with split KV).
"""
from __future__ import annotations

import math
import time

from kvcache import BlockManager
from scheduler.costs import StepCosts, StepWatch
from scheduler.plan import Chunk, StepPlan
from scheduler.policy import Policy
from scheduler.queues import Queues
from scheduler.sequence import Preemption, Sequence, Status
from scheduler.speculation import Candidate, choose

# While background work runs alone and cannot be stopped, a step's prompt tokens fit this many
# seconds (module doc).
BACKGROUND_STEP_S = 0.1

# Background work alone is planned as a client's (waves, the step target) once no client's
# request has run or waited for this many seconds (module doc).
BACKGROUND_QUIET_S = 2.0

# A wave: prompts wanting computing at least this many times the decoding streams (module doc).
WAVE_RATIO = 2.0

# While at most FEW_DECODING sequences decode, a prompt with at most FINISH_PIECE tokens left
# computes them in one piece (module doc).
FEW_DECODING = 4
FINISH_PIECE = 128


class Scheduler(Queues):
    """Plans each step of one context over its queues (module doc)."""

    def __init__(self, manager: BlockManager, policy: Policy, *, max_seqs: int = 16,
                 max_batch_tokens: int = 256, preemption: Preemption | str = Preemption.SWAP,
                 wave_batch_tokens: int = 0, step_target_s: float = 0.0,
                 max_step_tokens: int | None = None, max_swapped_tokens: int | None = None,
                 wave_ratio: float = WAVE_RATIO,
                 few_decoding: int = FEW_DECODING, finish_piece: int = FINISH_PIECE,
                 max_draft: int = 0, draft_always: bool = False,
                 background_stops: bool = False):
        if max_batch_tokens < max_seqs + manager.prefill_chunk:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be at least max_seqs "
                             f"({max_seqs}) + prefill chunk ({manager.prefill_chunk})")
        super().__init__(manager, policy, max_seqs=max_seqs, preemption=preemption,
                         max_swapped_tokens=max_swapped_tokens)
        self.max_batch_tokens = max_batch_tokens
        self.wave_batch_tokens, self.wave_ratio = wave_batch_tokens, wave_ratio   # module doc
        # prompt tokens beside decoding streams by the time a step may take (0: one cell each)
        self.step_target_s, self.costs = step_target_s, StepCosts()
        self.watch = StepWatch(step_target_s)   # steps with prompt work beside streams, timed
        # seconds of the target the next steps leave free (a prefix copy waits: the engine's
        # scheduler/save_pacing.py)
        self.reserved_s = 0.0
        self.max_step_tokens = max_step_tokens or max(max_batch_tokens, wave_batch_tokens)
        self.few_decoding, self.finish_piece = few_decoding, finish_piece
        self.max_draft = max_draft   # drafted tokens a sequence may verify in a step (0: none)
        self.draft_always = draft_always   # every draft verified whole (tests, measurements)
        self.lending: dict[Sequence, set[Sequence]] = {}   # prompt done -> prompts it waits on
        self.paused = False   # background sequences wait this step (module doc)
        # a client's request stops a step of background work alone (module doc): such steps
        # need not be short
        self.background_stops = background_stops
        self.foreground_at = -math.inf   # when a client's request last ran or waited

    # ---- planning -------------------------------------------------------------------------------
    def background_waits(self) -> bool:
        """Whether background sequences are paused in the next step: a request of a client runs
        or waits (module doc)."""
        return any(not s.background for s in (*self.running, *self.waiting))

    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.monotonic() if now is None else now
        self._expire(now)
        plan = StepPlan()
        self.running.sort(key=self.order)
        self.paused = self.background_waits()
        if self.paused:
            self.foreground_at = now
        for seq in [s for s in self.running if s.is_decoding]:
            if seq.status is Status.RUNNING and not (self.paused and seq.background):
                self._plan(seq, 1, plan)
        self._plan_drafts(plan)
        background = plan.background = not self.paused and self.has_work()   # (module doc)
        short = background and (not self.background_stops
                                or now - self.foreground_at < BACKGROUND_QUIET_S)
        plan.wave = not short and self.is_wave(len(plan.chunks))
        plan.budget = self.wave_batch_tokens if plan.wave else self.max_batch_tokens
        if short:   # short steps: foreground work arriving waits for one of them at most
            timed = self.costs.prompt_tokens_within(BACKGROUND_STEP_S, bool(plan.chunks))
            plan.allowance = max(self.manager.prefill_chunk, timed or 0)
        elif not plan.wave:
            plan.allowance = self._prefill_allowance(plan)
        if plan.allowance is not None and not short:   # a step may grow to the target
            plan.budget = max(plan.budget, min(self.max_step_tokens,
                                               plan.num_tokens + plan.allowance))
            if len(plan.chunks) <= self.few_decoding:
                plan.finish_within = self.finish_piece
        for seq in [s for s in self.running if not s.is_decoding]:
            if seq.status is Status.RUNNING and not (self.paused and seq.background):
                self._plan_prefill(seq, plan)
        self._admit(plan)
        plan.ops = self.manager.take_ops()
        self.watch.start(plan.allowance is not None and self.step_target_s > 0
                         and any(c.end - c.start > 1 and not c.drafted for c in plan.chunks)
                         and any(c.end - c.start == 1 or c.drafted for c in plan.chunks))
        return plan

    def advance(self, plan: StepPlan) -> None:
        """The plan's batch was decoded: move progress and register newly filled blocks."""
        done = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.wants_logits and not chunk.drafted and (chunk.end - chunk.start > 1
                                                             or chunk.start < seq.num_prompt):
                done.append(seq)   # a prompt (or a preempted sequence's recompute) finished
            if chunk.start < seq.num_prompt and not chunk.drafted:
                seq.prompt_steps += 1
            seq.num_computed = chunk.end - chunk.drafted   # drafted ones: once accepted
            self.manager.commit(seq.allocated, seq.tokens, seq.num_computed)
            for h in chunk.claims:
                if self.inflight.get(h) is seq:
                    del self.inflight[h]
        if done:
            wanting = {s for s in self.running if not s.is_decoding}
            for seq in done:
                if wanting:
                    self.lending[seq] = set(wanting)

    def observe_call(self, chunks: list[Chunk], seconds: float,
                     learn: bool = True) -> float | None:
        """One llama_decode call of these chunks took `seconds`: what it cost, for sizing prompt
        chunks by time and for the speculation policy (StepCosts). A call of 1-token pieces is
        the decoding streams' part of a step (verification pieces count as decoding tokens);
        the prompt tokens of a call with longer pieces cost what is left of it. Returns what
        the call was expected to take by the calls before it (None: not known yet). Not `learn`:
        the call also did other work (stream copies), so its time teaches nothing."""
        costs = self.costs
        pieces = [(c.end - c.start, c.start) for c in chunks
                  if c.end - c.start > 1 and not c.drafted]
        prompt = sum(n for n, _ in pieces)
        decode = sum(c.end - c.start for c in chunks) - prompt
        expected = costs.expected(decode, prompt, pieces)
        if learn and not prompt:
            lengths = {c.end - c.start for c in chunks}
            costs.observe_decode(seconds, decode, len(chunks) if len(lengths) == 1 else None)
        elif learn:
            costs.observe_prompt(prompt, seconds - ((costs.decode_time(decode) or 0.0)
                                                    if decode else 0.0), pieces)
        self.watch.call(seconds)
        return expected

    def set_draft(self, seq: Sequence, tokens: list[int], rate: float,
                  gains: tuple[float, ...] = ()) -> None:
        """The tokens guessed to follow a decoding sequence's last one, for the next plan to
        verify where that pays (`_plan_drafts` cuts them to what the step verifies): `rate`,
        how likely a drafted token is accepted; `gains`, the accepted tokens to expect of its
        first m, m = 1, 2, ... (scheduler/speculation.py)."""
        seq.draft, seq.draft_rate, seq.draft_gains = tokens, rate, gains

    def accept_draft(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """The model checked the `drafted` tokens a sequence verified and accepted the first
        `accepted` of them (the engine appended them to its tokens, with the model's own next
        token after them): their KV is the sequence's; the rest leaves the KV (a rollback)."""
        seq.draft = []
        seq.num_computed += accepted
        if accepted < drafted:
            self.manager.rollback(seq.allocated, seq.num_computed)
        self.manager.commit(seq.allocated, seq.tokens, seq.num_computed)

    def is_wave(self, decoding: int, arriving: int = 0) -> bool:
        """Whether the prompts that want computing (and `arriving` more) make a wave beside
        `decoding` streams: more than few_decoding of them (fewer are cheaper beside the
        streams, module doc), at least wave_ratio times as many as the streams, and, while any
        stream decodes, all of them fit one step."""
        if self.wave_batch_tokens <= self.max_batch_tokens:
            return False
        free = self.max_seqs - self._slots_used()
        new = [s for s in self.waiting if s.fork_of is None][:max(free, 0)]
        wanting = [s for s in self.running if not s.is_decoding] + new
        n = len(wanting) + arriving
        if n <= self.few_decoding or n < self.wave_ratio * decoding:
            return False
        return (decoding == 0 or sum(map(self._to_compute, wanting)) + decoding
                <= self.wave_batch_tokens)

    def _to_compute(self, seq: Sequence) -> int:
        """Prompt tokens a sequence has still to compute; for one not yet started, less the
        leading blocks the prefix cache holds or another sequence is computing now."""
        n = len(seq.tokens)
        if seq.alloc is not None or seq.saved_key is not None or seq.prompt_logits:
            return n - seq.num_computed
        held = 0
        for h in self._hashes(seq):
            if h not in self.manager.cache and h not in self.inflight:
                break
            held += 1
        return n - min(held * self.manager.block_size, self._max_reuse(seq))

    def _plan_drafts(self, plan: StepPlan) -> None:
        """Let decoding sequences verify their drafts where that pays (scheduler/speculation.py,
        from the measured costs): one draft length for the step, the chosen sequences' pieces
        grow by it. Drafts take only blocks nobody was promised and leave a grid cell of the
        budget to prompts, so a draft never preempts nor stops a prompt."""
        chunks = plan.chunks
        candidates = [Candidate(i, len(c.seq.draft), c.seq.draft_rate, c.seq.draft_gains)
                      for i, c in enumerate(chunks) if c.seq.draft]
        model = self.costs.call_model() if candidates and self.max_draft else None
        if self.draft_always and candidates and self.max_draft:
            lengths = {c.key: min(c.available, self.max_draft) for c in candidates}
        elif (model is not None and not self._prompt_work()
              and self.costs.drafts_pay(len(chunks))):
            choice = choose(candidates, len(chunks), *model, self.costs.overhead_s or 0.0,
                            max_length=self.max_draft, cost=self.costs.call_cost(),
                            draft_factor=self.costs.draft_factor)
            lengths = dict.fromkeys(choice.keys, choice.length)
            plan.draft_s = choice.decode_s if choice.length else 0.0
        else:
            lengths = {}
        spare = len(self.manager.free_list) - self._promised_blocks()
        budget = self.max_batch_tokens - len(chunks) - self.manager.prefill_chunk
        bs = self.manager.block_size
        for i, c in enumerate(chunks):
            seq, m = c.seq, lengths.get(i, 0)
            held = len(seq.allocated.blocks)
            m = min(m, budget, (held + max(spare, 0)) * bs - seq.num_computed - 1)
            if m > 0:
                need = self.manager.blocks_for(seq.num_computed + 1 + m) - held
                assert self.manager.ensure(seq.allocated, seq.num_computed + 1 + m)
                spare, budget = spare - max(need, 0), budget - m
                seq.draft = seq.draft[:m]
                c.end += m
                c.drafted = m
            else:
                seq.draft = []

    def _prompt_work(self) -> bool:
        """Whether this step will carry prompt tokens: a running prompt, or a waiting request
        with a free sequence. Such a step is compute-bound by its prompt, and its time (set by
        the step target, not by the drafts) says nothing of what drafts cost, so the adaptive
        policy drafts only in steps of decoding alone."""
        if any(not s.is_decoding and s.status is Status.RUNNING for s in self.running):
            return True
        return bool(self.waiting) and self._slots_used() < self.max_seqs

    def _prefill_allowance(self, plan: StepPlan) -> int | None:
        """Prompt tokens this step may take once its decode tokens are planned (module doc)."""
        wanting = {s for s in self.running
                   if not s.is_decoding and not (self.paused and s.background)}
        for lender, waits_on in list(self.lending.items()):
            waits_on &= wanting
            if not waits_on or lender.status is not Status.RUNNING:
                del self.lending[lender]
        if not plan.chunks:
            return None   # nothing decodes: only the budget limits
        chunk = self.manager.prefill_chunk
        free = self.max_seqs - self._slots_used()
        admissible = min(max(free, 0), sum(1 for s in self.waiting if s.fork_of is None
                                           and not (self.paused and s.background)))
        cells = sum(self._cell_end(s) - s.num_computed for s in wanting)
        lent = set(self.lending).union(*self.lending.values()) if self.lending else ()
        allowance = max(cells + admissible * chunk, len(lent) * chunk)
        deepest = max((s.num_computed for s in wanting), default=0)
        target = max(0.0, self.step_target_s - self.reserved_s)
        timed = (self.costs.prompt_tokens_within(target, decoding=True, depth=deepest)
                 if self.step_target_s and (wanting or admissible) else None)
        return allowance if timed is None else max(allowance, timed)

    def _plan_prefill(self, seq: Sequence, plan: StepPlan) -> bool:
        budget = plan.budget - plan.num_tokens
        share = budget if plan.allowance is None else min(
            budget, plan.allowance - (plan.num_prompt_tokens - plan.finishing))
        if budget <= 0 or (share <= 0 and len(seq.tokens) - seq.num_computed > plan.finish_within):
            return False
        if not seq.is_decoding and not seq.prompt_logits:
            gained = self.manager.extend(seq.allocated, seq.tokens, seq.num_computed,
                                         self._max_reuse(seq))
            seq.num_computed += gained
            seq.num_cached_tokens += gained
        start = seq.num_computed
        finishing = len(seq.tokens) - start <= plan.finish_within   # module doc: few decoding
        if not finishing:
            budget = share
        end = self._cell_end(seq)
        if end - start > budget:
            return False
        if not seq.prompt_logits:
            end = self._merged_end(seq, start, end, budget)
        claims = self._claims(seq, start, end)
        if claims is None or not self._plan(seq, end - start, plan, claims):
            return False
        if finishing:
            plan.finishing += end - start
        return True

    def _cell_end(self, seq: Sequence) -> int:
        """Where the grid cell a sequence's next prompt chunk starts in ends (or its tail)."""
        chunk = self.manager.prefill_chunk
        return min((seq.num_computed // chunk + 1) * chunk, len(seq.tokens))

    def _merged_end(self, seq: Sequence, start: int, end: int, budget: int) -> int:
        """Several grid cells of one prompt in one piece, as far as the budget (and while
        sequences decode, the allowance) reaches. Exact because any cut of a prompt into pieces
        of 2 or more tokens computes the same numbers (module doc), so a piece may span cells
        as long as a 1-token tail stays a piece of its own, as it is on the grid (a cache hit
        can leave exactly that token)."""
        n, chunk = len(seq.tokens), self.manager.prefill_chunk
        limit = min(n, start + budget)
        if limit == n and n % chunk != 1:
            return n
        return max(end, limit // chunk * chunk)

    def _claims(self, seq: Sequence, start: int, end: int) -> list[int] | None:
        """Hashes of the full blocks in [start, end) this sequence would compute first, or None
        when another running sequence is computing one of them now (then ride on its work)."""
        hashes = seq.alloc.hashes if seq.alloc else []
        if not self.manager.prefix_caching or not hashes:
            return []
        bs = self.manager.block_size
        mine = hashes[start // bs:min(end // bs, len(hashes))]
        for h in mine:
            other = self.inflight.get(h)
            if other is not None and other is not seq and other.status is Status.RUNNING:
                return None
        for h in mine:
            self.inflight[h] = seq
        return mine

    def _plan(self, seq: Sequence, n: int, plan: StepPlan, claims: list[int] | None = None) -> bool:
        """Add n tokens of seq to the plan, preempting by policy when KV blocks run out."""
        while not self.manager.ensure(seq.allocated, seq.num_computed + n):
            victim = max(self.running, key=self.order)
            self._preempt(victim, plan)
            if victim is seq:
                self._release_claims(claims or [], seq)
                return False
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        plan.chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n, claims or []))
        return True

    def _admit(self, plan: StepPlan) -> None:
        """Start waiting sequences in policy order while slots, seq ids, blocks and budget last.
        Each round admits one sequence, preempts one, or ends admission for this step: a sequence
        preempted in this step waits for the next, and so does everything behind a sequence
        that was admitted but then found no room to run."""
        self.waiting.sort(key=self.order)
        while plan.num_tokens < plan.budget:
            seq = next((s for s in self.waiting if s.fork_of is None   # forks wait
                        and not (plan.wave and self._rides(s))
                        and not (self.paused and s.background)), None)
            if seq is None or seq in plan.preempted:
                return
            if self._slots_used() + seq.num_slots > self.max_seqs or not self._open(seq):
                if not self._preempt_for(seq, plan):
                    return
                continue
            self.waiting.remove(seq)
            if not self._start(seq, plan):
                return

    def _rides(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's prompt goes on into blocks another sequence is computing
        in this step. A wave leaves it waiting and opens it in the next step with the whole hit:
        opened now on a hit that ends inside a block (a cached template head), it could not take
        the blocks computed meanwhile (BlockManager.extend) and would compute them again."""
        if not self.inflight or seq.alloc is not None or seq.saved_key is not None:
            return False
        for h in self._hashes(seq):
            if h not in self.manager.cache:
                return h in self.inflight
        return False

    def _start(self, seq: Sequence, plan: StepPlan) -> bool:
        """Run an admitted sequence. False when planning it preempted it again."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        if seq.is_decoding:
            self._plan(seq, 1, plan)
        else:
            self._plan_prefill(seq, plan)
        return seq.status is Status.RUNNING

    def stopped(self, chunks: list[Chunk]) -> None:
        """These chunks' decode was stopped part-way (a step of background work alone, stopped
        for a client's request: module doc) and their KV positions removed: nothing of them
        counts, and they are planned again. Their blocks stay allocated; the blocks they were
        to compute first are free for another sequence to claim, and the drafts they were to
        verify are dropped (drafted again)."""
        for chunk in chunks:
            self._release_claims(chunk.claims, chunk.seq)
            if chunk.drafted:
                chunk.seq.draft = []

