"""The step loop: one worker thread per llama.cpp context.

Each step: take new and cancelled requests from the inbox; ask the scheduler for a plan; apply
its KV operations; run the batch through llama_decode (the GIL is released inside: one call, or
with split KV one call per micro-batch shape, see Worker._groups); sample every sequence that
produced logits and post-process its token in one place (append, stop checks, finish); hand the
new text to each request's asyncio queue with one hand-off to the event loop per step (which
the loop runs once the next decode releases the GIL: engine/handoff.py). The HTTP
event loop never calls llama.cpp, and reads only what the worker publishes (ContextStats, the
set of cached block hashes), never the scheduler's or block manager's live structures.
Before a step that would start a wave of prompts (scheduler/scheduler.py), the worker waits a
moment for the rest of it (_gather): after several requests ended together, until as many are
back, at most GATHER_S. Between steps the thread governor may change the context's thread count
(engine/threads.py); it is paused while the worker waits for requests. With several contexts in
the process, each step runs on threads taken from their shared CoreBudget (elastic threads: all
of them while the other contexts are idle, this context's share otherwise) and handed back after
it.
A request with a grammar samples through its mask (engine/grammar.py), greedy included; when the
grammar allows no token the request finishes with "stop" and a warning. Logprobs are computed
here, only for requests that ask, from the logits the sampler saw.
n > 1 arrives as one request with forks: they wait while it computes the prompt, then start from
a copy of its KV (Scheduler.fork) and sample from the same logits (restored between samplers,
since logit_bias is added in place), each with its own sampler and seed. A prompt whose
logprobs are asked (echo) gets logits for every prompt position and no prefix-cache reuse.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.detok import TextStream
from engine.grammar import tokenizer_for
from engine.handoff import hand_over
from engine.llama import KV_TYPES, Context, ContextConfig, Model
from engine.logprobs import TokenLogprob, token_logprob
from engine.request import Admit, Cancel, ErrorKind, Event, InboxMessage, Request
from engine.sampling import Sampler
from engine.stats import ContextStats, StepTimes
from engine.threads import CoreBudget, CpuMeter, ThreadGovernor, own_share
from kvcache import BlockManager, CopyOp, DropSavedOp, RemoveOp, RestoreOp, SaveOp, block_hashes
from scheduler import FinishReason, Scheduler, Sequence, Status, StepPlan, make_policy

log = logging.getLogger("pagedllama.engine")


# Prompt chunks and step budgets by where a model computes. On a GPU (scripts/gpu_check.sh on an
# H200, README "GPU") a step costs about the same for 16 tokens as for 256, so prompts go in
# larger chunks within larger steps. Measured against the CPU defaults at 16 streams: 1.16x the
# output tok/s, 1.40x the shared-prefix request rate, a 2,000-token prompt's first token after
# 0.11 s instead of 0.55 s; TTFT p50 a little longer (99 against 76 ms).
DEVICE_DEFAULTS = {"cpu": {"prefill_chunk": 16, "max_batch_tokens": 256},
                   "gpu": {"prefill_chunk": 256, "max_batch_tokens": 1024}}


@dataclass
class EngineConfig:
    n_ctx: int = 2048                 # per sequence: the longest prompt + output
    max_seqs: int = 16
    n_threads: int = 2
    max_batch_tokens: int | None = None   # tokens per step (decodes first, then prompt
                                      # chunks); None: by device (resolved_for)
    wave_batch_tokens: int = 2048     # a wave of prompts in one step (scheduler doc); 0: off
    block_size: int = 8               # KV budget and prefix-cache lookup unit (hits may end
                                      # inside one)
    prefill_chunk: int | None = None  # aligned prompt chunk size (see benchmarks.chunking);
                                      # None: by device (resolved_for)
    prefix_caching: bool = True
    kv_unified: bool = False
    flash_attn: bool | None = None    # None: flash attention unless the model has K-quants
                                      # (resolved_for; README, "Attention kernels")
    kv_type: str = "f16"              # KV cache f16 or q8_0 (half the memory; needs flash_attn)
    scheduler: str = "fifo"
    preemption: str = "swap"
    max_queue: int = 256
    cache_seqs: int = 16              # extra llama.cpp seq ids that hold cached prefixes
    adaptive_threads: bool = True     # fewer threads while other processes use our cores
    thread_share: float = 1.0         # this context's part of the process's threads

    def __post_init__(self):
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"KV cache type {self.kv_type!r}: one of {', '.join(KV_TYPES)}")
        if self.kv_type != "f16" and self.flash_attn is False:
            raise ValueError(f"a {self.kv_type} KV cache needs flash attention (llama.cpp "
                             "quantizes V only for its flash-attention kernel)")

    def resolved_for(self, model: Model) -> "EngineConfig":
        """The settings left to the model, chosen for it. With flash_attn None (auto): flash
        attention, exact on ggml's reference path, unless the model's weights are K-quants,
        whose tiled matmul that path turns off (a q8_0 cache needs flash attention either
        way). With prefill_chunk or max_batch_tokens None: DEVICE_DEFAULTS for where the model
        computes (Model.on_gpu)."""
        device = DEVICE_DEFAULTS["gpu" if model.on_gpu else "cpu"]
        chosen = {name: value for name, value in device.items() if getattr(self, name) is None}
        if self.flash_attn is None:
            chosen["flash_attn"] = self.kv_type != "f16" or not model.has_k_quants
        return replace(self, **chosen)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step (one llama_decode) may take (of a config resolved_for a
        model)."""
        return max(self.max_batch_tokens, self.wave_batch_tokens)

    @property
    def n_seq_max(self) -> int:
        return min(256, self.max_seqs + (self.cache_seqs if self.prefix_caching else 0))

    @property
    def total_cells(self) -> int:
        """Split KV: one stream of n_ctx cells per seq id. Unified: one pool shared by all."""
        return self.n_ctx * (self.max_seqs if self.kv_unified else self.n_seq_max)


class Observer:
    """Hooks for metrics; called from the worker thread. The default does nothing."""

    def on_step(self, worker: "Worker", num_tokens: int, seconds: float) -> None: ...

    def on_token(self, worker: "Worker", req: Request, now: float) -> None: ...

    def on_finish(self, worker: "Worker", req: Request) -> None: ...


class QueueFull(Exception):
    pass


Delivery = tuple[Request, Event]

# How long after requests ended together a step waits for their clients' next ones (_gather),
# and at most how long after the last of them came.
GATHER_S = 0.25
GATHER_GAP_S = 0.05


class Worker:
    """One llama.cpp context and the thread that runs its step loop."""

    def __init__(self, name: str, model: Model, config: EngineConfig,
                 observer: Observer | None = None, publish_prefixes: bool = False,
                 budget: CoreBudget | None = None):
        config = config.resolved_for(model)
        self.name, self.model, self.config = name, model, config
        self.budget = budget   # threads shared with the process's other contexts (elastic)
        # the most threads this context may use: its own, or all of the budget's when it lends
        self.max_threads = budget.total if budget else config.n_threads
        self.observer = observer or Observer()
        self.context = Context(model, ContextConfig(
            n_ctx=config.total_cells, n_seq_max=config.n_seq_max, n_batch=config.step_tokens,
            n_threads=config.n_threads, kv_unified=config.kv_unified,
            flash_attn=config.flash_attn, kv_type=config.kv_type))
        self.manager = BlockManager(
            config.total_cells // config.block_size, block_size=config.block_size,
            num_seq_ids=config.n_seq_max, prefix_caching=config.prefix_caching,
            prefill_chunk=config.prefill_chunk, share_cells=config.kv_unified,
            # any cut of a prompt into pieces of 2+ tokens computes the same numbers (README,
            # "Exact answers"), so a prefix hit may end on any token
            reuse_grid=config.block_size)
        self.scheduler = Scheduler(
            self.manager, make_policy(config.scheduler), max_seqs=config.max_seqs,
            max_batch_tokens=config.max_batch_tokens, preemption=config.preemption,
            merge_cells=True, wave_batch_tokens=config.wave_batch_tokens)
        self.max_seq_len = min(config.n_ctx, self.context.n_ctx_seq)
        self.inbox: deque[InboxMessage] = deque()
        self.wakeup = threading.Event()
        self.submitted = 0            # written by the event loop only
        self.finished = 0             # written by the worker thread only
        self.failed: str | None = None
        self.meter = _meter(config, self.max_threads)
        # lending makes the whole process's threads this context's to use, so its share is all
        share = 1.0 if budget else config.thread_share
        self.governor = (ThreadGovernor(self.max_threads, len(self.meter.cpus), share,
                                        ticks_per_second=self.meter.hz) if self.meter else None)
        self.current_threads = config.n_threads    # what the context computes with now
        self.thread_changes = 0
        self.times = StepTimes()
        self.publish_prefixes = publish_prefixes
        self.cached_hashes: frozenset[int] = frozenset()   # published for the router
        self.stats = self._collect_stats()                 # published for /health and metrics
        # how many requests for this model are having their prompt prepared now (set by the
        # service): a step that starts a burst of prompts waits for them (_gather)
        self.incoming: Callable[[], int] = lambda: 0
        self._expect = (0, 0.0)   # requests that ended together, and until when (_gather)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    @property
    def steps(self) -> int:
        return self.times.steps

    @property
    def threads(self) -> int:
        """The most threads this context may use now (the governor's figure); with elastic
        threads it computes on fewer while other contexts have work (`current_threads`)."""
        return self.governor.threads if self.governor else self.max_threads

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
        return req.queue

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
        grid = self.manager.reuse_grid
        return n * self.config.block_size // grid * grid

    # ---- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                try:
                    self._drain_inbox()
                    self._apply(self.manager.take_ops())   # frees of cancelled requests
                    if not self.scheduler.has_work():
                        if self.budget:
                            self.budget.idle(self.name)
                        self._publish()
                        self._pause_governor()
                        self.wakeup.wait()
                        self.wakeup.clear()
                        continue
                    self._gather()
                    self._step()
                except Exception as exc:   # a broken context fails its own requests only
                    log.exception("engine %s step failed", self.name)
                    self._fail_all(f"engine error: {exc}")
        finally:   # however the thread ends, it no longer keeps the others on their own share
            if self.budget:
                self.budget.idle(self.name)

    def _gather(self) -> None:
        """Wait a moment for the rest of a wave before planning a step (scheduler module doc).
        After k requests ended in one step, their clients' next requests come back together but
        one by one over some milliseconds (each is parsed and tokenized first), and a step
        planned at the first would start it alone and split the wave. So once one is here, and
        while they would make a wave, wait for k (until GATHER_S after those ended), and for
        any prompt still being prepared (from the first request on, at most GATHER_S), but no
        longer than GATHER_GAP_S after the last arrival (behind a router, or when clients
        stop, they may not come here). Only the few streams beside a wave wait on this; a
        request that comes alone expects none."""
        if not self.scheduler.waiting or not self.config.wave_batch_tokens:
            return
        (expect, until), self._expect = self._expect, (0, 0.0)
        now = time.monotonic()
        if now >= until:
            expect, until = 0, now + GATHER_S
        decoding = sum(1 for s in self.scheduler.running if s.is_decoding)
        waiting = self.scheduler.waiting
        if not self.scheduler.is_wave(decoding, max(expect - len(waiting), self.incoming())):
            return
        last = now   # the last arrival: a wave still coming in has no long gaps
        while len(waiting) < expect or self.incoming():
            now = time.monotonic()
            left = min(until, last + GATHER_GAP_S) - now
            if left <= 0 or not self.wakeup.wait(left):
                return
            self.wakeup.clear()
            before = len(waiting)
            self._drain_inbox()
            if len(waiting) > before:
                last = time.monotonic()

    def _drain_inbox(self) -> None:
        while self.inbox:
            message = self.inbox.popleft()
            if isinstance(message, Admit):
                self._admit(message.req)
            elif message.req.seq is not None and not message.req.finished:
                self._finish(message.req, FinishReason.ABORT)   # the client left: no delivery

    def _admit(self, req: Request) -> None:
        """Admit a request and its forks together, or, if any of them cannot be set up (its
        sampler, grammar or text stream raised), end them all with an error event: their
        parameters were refused (ValueError: a 400) or the engine failed (a 500)."""
        try:
            for r in req.group:
                self._prepare(r)
        except Exception as exc:
            kind = ErrorKind.INVALID if isinstance(exc, ValueError) else ErrorKind.ENGINE
            log.warning("engine %s: request %d could not be admitted: %r", self.name, req.id,
                        exc)
            self._deliver([self._finish(r, FinishReason.ERROR, error=_describe(exc),
                                        kind=kind) for r in req.group])
            return
        req.seq.prompt_logits = req.params.prompt_logprobs
        for fork in req.forks:
            fork.seq.fork_of = req.seq
            req.seq.forks.append(fork.seq)
        for r in req.group:
            self.scheduler.add(r.seq)

    def _prepare(self, req: Request) -> None:
        """A request's sequence, sampler and text stream (not yet in the scheduler)."""
        p = req.params
        max_tokens = (p.max_tokens if p.max_tokens is not None
                      else self.max_seq_len - len(req.prompt))
        deadline = req.arrival_time + req.timeout if req.timeout else None
        req.seq = Sequence(req.prompt, max_tokens, req.priority, deadline, owner=req)
        req.sampler = Sampler(p, self.model.n_vocab,
                              tokenizer_for(self.model) if p.grammar else None)
        req.stream = TextStream(self.model.piece, p.stop)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._adapt_threads()
        plan = self.scheduler.schedule()
        self._apply(plan.ops)
        events = [self._finish(s.owner, FinishReason.TIMEOUT) for s in self.scheduler.expired]
        self.scheduler.expired.clear()
        self.stats = self._collect_stats(self.stats.step_ms)   # what runs during this decode
        self.times.plan_s += time.perf_counter() - t0
        if plan.chunks:
            events += self._leased(self._run_plan, plan)
        elif not events:
            self.wakeup.wait(0.005)   # waiting requests that cannot start yet
            self.wakeup.clear()
        t1 = time.perf_counter()
        ended = sum(1 for _, e in events if e.finish_reason)
        if ended > 1 and self.config.wave_batch_tokens:   # the next wave may be coming
            self._expect = (ended, time.monotonic() + GATHER_S)
        self._apply(self.manager.take_ops())   # frees of requests that finished this step
        self._deliver(events)
        self._publish()
        self.times.deliver_s += time.perf_counter() - t1

    def _run_plan(self, plan: StepPlan) -> list[Delivery]:
        t0 = time.perf_counter()
        events: list[Delivery] = []
        times = self.times
        for group in self._groups(plan.chunks):
            pieces = [(c.seq.seq_id, c.seq.tokens[c.start:c.end], c.start, c.num_logits)
                      for c in group]
            t = time.perf_counter()
            status = self.context.decode(pieces)
            t_decoded = time.perf_counter()
            times.decode_calls += 1
            times.micro_batches += self._micro_batches(group)
            times.decode_s += t_decoded - t
            if status == 1:   # no KV slot after all: preempt one sequence and plan again
                log.warning("engine %s: llama_decode found no KV slot; preempting", self.name)
                self.scheduler.preempt_one()
                self._apply(self.manager.take_ops())
                return events
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            self.scheduler.advance(StepPlan(chunks=group))
            events += self._sample(group)
            times.sample_s += time.perf_counter() - t_decoded
        times.steps += 1
        self.observer.on_step(self, plan.num_tokens, time.perf_counter() - t0)
        return events

    def _sample(self, group: list) -> list[Delivery]:
        """Sample every chunk that wants logits, now: the next decode overwrites them. What
        fails for one request (its sampler, grammar, stop strings, logprobs) ends that request
        alone (_failed); the others go on."""
        now, offset, events = time.monotonic(), 0, []
        for chunk in group:
            first, offset = offset, offset + chunk.end - chunk.start
            if chunk.seq.prompt_logits:
                try:
                    self._prompt_logprobs(chunk, first)
                except Exception as exc:
                    events.append(self._failed(chunk.seq.owner, exc))
                    continue
            if chunk.wants_logits:
                reqs = [chunk.seq.owner]
                if chunk.seq.forks:   # its prompt is computed: the other choices start now
                    reqs += [s.owner for s in self.scheduler.fork(chunk.seq)]
                logits = self.context.logits(offset - 1)
                base = logits.copy() if len(reqs) > 1 else None
                for req in reqs:
                    if base is not None:
                        logits[:] = base
                    try:
                        events.append(self._sample_one(req, offset - 1, now))
                    except Exception as exc:
                        events.append(self._failed(req, exc))
        return events

    def _failed(self, req: Request, exc: Exception) -> Delivery:
        """End one request whose own step raised: a 500 engine_error for it alone."""
        log.error("engine %s: request %d failed; ending it alone", self.name, req.id,
                  exc_info=exc)
        return self._finish(req, FinishReason.ERROR, error=f"engine error: {_describe(exc)}",
                            kind=ErrorKind.ENGINE)

    def _sample_one(self, req: Request, index: int, now: float) -> Delivery:
        if req.seq.max_tokens == 0:   # scoring only (echo): the prompt's logprobs were the point
            return self._finish(req, FinishReason.LENGTH)
        token = req.sampler.sample(self.context, index)
        delivery = self._postprocess(req, token, now)
        if req.params.logprobs is not None and token is not None:
            delivery[1].logprobs = [token_logprob(self.context.logits(index), token,
                                                  req.params.logprobs, self.model.piece)]
        return delivery

    def _prompt_logprobs(self, chunk, first: int) -> None:
        """Logprobs of the prompt tokens this chunk predicts (the logits at position p score
        token p + 1). A chunk computed again after a preemption adds nothing twice."""
        seq, req = chunk.seq, chunk.seq.owner
        lps = req.prompt_logprobs
        if lps is None:
            t0 = seq.prompt[0]
            lps = req.prompt_logprobs = [TokenLogprob(t0, self.model.piece(t0), None)]
        k = req.params.logprobs or 0
        for pos in range(chunk.start, min(chunk.end, seq.num_prompt - 1)):
            if pos + 1 == len(lps):
                lps.append(token_logprob(self.context.logits(first + pos - chunk.start),
                                         seq.prompt[pos + 1], k, self.model.piece))

    def _postprocess(self, req: Request, token: int | None, now: float) -> Delivery:
        """The one place a sampled token is appended, stop conditions are checked and a request
        that reached one is finished."""
        seq, p = req.seq, req.params
        if token is None:   # the grammar allows no token: end here rather than hang or fail
            log.warning("engine %s: request %d reached a grammar dead end after %d tokens; "
                        "finishing it with 'stop'", self.name, req.id, seq.num_output)
            return self._finish(req, FinishReason.STOP, req.stream.flush())
        seq.tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        self.observer.on_token(self, req, now)
        req.last_token_time = now
        if token in self.model.eog_ids and (not p.ignore_eos or p.grammar):
            return self._finish(req, FinishReason.STOP, req.stream.flush(), num_tokens=1)
        text, stopped = req.stream.push(token)
        if stopped:
            return self._finish(req, FinishReason.STOP, text, num_tokens=1)
        if seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.max_seq_len:
            return self._finish(req, FinishReason.LENGTH, text + req.stream.flush(), num_tokens=1)
        return req, Event(text, 1)

    def _finish(self, req: Request, reason: FinishReason, text: str = "", num_tokens: int = 0,
                error: str | None = None, kind: ErrorKind | None = None) -> Delivery:
        """End a request for any reason: release its sequence (KV frees become ops), its
        sampler, count it, and make its last event. Safe for a request that never got a
        sequence or a sampler (its admission failed)."""
        if req.seq is not None and req.seq.status is not Status.FINISHED:
            self.scheduler.abort(req.seq, reason)
        req.finish_reason, req.finish_time = reason, time.monotonic()
        if req.sampler is not None:
            try:
                req.sampler.close()
            except Exception:   # what is left of a broken sampler must not keep the request
                log.exception("engine %s: closing request %d's sampler failed", self.name,
                              req.id)
        self.finished += 1
        self.observer.on_finish(self, req)
        if error is not None and kind is None:
            kind = ErrorKind.ENGINE
        return req, Event(text, num_tokens, reason, error, kind)

    def _fail_all(self, message: str) -> None:
        self.failed = message
        owners = [s.owner for s in list(self.scheduler.running) + list(self.scheduler.waiting)]
        events = [self._finish(req, FinishReason.ERROR, error=message) for req in owners]
        self._apply(self.manager.take_ops())
        self._deliver(events)
        self._publish()

    def _adapt_threads(self) -> None:
        """Between decodes: follow the governor's thread count (see engine/threads.py)."""
        now = time.monotonic()
        if self.governor is None or not self.governor.due(now):
            return
        change = self.governor.observe(self.meter.sample(now))
        if change is not None:
            if self.budget is None:   # else the next lease sets it
                self.context.set_threads(change.threads)
                self.current_threads = change.threads
            self.thread_changes += 1
            log.info("engine %s: threads %d -> %d (%s)", self.name, change.previous,
                     change.threads, change.reason)

    def _leased(self, run, plan: StepPlan) -> list[Delivery]:
        """Run a step on the threads the budget grants now (all of this context's when there is
        no budget)."""
        if self.budget is None:
            return run(plan)
        cap = self.threads   # the governor's figure for the whole process
        share = own_share(cap, self.config.n_threads, self.config.thread_share)
        n = self.budget.acquire(self.name, share, cap)
        try:
            if n != self.current_threads:
                self.context.set_threads(n)
                self.current_threads = n
            return run(plan)
        finally:
            self.budget.release(n)

    def _pause_governor(self) -> None:
        """Going idle: what other processes do until the next request is no contention."""
        if self.governor is not None:
            self.governor.pause(self.meter.sample(time.monotonic()))

    def _groups(self, chunks: list) -> list[list]:
        """The step's batch in the shape llama.cpp computes it. With split KV, llama.cpp cuts a
        batch into micro-batches of consecutive seq ids that take the same number of tokens from
        each sequence: decode tokens out of seq-id order become several micro-batches (measured:
        172 instead of 108 ms a step for 16 streams), and a 16-token prompt chunk next to decode
        tokens is computed as 1 + 15 tokens, off the prefill grid. So: one call for the one-token
        pieces in seq-id order, then one per chunk length, in seq-id order: every micro-batch is
        then what we asked for. A unified cache computes a batch whole: one call."""
        if self.config.kv_unified:
            return [chunks]
        by_len: dict[int, list] = {}
        for c in chunks:
            by_len.setdefault(c.end - c.start, []).append(c)
        return [sorted(by_len[n], key=lambda c: c.seq.seq_id) for n in sorted(by_len)]

    def _micro_batches(self, group: list) -> int:
        """How many micro-batches llama.cpp cuts one call of _groups into: one with a unified
        cache; with split KV one per run of consecutive seq ids (each group's pieces are of one
        length, in seq-id order)."""
        if self.config.kv_unified:
            return 1
        ids = [c.seq.seq_id for c in group]
        return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))

    def _apply(self, ops) -> None:
        ctx = self.context
        for op in ops:
            if isinstance(op, CopyOp):
                if self.config.kv_unified:
                    ctx.seq_cp(op.src, op.dst, op.p0, op.p1)
                else:   # split streams copy whole: take all of src, then cut to the range
                    ctx.seq_cp(op.src, op.dst, -1, -1)
                    ctx.seq_rm(op.dst, op.p1, -1)
            elif isinstance(op, RemoveOp):
                ctx.seq_rm(op.seq, op.p0, op.p1)
            elif isinstance(op, SaveOp):
                ctx.save_seq(op.seq, op.key)
            elif isinstance(op, RestoreOp):
                ctx.restore_seq(op.key, op.seq)
            elif isinstance(op, DropSavedOp):
                ctx.drop_saved(op.key)

    def _deliver(self, events: list[Delivery]) -> None:
        if not events:
            return
        try:
            hand_over(events[0][0].loop, _put_all, events)   # (engine/handoff.py)
        except RuntimeError:   # the event loop is closed: nobody is left to read these events
            log.debug("engine %s: %d events for a closed event loop dropped", self.name,
                      len(events))

    # ---- publishing (worker thread -> event loop, by replacing immutable objects) ---------------
    def _publish(self) -> None:
        self.stats = self._collect_stats()
        if self.publish_prefixes:
            self.cached_hashes = frozenset(self.manager.cache)

    def _threads_in_use(self) -> int:
        """The threads this context computes with; with elastic threads an idle context holds
        none (its next step takes what the budget grants then)."""
        if self.budget is not None and not self.scheduler.has_work():
            return 0
        return self.current_threads

    def _collect_stats(self, step_ms: dict | None = None) -> ContextStats:
        """`step_ms`: the step-time split to publish (default: computed now)."""
        m, s, gov = self.manager, self.scheduler, self.governor
        return ContextStats(
            name=self.name, threads=self._threads_in_use(),
            configured_threads=self.config.n_threads, max_threads=self.max_threads,
            other_cpu_cores=round(gov.others, 3) if gov else None,
            thread_changes=self.thread_changes,
            step_ms=self.times.per_step_ms() if step_ms is None else step_ms,
            running=len(s.running), waiting=len(s.waiting), outstanding=self.outstanding,
            steps=self.steps, kv_used_blocks=m.num_used_blocks, kv_total_blocks=m.num_blocks,
            kv_cached_blocks=m.num_cached_blocks, live_seqs=len(m.live),
            prefix_query_tokens=m.query_tokens, prefix_hit_tokens=m.hit_tokens,
            num_preemptions=s.num_preemptions, failed=self.failed)


def _describe(exc: Exception) -> str:
    """An exception as one line for a client: its message, or its type when it has none."""
    return str(exc) or type(exc).__name__


def _meter(config: EngineConfig, max_threads: int) -> CpuMeter | None:
    """A CPU meter for the thread governor, when adaptive threads apply to this context."""
    if not config.adaptive_threads or max_threads < 2 or not CpuMeter.available():
        return None
    return CpuMeter()


def _put_all(events: list[Delivery]) -> None:
    for req, event in events:
        event.index = req.index
        req.queue.put_nowait(event)
