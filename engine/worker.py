"""The step loop: one worker thread per llama.cpp context.

Each step (`Worker._step`): propose drafts (engine/speculation.py), plan (the scheduler: which
sequences, how many tokens each, which drafts verify, which KV operations first), apply the
plan's KV operations (a snapshot of the prefix cache's tiers that cannot be read sends the
sequences loading it back to be planned again: Scheduler.reopen), end the requests whose deadline
passed, decode the batch (one `llama_decode`, or with split KV one call per micro-batch shape:
engine/batch_shape.py; the GIL is released inside), sample every sequence that produced logits
and verify the drafted tokens of verification pieces (Output.sample_call, verify_call), apply
the frees of what finished, and hand the step's new text to the event loop in one hand-off
(engine/handoff.py). KV operations reach llama.cpp through `Context.apply` (engine/llama.py).
What becomes of each sampled token (appended, stop checks, logprobs) and how a request ends are
engine/output.py's. Speculation's state and decisions are engine/speculation.py's: the worker
calls it at those points, and drafts reach the scheduler through the scheduler's methods.

Invariants:
- The HTTP event loop never calls llama.cpp; it reads only what the worker publishes (immutable
  ContextStats snapshots, the frozen set of cached block hashes), never the scheduler's or the
  block manager's live structures. It talks to the worker through the inbox (Admit, Cancel).
- What fails for one request (its sampler, grammar, stop strings, logprobs) ends that request
  alone and frees it; only a failing `llama_decode` fails the context's requests.
- Every request submitted is finished exactly once (`finished` counts it), whatever ends it.

Around the step: between steps the thread lease follows the contention governor and the
process's shared core budget (engine/lease.py); before a step that would start a wave of
prompts the worker waits a moment for the rest of it (engine/gather.py); after a step (and,
with a disk tier, when there is nothing to do) a finished sequence's prefix is copied to the
cache tiers when the copy fits the step target (scheduler/save_pacing.py). A request with a
grammar samples through its mask (engine/grammar.py); logprobs are computed only for requests
that ask. n > 1 arrives as one request with forks: they wait while it computes the prompt, then
start from a copy of its KV (Scheduler.fork) and sample from the same logits (restored between
samplers, since logit_bias is added in place), each with its own sampler and seed. A prompt
whose logprobs are asked (echo) gets logits for every prompt position and no prefix-cache reuse.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import replace

from engine.batch_shape import call_groups, micro_batches
from engine.config import EngineConfig
from engine.detok import TextStream
from engine.gather import WaveGather
from engine.grammar import tokenizer_for
from engine.handoff import hand_over
from engine.lease import ThreadLease
from engine.llama import Context, ContextConfig
from engine.model import Model
from engine.output import Delivery, Output, describe
from engine.prefix_space import tier_space
from engine.request import Admit, Cancel, ErrorKind, InboxMessage, Request
from engine.sampling import Sampler
from engine.speculation import Speculation, speculation_mode
from engine.stats import ContextStats, StepTimes
from engine.threads import CoreBudget
from kvcache import BlockManager, PrefixStore, block_hashes
from scheduler import FinishReason, Scheduler, Sequence, StepPlan, make_policy
from scheduler.save_pacing import SavePacer
from scheduler.sequence import BACKGROUND

log = logging.getLogger("pagedllama.engine")


class Observer:
    """Hooks for metrics; called from the worker thread. The default does nothing."""

    def on_step(self, worker: Worker, num_tokens: int, seconds: float) -> None: ...

    def on_token(self, worker: Worker, req: Request, now: float) -> None: ...

    def on_finish(self, worker: Worker, req: Request) -> None: ...

    def on_background_stop(self, worker: Worker, chunks: list, cut: bool) -> None:
        """A step of background work stopped for a client's request: `cut` when its
        llama_decode was cut part-way (it returned 2), else skipped before it began. The
        chunks' KV positions are removed already and they will be planned again."""


class QueueFull(Exception):
    pass


# A decode call this many times slower than calls of its shape lately (and by this much) means
# contention for our cores: a neighbour stalls threads that meet at barriers tens of times over,
# while steps vary by far less than this on their own. The lease gives up a thread at once.
SLOW_STEP = 4.0
SLOW_STEP_MARGIN_S = 0.05

# A finished sequence's prefix is saved to the cache tiers at once when its copy fits the step
# target (between two steps while streams run, or, with a disk tier, when the context has
# nothing to do: scheduler/save_pacing.py); otherwise once the context has had nothing to do for
# this long (a copy takes up to a second, and a request arriving meanwhile waits for it).
SAVE_AFTER_IDLE_S = 1.0
IDLE_SAMPLE_S = 0.5   # while idle, a CPU sample this often for the thread governor


class Worker:
    """One llama.cpp context and the thread that runs its step loop."""

    def __init__(self, name: str, model: Model, config: EngineConfig,
                 observer: Observer | None = None, publish_prefixes: bool = False,
                 budget: CoreBudget | None = None, tiers: PrefixStore | None = None):
        """`publish_prefixes`: publish the cached block hashes after each step (for routing
        between replicas); `budget`: threads shared with the process's other contexts;
        `tiers`: the prefix cache's RAM and disk tiers (kvcache/snapshots/)."""
        config = config.resolved_for(model)
        assert config.flash_attn is not None and config.max_batch_tokens is not None
        self.name, self.model, self.config = name, model, config
        self.observer = observer or Observer()
        self.context = Context(model, ContextConfig(
            n_ctx=config.total_cells, n_seq_max=config.n_seq_max, n_batch=config.step_tokens,
            n_threads=config.n_threads, kv_unified=config.kv_unified,
            flash_attn=config.flash_attn, kv_type=config.kv_type,
            n_outputs_max=config.n_outputs_max))
        self.speculative, self.speculative_note = speculation_mode(name, model, self.context,
                                                                   config)
        if tiers is not None and config.prefix_caching:
            self.context.tiers = tier_space(tiers, model, self.context, config)
        self.manager = BlockManager(
            config.total_cells // config.block_size, block_size=config.block_size,
            num_seq_ids=config.n_seq_max, prefix_caching=config.prefix_caching,
            prefill_chunk=config.prefill_chunk, share_cells=config.kv_unified,
            tiers=self.context.tiers, stream_cells=self.context.n_ctx_seq)
        self.scheduler = Scheduler(
            self.manager, make_policy(config.scheduler), max_seqs=config.max_seqs,
            max_batch_tokens=config.max_batch_tokens, preemption=config.preemption,
            wave_batch_tokens=config.wave_batch_tokens,
            step_target_s=config.step_target_ms / 1000, max_step_tokens=config.step_tokens,
            max_swapped_tokens=config.max_swapped_tokens,
            max_draft=config.max_draft if self.speculative else 0,
            draft_always=config.spec_policy == "always",
            background_stops=self.context.can_stop)
        self.pacer = SavePacer(config.step_target_ms / 1000)   # prefix copies while busy
        self.max_seq_len = min(config.n_ctx, self.context.n_ctx_seq)
        self.speculation = Speculation(config, self.scheduler, self.speculative, self.max_seq_len)
        self.output = Output(name, model, self.context, self.scheduler, self.speculation,
                             self.max_seq_len,
                             on_token=lambda req, now: self.observer.on_token(self, req, now),
                             on_finish=lambda req: self.observer.on_finish(self, req))
        self.inbox: deque[InboxMessage] = deque()
        self.wakeup = threading.Event()
        self.submitted = 0            # written by the event loop only
        self.failed: str | None = None
        self.lease = ThreadLease(name, config.n_threads, config.thread_share,
                                 config.adaptive_threads, budget)
        self.gather = WaveGather(self.scheduler, self.wakeup, self._drain_inbox)
        self.times = StepTimes()
        self._step_decode_s = 0.0     # this step's time inside llama_decode
        self._step_stopped = False    # this step's decode was stopped for a client's request
        self.publish_prefixes = publish_prefixes
        self.cached_hashes: frozenset[int] = frozenset()   # published for the router
        self.stats = self._collect_stats()                 # published for /health and metrics
        self._stop = False
        self.sleeping = False         # waiting for a request with nothing left to do (tests)
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    @property
    def steps(self) -> int:
        return self.times.steps

    # ---- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wakeup.set()
        self._thread.join(timeout=10)
        self.context.close()

    def submit(self, req: Request, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request and its forks (n > 1); their events go to one queue (`queue` when
        given: a list of prompts shares one), each carrying its request's index."""
        group = req.group
        if self.outstanding + len(group) > self.config.max_seqs + self.config.max_queue:
            raise QueueFull(f"{self.outstanding} requests in flight on {self.name}")
        loop, queue = asyncio.get_running_loop(), queue or asyncio.Queue()
        for r in group:
            r.loop, r.queue = loop, queue
        self.submitted += len(group)
        self.inbox.append(Admit(req))
        self.wakeup.set()
        if req.priority < BACKGROUND:   # a step of background work alone stops for it
            self.context.request_stop()
        return queue

    @property
    def finished(self) -> int:
        """Requests ended (written by the worker thread only)."""
        return self.output.finished

    @property
    def outstanding(self) -> int:
        return self.submitted - self.finished

    def cancel(self, req: Request) -> None:
        self.inbox.append(Cancel(req))
        self.wakeup.set()

    def snapshot(self) -> ContextStats:
        """The latest published counts (the outstanding count is the event loop's own)."""
        stats = self.stats
        if stats.outstanding == self.outstanding:
            return stats
        return replace(stats, outstanding=self.outstanding)

    def cached_prefix(self, tokens: list[int]) -> int:
        """Leading tokens of this prompt whose blocks the context's prefix cache held at the
        end of the last step (published by the worker; for routing between replicas)."""
        cached, n = self.cached_hashes, 0
        if not cached:
            return 0
        for h in block_hashes(tokens, self.config.block_size):
            if h not in cached:
                break
            n += 1
        return n * self.config.block_size

    # ---- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                try:
                    self._drain_inbox()
                    self.context.apply(self.manager.take_ops())   # frees of cancelled requests
                    if not self.scheduler.has_work():
                        self._wait_for_work()
                        continue
                    self.gather.wait()
                    self._step()
                except Exception as exc:   # a broken context fails its own requests only
                    log.exception("engine %s step failed", self.name)
                    self._fail_all(f"engine error: {exc}")
            self._save_snapshots(all_of_them=True)   # an unload or a shutdown: keep them
        finally:   # however the thread ends, it no longer keeps the others on their own share
            self.lease.idle()

    def _save_snapshots(self, all_of_them: bool = False, limit: int | None = None) -> None:
        """Save finished sequences' prefixes to the tiers (kvcache/tier_link.py: they wait for a
        moment with nothing else to do, or for room beside running streams), one at a time
        until a request arrives (a copy takes up to a second: the next turn of a conversation
        finds its prefix in the streams anyway), `limit` of them at most; `all_of_them` when
        stopping."""
        try:
            while (self.manager.unsaved and (all_of_them or not self.inbox)
                   and (limit is None or limit > 0)):
                self.context.apply(self.manager.take_snapshots(limit=1))
                limit = None if limit is None else limit - 1
        except Exception:   # the tiers are a cache: a failure here fails no request
            log.exception("engine %s: saving prefixes to the cache tiers failed", self.name)

    def _wait_for_work(self) -> None:
        # with a disk tier, a copy that fits the step target is made at once (on disk it
        # outlives this process, and a replica killed a moment later loses no turn): a request
        # arriving meanwhile waits no longer than a stream waits beside a step
        # (scheduler/save_pacing.py). With RAM only it waits for the idle moment below, and the
        # next turn, which usually finds its prefix in the streams anyway, never waits for it.
        tiers = self.context.tiers
        if tiers is not None and tiers.store.disk_writable:
            while self.manager.unsaved and not self.inbox and self._save_paced(0.0):
                pass
        if self.manager.unsaved:   # saved once the context has been idle a moment: an agent's
            self.lease.pause()     # next request, which continues the last one, comes sooner
            self._publish()
            if self.wakeup.wait(SAVE_AFTER_IDLE_S):
                self.wakeup.clear()
                return
            self._save_snapshots()
        if self.inbox or self._stop:
            return
        self.lease.pause()
        self._publish()
        self.sleeping = True   # every op applied, every prefix saved: nothing left to do
        while not self.wakeup.wait(IDLE_SAMPLE_S):   # what the machine does meanwhile decides
            self.lease.idle_sample()                 # whether dropped threads come back
        self.sleeping = False
        self.wakeup.clear()

    def _drain_inbox(self) -> None:
        while self.inbox:
            message = self.inbox.popleft()
            if isinstance(message, Admit):
                self._admit(message.req)
            elif message.req.state.seq is not None and not message.req.finished:
                self.output.finish(message.req, FinishReason.ABORT)   # the client left: no delivery

    def _admit(self, req: Request) -> None:
        """Admit a request and its forks together, or, if any of them cannot be set up (its
        sampler, grammar or text stream raised), end them all with an error event: their
        parameters were refused (ValueError: a 400) or the engine failed (a 500)."""
        try:
            seq, *forks = [self._prepare(r) for r in req.group]
        except Exception as exc:
            kind = ErrorKind.INVALID if isinstance(exc, ValueError) else ErrorKind.ENGINE
            log.warning("engine %s: request %d could not be admitted: %r", self.name, req.id,
                        exc)
            self._deliver([self.output.finish(r, FinishReason.ERROR, error=describe(exc),
                                              kind=kind) for r in req.group])
            return
        seq.prompt_logits = req.params.prompt_logprobs
        for fork in forks:
            fork.fork_of = seq
            seq.forks.append(fork)
        for s in (seq, *forks):
            self.scheduler.add(s)

    def _prepare(self, req: Request) -> Sequence:
        """A request's sequence (not yet in the scheduler), sampler and text stream."""
        p = req.params
        max_tokens = (p.max_tokens if p.max_tokens is not None
                      else self.max_seq_len - len(req.prompt))
        deadline = req.arrival_time + req.timeout if req.timeout else None
        state = req.state
        state.seq = Sequence(req.prompt, max_tokens, req.priority, deadline, owner=req)
        state.sampler = Sampler(p, self.model.n_vocab,
                                tokenizer_for(self.model) if p.grammar else None)
        state.stream = TextStream(self.model.piece, p.stop)
        self.speculation.start(req)
        return state.seq

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.lease.adapt(self.context)
        self.scheduler.costs.follow_threads(self.lease.threads)   # scheduler/costs.py
        self.speculation.propose()
        if self.context.tiers is not None and self.scheduler.waiting:
            self.context.tiers.refresh()   # other processes' new snapshots, before planning
        plan = self.scheduler.schedule()
        unread = self.context.apply(plan.ops)
        if unread:   # a snapshot to load could not be read: its sequences are planned again
            self.scheduler.reopen(unread, plan)
            self.context.apply(self.manager.take_ops())
        events = [self.output.finish(s.owner, FinishReason.TIMEOUT)   # the scheduler ended them
                  for s in self.scheduler.take_expired()]
        self.stats = self._collect_stats(self.stats.step_ms)   # what runs during this decode
        self.times.plan_s += time.perf_counter() - t0
        if plan.chunks:
            events += self.lease.run(self.context, lambda: self._run_plan(plan))
        elif not events:
            self.wakeup.wait(0.005)   # waiting requests that cannot start yet
            self.wakeup.clear()
        t1 = time.perf_counter()
        self.gather.expect(sum(1 for _, e in events if e.finish_reason))
        self.context.apply(self.manager.take_ops())   # frees of requests that finished this step
        self._deliver(events)
        self._publish()
        t2 = time.perf_counter()
        self.times.deliver_s += t2 - t1
        if plan.chunks and not self._step_stopped:   # what the step cost outside llama_decode
            self.scheduler.costs.observe_overhead(t2 - t0 - self._step_decode_s)
            self.speculation.observe_step(plan, t2 - t0, self._step_decode_s)
        if plan.chunks and self.manager.unsaved and self.scheduler.has_work():
            self._save_while_busy(t2 - t0)
        else:
            self.scheduler.reserved_s = 0.0

    def _save_while_busy(self, step_s: float) -> None:
        """Streams run on: copy the oldest finished sequence's prefix to the tiers now if the
        copy fits the step target beside the step just run (step_s), else have the next step
        leave room for it (scheduler/save_pacing.py)."""
        if self._save_paced(step_s):
            self.scheduler.reserved_s = 0.0
        else:   # reserve_s(0) is 0: nothing left to save
            n_tokens = len(next(iter(self.manager.unsaved.values()), ()))
            self.scheduler.reserved_s = self.pacer.reserve_s(n_tokens)

    def _save_paced(self, step_s: float) -> bool:
        """Copy the oldest finished sequence's prefix to the tiers if the copy fits the step
        target beside a step of step_s (0: the context is idle); whether one was copied."""
        n_tokens = len(next(iter(self.manager.unsaved.values())))
        if not self.pacer.fits(step_s, n_tokens):
            return False
        tiers = self.context.tiers
        before = tiers.store.counts["ram"].written if tiers is not None else 0
        t0 = time.perf_counter()
        self._save_snapshots(limit=1)
        seconds = time.perf_counter() - t0
        if tiers is None or tiers.store.counts["ram"].written == before:
            return False
        self.pacer.observe(n_tokens, seconds, step_s)
        log.debug("engine %s: saved a %d-token prefix in %.3f s after a %.3f s step", self.name,
                  n_tokens, seconds, step_s)
        return True

    def _run_plan(self, plan: StepPlan) -> list[Delivery]:
        t0 = time.perf_counter()
        events: list[Delivery] = []
        times = self.times
        self._step_decode_s, self._step_stopped = 0.0, False
        for group in call_groups(plan.chunks, self.config.kv_unified):
            pieces = [(c.seq.seq_id, c.tokens, c.start, c.num_logits) for c in group]
            if plan.background:   # a client's request stops it; one already here skips it
                self.context.clear_stop()
                if self._client_waiting():
                    self._stop_pieces(group, 0.0, cut=False)
                    return events
            t = time.perf_counter()
            status = self.context.decode(pieces, stoppable=plan.background)
            t_decoded = time.perf_counter()
            seconds = t_decoded - t
            times.decode_calls += 1
            times.micro_batches += micro_batches(group, self.config.kv_unified)
            times.decode_s += seconds
            self._step_decode_s += seconds
            if status == 2:
                self._stop_pieces(group, seconds, cut=True)
                return events
            # a call that ran stream copies first (a prompt continuing another sequence's cells,
            # with split KV) took longer for them: neither a cost to learn nor a neighbour
            copied = self.context.copied
            expected = self.scheduler.observe_call(group, seconds, learn=not copied)
            if expected and not copied and seconds > SLOW_STEP * expected + SLOW_STEP_MARGIN_S:
                self.lease.slowed(self.context, seconds / expected)   # engine/lease.py
                self.scheduler.costs.follow_threads(self.lease.threads)
            if status == 1:   # no KV slot after all: preempt one sequence and plan again
                log.warning("engine %s: llama_decode found no KV slot; preempting", self.name)
                self.scheduler.preempt_one()
                self.context.apply(self.manager.take_ops())
                return events
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            self.scheduler.advance(StepPlan(chunks=group))
            events += self.output.sample_call(group)
            events += self.output.verify_call(group)
            times.sample_s += time.perf_counter() - t_decoded
        times.steps += 1
        self.observer.on_step(self, plan.num_tokens, time.perf_counter() - t0)
        return events

    def _client_waiting(self) -> bool:
        """Whether a client's request (not background work) waits in the inbox."""
        return any(isinstance(m, Admit) and m.req.priority < BACKGROUND for m in list(self.inbox))

    def _stop_pieces(self, group: list, seconds: float, cut: bool) -> None:
        """A background step stopped for a client's request: `cut` inside llama_decode, or
        skipped before it (seconds 0). Its pieces' KV positions go (llama.cpp removed those
        of the micro-batch it cut) and the scheduler plans them again."""
        for chunk in group:
            self.context.seq_rm(chunk.seq.seq_id, chunk.start, -1)
        self.scheduler.stopped(group)
        self._step_stopped = True
        self.times.stopped_steps += 1
        self.times.cut_steps += int(cut)
        self.times.stopped_s += seconds
        self.observer.on_background_stop(self, group, cut)
        log.debug("engine %s: a background step %s for a client's request after %.1f ms",
                  self.name, "cut" if cut else "skipped", seconds * 1000)

    def _fail_all(self, message: str) -> None:
        self.failed = message
        owners = [s.owner for s in list(self.scheduler.running) + list(self.scheduler.waiting)]
        events = [self.output.finish(req, FinishReason.ERROR, error=message) for req in owners]
        self.context.apply(self.manager.take_ops())
        self._deliver(events)
        self._publish()

    def _deliver(self, events: list[Delivery]) -> None:
        if not events:
            return
        loop = events[0][0].loop
        assert loop is not None, "a submitted request"
        try:
            hand_over(loop, _put_all, events)   # (engine/handoff.py)
        except RuntimeError:   # the event loop is closed: nobody is left to read these events
            log.debug("engine %s: %d events for a closed event loop dropped", self.name,
                      len(events))

    # ---- publishing (worker thread -> event loop, by replacing immutable objects) ---------------
    def _publish(self) -> None:
        self.stats = self._collect_stats()
        if self.publish_prefixes:
            self.cached_hashes = frozenset(self.manager.cache)

    def _collect_stats(self, step_ms: dict | None = None) -> ContextStats:
        """`step_ms`: the step-time split to publish (default: computed now)."""
        m, s, lease = self.manager, self.scheduler, self.lease
        return ContextStats(
            name=self.name, threads=lease.in_use(s.has_work()),
            configured_threads=self.config.n_threads, max_threads=lease.max_threads,
            other_cpu_cores=lease.other_cores, thread_changes=lease.changes,
            step_ms=self.times.per_step_ms() if step_ms is None else step_ms,
            running=len(s.running), waiting=len(s.waiting), outstanding=self.outstanding,
            steps=self.steps, kv_used_blocks=m.num_used_blocks, kv_total_blocks=m.num_blocks,
            kv_cached_blocks=m.num_cached_blocks, live_seqs=len(m.live),
            prefix_query_tokens=m.query_tokens, prefix_hit_tokens=m.hit_tokens,
            num_preemptions=s.num_preemptions, failed=self.failed,
            **self.speculation.counts.stats())


def _put_all(events: list[Delivery]) -> None:
    for req, event in events:
        event.index = req.index
        req.queue.put_nowait(event)   # type: ignore[union-attr]  # submitted: it has one
