"""Where each sequence of a context is, and its KV blocks as it moves between places: waiting
(new, swapped out, or to compute again), running, finished. `Queues` holds the queues and
every move between them; the step planner (scheduler/scheduler.py, `Scheduler`, a `Queues`)
decides when a sequence moves, and the engine asks for some moves itself (abort, fork, reopen,
preempt_one). Apart from the planner because these moves keep the KV accounting true whatever
a step plans: a sequence holds blocks only while running, a swapped one holds a saved state and
counts against `max_swapped_tokens`, a finished one holds nothing.

Opening a waiting sequence (`_open`) restores its saved state, or opens it on the prefix
cache's hit (at most `_max_reuse` tokens: the exactness rule, scheduler/scheduler.py's module
doc), and only if blocks for all its tokens and one more fit beside what every running sequence
was promised on the same terms: its next chunk then never preempts anyone.

Preemption (`_preempt`) takes a running sequence off the context: by swap (its KV state saved to
RAM, restored when it opens again) while the bound on swapped tokens allows, else by recompute
(dropped; it computes its tokens again). The victim is the policy's last in order, background
work (priority BACKGROUND: Batch API lines) after everything else whatever the policy.

n > 1 is one prefill and a fork: the choices after the first wait (pending forks, never admitted
by themselves) while the first computes the prompt; then `fork` starts each from a copy of its
KV, to sample from the same logits. Admission counts a sequence's pending forks as slots and
promises blocks for them. A fork that finds no room, or whose first ended before forking,
becomes an ordinary waiting sequence that computes the prompt itself.
"""
from __future__ import annotations

from kvcache import BlockManager
from scheduler.plan import StepPlan
from scheduler.policy import Policy
from scheduler.sequence import BACKGROUND, FinishReason, Preemption, Sequence, Status


class Queues:
    """A context's sequences, waiting and running, and the moves between them (module doc)."""

    def __init__(self, manager: BlockManager, policy: Policy, *, max_seqs: int,
                 preemption: Preemption | str, max_swapped_tokens: int | None):
        if preemption not in set(Preemption):
            raise ValueError("preemption must be 'swap' or 'recompute'")
        self.manager, self.policy, self.max_seqs = manager, policy, max_seqs
        self.preemption = Preemption(preemption)
        # swap preemption keeps at most this many tokens of KV in RAM (None: no bound); a
        # sequence that would go past it is preempted by recompute instead
        self.max_swapped_tokens, self.swapped_tokens = max_swapped_tokens, 0
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.inflight: dict[int, Sequence] = {}   # block hash -> sequence computing it now
        self.expired: list[Sequence] = []         # ended by their deadline, to be reported
        self.num_preemptions = 0

    def order(self, seq: Sequence) -> tuple:
        """The policy's key, background work last (module doc)."""
        return (seq.priority >= BACKGROUND, *self.policy.key(seq))

    # ---- queue ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a sequence wherever it is: waiting, swapped out, prefilling or decoding."""
        if seq.status is Status.FINISHED:
            return
        if seq.fork_of is not None:
            seq.fork_of.forks.remove(seq)
            seq.fork_of = None
        if seq in self.waiting:
            self.waiting.remove(seq)
            if seq.saved_key is not None:
                self.manager.drop_saved(seq.saved_key)
                seq.saved_key = None
                self.swapped_tokens -= seq.num_computed
        self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.alloc is not None:
            self.manager.free(seq.allocated)
            seq.alloc = None
        for fork in seq.forks:   # ended before its prompt was computed: they start on their own
            fork.fork_of = None
        seq.forks = []
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def take_expired(self) -> list[Sequence]:
        """The sequences their deadline ended since the last call (each reported once)."""
        expired, self.expired = self.expired, []
        return expired

    def _expire(self, now: float) -> None:
        for seq in [s for s in self.waiting + self.running
                    if s.deadline is not None and s.deadline <= now]:
            self.abort(seq, FinishReason.TIMEOUT)
            self.expired.append(seq)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start parent's pending forks from a copy of its computed prompt (call when the
        prompt's last chunk was decoded, before sampling it). Returns the forks started; one
        that finds no seq id or blocks stays waiting as an ordinary sequence."""
        started = []
        for child in parent.forks:
            child.fork_of = None
            alloc = self.manager.fork(parent.allocated, parent.tokens, parent.num_computed,
                                      len(child.tokens) + 1)
            if alloc is None:
                continue
            self.waiting.remove(child)
            child.alloc, child.num_computed = alloc, parent.num_computed
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = Status.RUNNING
            child.first_scheduled_time = parent.first_scheduled_time
            self.running.append(child)
            started.append(child)
        parent.forks = []
        return started

    # ---- opening --------------------------------------------------------------------------------
    def _slots_used(self) -> int:
        return sum(s.num_slots for s in self.running)

    def _promised_blocks(self) -> int:
        """Blocks the running sequences were promised (for all their tokens and one more, and
        their pending forks) beyond those they hold."""
        return sum(self.manager.blocks_for(len(s.tokens) + 1) - len(s.allocated.blocks)
                   + self.manager.fork_blocks(len(s.tokens)) * len(s.forks)
                   for s in self.running)

    def _hashes(self, seq: Sequence) -> list[int]:
        """A sequence's chained block hashes, computed once (a recompute preemption clears them)."""
        if seq.hashes is None:
            seq.hashes = self.manager.hashes(seq.tokens)
        return seq.hashes

    def _max_reuse(self, seq: Sequence) -> int:
        """How many leading tokens may come from the prefix cache: all but two, unless a cold run
        computes the last token alone (n % C == 1), then all but that one (it must be computed
        for its logits). A 1-token piece computes other numbers than the same token inside a
        longer piece, so a hit must not leave one where a cold run has none."""
        n = len(seq.tokens)
        return n - 1 if n % self.manager.prefill_chunk == 1 else n - 2

    def _open(self, seq: Sequence) -> bool:
        """Open seq if blocks for all its tokens and one more fit beside what each running
        sequence was promised on the same terms: then its next chunk never preempts anyone."""
        promised = self._promised_blocks()
        promised += self.manager.fork_blocks(len(seq.tokens)) * len(seq.forks)
        if seq.saved_key is not None:
            alloc = self.manager.open_for_restore(seq.saved_key, seq.tokens[:seq.num_computed],
                                                  len(seq.tokens) + 1, extra_blocks=promised)
            if alloc is None:
                return False
            seq.saved_key, seq.alloc = None, alloc
            self.swapped_tokens -= seq.num_computed
            return True
        max_reuse = 0 if seq.prompt_logits else self._max_reuse(seq)
        alloc = self.manager.open(seq.tokens, max_reuse, len(seq.tokens) + 1,
                                  hashes=self._hashes(seq), extra_blocks=promised)
        if alloc is None:
            return False
        seq.alloc, seq.num_computed = alloc, alloc.num_cached
        seq.num_cached_tokens, seq.cached_tier = alloc.num_cached, alloc.tier
        return True

    # ---- preemption -----------------------------------------------------------------------------
    def _preempt_for(self, seq: Sequence, plan: StepPlan) -> bool:
        """Preempt the policy's victim so that seq may start; False when the policy says no."""
        victim = max(self.running, key=self.order) if self.running else None
        if victim is None or not (self.policy.preempts_for(seq, victim)
                                  or (victim.background and not seq.background)):
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take a running sequence off the context: swap its state to RAM or drop it (recompute)."""
        self._unplan(seq, plan)
        if self.preemption is Preemption.SWAP and seq.num_computed > 0 and (
                self.max_swapped_tokens is None
                or self.swapped_tokens + seq.num_computed <= self.max_swapped_tokens):
            seq.saved_key = self.manager.save(seq.allocated)
            self.swapped_tokens += seq.num_computed
        else:
            seq.num_computed, seq.hashes = 0, None
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(seq)

    def preempt_one(self) -> None:
        """Preempt the policy's victim (llama_decode found no KV slot after all)."""
        if self.running:
            self._preempt(max(self.running, key=self.order), StepPlan())

    def reopen(self, seq_ids: list[int], plan: StepPlan) -> None:
        """The engine could not read the snapshots these sequences were loading (a file gone or
        damaged since it was found: kvcache/snapshots/). They, and any sequence that shared the
        blocks they loaded, leave this step's plan and wait to be opened again, as if never
        opened (BlockManager.unload): the next step opens them from what is left."""
        victims = self.manager.unload(seq_ids)
        for seq in [s for s in self.running if s.alloc is not None and s.alloc.seq_id in victims]:
            self._unplan(seq, plan)
            seq.num_computed = 0
            self._requeue(seq)

    def _unplan(self, seq: Sequence, plan: StepPlan) -> None:
        """A running sequence leaves the running set and this step's plan."""
        for chunk in [c for c in plan.chunks if c.seq is seq]:
            plan.chunks.remove(chunk)
            self._release_claims(chunk.claims, seq)
        self.running.remove(seq)
        seq.draft = []

    def _requeue(self, seq: Sequence) -> None:
        """Free a sequence taken off the context (no snapshot: it comes back) and queue it."""
        self.manager.free(seq.allocated, snapshot=False)
        seq.alloc = None
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def _release_claims(self, claims: list[int], seq: Sequence) -> None:
        for h in claims:
            if self.inflight.get(h) is seq:
                del self.inflight[h]
