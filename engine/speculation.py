"""Speculative decoding for one context: whether it may verify drafts, each request's drafts,
their verification, and what steps with drafts cost (docs/scheduling.md, "Speculative
decoding").

The worker calls it at fixed points of its step and keeps no speculation state of its own:
`start` when it admits a request, `propose` before the scheduler plans a step, `verify` for each
verification piece once its call is decoded, `observe_step` after the step, `end` when a request
ends; `counts` are vLLM's counters for /health and /metrics. Drafts enter the scheduler through
`Scheduler.set_draft` and leave it through `Scheduler.accept_draft`: this module writes no
scheduler state directly.

Invariants:
- Speculation changes no answer. Each position of a verification piece is sampled with the
  request's own sampler, in order, as decoding one token at a time would, and appended through
  the worker's one place for tokens (the `emit` it is given); the first sampled token that
  differs from the draft is the model's own, and the drafted tokens after it leave the KV. This
  holds only where a token inside a piece gets the numbers it gets decoded alone, so a context
  verifies drafts only where the start-up probe (`speculation_mode`) found that it does.
- Drafting costs nothing where it cannot pay: a step drafts only when the measured step costs
  say that even drafts accepted nearly always would pay (scheduler/speculation.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.drafting import Drafter, verify
from engine.llama import Context
from engine.model import Model, build_identity
from engine.request import Event, Request
from kvcache.snapshots import write_atomic
from scheduler import Chunk, Scheduler, Status, StepPlan
from scheduler.speculation import worth_drafting

log = logging.getLogger("pagedllama.engine")

# the start-up probe's answers in this process (`_probe_pieces`), by what decides them: the
# model file, the attention kernel and KV type, the piece lengths. A model loaded again, or a
# second context of it, does not decode the probe again.
_probed: dict[tuple, bool] = {}
_probed_lock = threading.Lock()
# ... and across processes (a server started again): a small JSON file of answers by a digest
# of the same key plus what else decides the numbers (llama.cpp's version, build and libraries,
# the CPU), in the config's probe_dir (PAGEDLLAMA_PROBE_DIR; default: the user's cache directory).
PROBE_FILE = "speculation-probes.json"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def _disk_key(key: tuple) -> str:
    what = {"key": list(key), "llama_cpp": build_identity(), "cpu": _cpu_name()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _read_probes(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):   # none yet, or unreadable: probe again
        return {}


def _write_probe(path: Path, digest: str, answer: bool) -> None:
    """Add one answer, the file written whole (another process may write it at the same time:
    one of the two answers may be lost, never the file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_probes(path)
        data[digest] = answer
        write_atomic(path, json.dumps(data).encode())
    except OSError as exc:   # a read-only home: the next start probes again
        log.info("speculation probe not kept on disk (%s)", exc)


def speculation_mode(name: str, model: Model, context: Context,
                     config: EngineConfig) -> tuple[bool, str]:
    """Whether a context verifies drafts, and what /health says of it. Speculation keeps answers
    exact only where a token computed inside a verification piece gets the numbers it gets
    decoded alone (Context.pieces_match_decoding, probed once a process per model file and
    kernel: ~1.5 s for SmolLM2 on one thread); where it does not (plain attention on the CPU),
    it stays off and says so. On a GPU answers depend on the batch anyway (docs/gpu.md): no
    probe there."""
    if config.speculative == "off":
        return False, "off"
    if model.on_gpu or _probe_pieces(model, context, config):
        return True, config.speculative
    log.warning("engine %s: speculative decoding off: tokens inside a verification piece "
                "get other numbers than decoded one at a time (attention: %s), so answers "
                "would change", name, context.attention or "plain")
    return False, ("off: verification pieces would not compute what decoding computes with "
                   "this attention kernel")


def _probe_pieces(model: Model, context: Context, config: EngineConfig) -> bool:
    """The probe on one thread: answers do not depend on the thread count, and two threads next
    to a busy process stall at llama.cpp's barriers before the lease can react. Its answer is
    kept for the process (`_probed`) and on disk (`config.probe_dir`: a server started again on the
    same model, llama.cpp and CPU starts ~2 s sooner)."""
    longest = min(config.max_draft + 1, config.step_tokens, config.n_outputs_max)
    lengths = tuple(sorted(k for k in {2, 3, 5, 9, longest} if k <= longest))
    path = model.path.resolve()
    stat = path.stat()
    # the attention path is None exactly when flash attention is off
    key = (str(path), stat.st_size, stat.st_mtime_ns, context.attention, config.kv_type,
           lengths)
    with _probed_lock:
        if key not in _probed:
            kept = Path(config.probe_dir) / PROBE_FILE if config.probe_dir else None
            digest = _disk_key(key)
            known = _read_probes(kept).get(digest) if kept else None
            if isinstance(known, bool):
                _probed[key] = known
                return known
            context.set_threads(1)
            try:
                _probed[key] = context.pieces_match_decoding(lengths=lengths)
            finally:
                context.set_threads(config.n_threads)
            if kept:
                _write_probe(kept, digest, _probed[key])
        return _probed[key]


class SpecCounts:
    """A context's speculative decoding so far (vLLM's counters): verifications, drafted and
    accepted tokens, and per position of a draft how often the token there was accepted."""

    def __init__(self, max_draft: int):
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos = [0] * max_draft

    def observe(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict:
        """The counts as ContextStats' fields."""
        return dict(spec_drafts=self.drafts, spec_draft_tokens=self.draft_tokens,
                    spec_accepted_tokens=self.accepted_tokens,
                    spec_accepted_per_pos=tuple(self.accepted_per_pos))


class Speculation:
    """The drafts of one context's requests and their verification, used by its worker thread
    only. `on`: whether the context verifies drafts (`speculation_mode`); off, every method but
    the counts does nothing."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, on: bool, max_seq_len: int):
        self.config, self.scheduler, self.max_seq_len = config, scheduler, max_seq_len
        self.drafter = Drafter(config.max_draft) if on else None
        self.counts = SpecCounts(config.max_draft)
        self.step_accepted = 0   # drafted tokens accepted in this step

    def start(self, req: Request) -> None:
        """A request is admitted: its drafting state."""
        if self.drafter is not None:
            req.state.draft = self.drafter.start()

    def end(self, req: Request) -> None:
        """A request ended, for any reason: its tokens go where later drafts look."""
        state = req.state
        if state.draft is not None and self.drafter is not None and state.seq is not None:
            self.drafter.finish(state.draft, state.seq.tokens)

    def propose(self) -> None:
        """The drafting step, before the step is planned: each decoding sequence proposes the
        tokens that may follow its last one (engine/drafting.py), cut to what it may still
        produce and to what its grammar allows, with its recent acceptance; the scheduler
        decides which of them are verified in this step (scheduler/speculation.py). Skipped
        where even drafts that are nearly always accepted would not pay (a compute-bound step:
        many streams)."""
        self.step_accepted = 0
        drafter, scheduler, config = self.drafter, self.scheduler, self.config
        if drafter is None:
            return
        paused = scheduler.background_waits()   # paused lines decode nothing this step
        decoding = [s for s in scheduler.running
                    if s.is_decoding and s.status is Status.RUNNING and not s.forks
                    and not (paused and s.background)]
        costs = scheduler.costs
        model = costs.call_model() if decoding else None
        if not decoding or (config.spec_policy != "always" and (
                model is None or not worth_drafting(len(decoding), *model,
                                                    costs.overhead_s or 0.0,
                                                    length=config.max_draft,
                                                    cost=costs.call_cost(),
                                                    draft_factor=costs.draft_factor))):
            return
        for seq in decoding:
            state, sampler = seq.owner.state, seq.owner.state.sampler
            cap = min(config.max_draft, seq.max_tokens - seq.num_output - 1,
                      self.max_seq_len - len(seq.tokens) - 1)
            if cap <= 0 or state.draft is None or sampler is None:
                continue
            draft = drafter.draft(state.draft, seq.tokens, cap)
            if draft and sampler.grammar is not None:   # a token the grammar forbids ends it
                draft = draft[:sampler.grammar.allows_prefix(draft)]
            gains = drafter.gains(state.draft, len(draft)) if draft else ()
            scheduler.set_draft(seq, draft, state.draft.acceptance.rate, gains)

    def verify(self, chunk: Chunk, first: int, sample: Callable[[int], int | None],
               emit: Callable[[int | None, int], Event]) -> Event:
        """The verification of a verification piece (a sequence's last token and its drafted
        ones, logits for each; `first`: the call's row of its first token). `sample(row)`
        draws the request's next token from the logits at that row; `emit(token, row)` appends
        it (stop strings, max_tokens, grammars, logprobs as for any token) and gives its event.
        Each position is sampled in turn as if decoding one token at a time, and appended,
        while the sampled token is the drafted one; the first that differs is the model's own
        next token, and the drafted tokens after it leave the KV (Scheduler.accept_draft: a
        rollback). Greedy, this accepts the longest matching prefix and the model's next token.
        Sampled, accepting a drafted token x when the model's draw gives x and otherwise keeping
        the draw is the speculative sampling rule for a draft that is x for sure: x is accepted
        with probability p(x), and after a rejection the draw is distributed as p without x,
        renormalized; each token comes from the model's distribution given the tokens before
        it, drawn with the request's own random numbers one at a time as without drafts. Returns
        the piece's tokens as one event."""
        seq, state = chunk.seq, chunk.seq.owner.state
        assert self.drafter is not None and state.draft is not None, "an admitted request"
        k, row, event = chunk.drafted, first, Event()

        def sample_at(i: int) -> int | None:
            nonlocal row
            row = first + i
            return sample(row)

        def emit_at(token: int | None) -> bool:
            nonlocal event
            event = _merged(event, emit(token, row))
            return event.finish_reason is not None

        accepted = verify(seq.draft[:k], sample_at, emit_at)
        self.step_accepted += accepted
        self.counts.observe(k, accepted)
        self.drafter.observe(state.draft, k, accepted)
        if event.finish_reason is None:
            self.scheduler.accept_draft(seq, k, accepted)
        return event

    def observe_step(self, plan: StepPlan, seconds: float, decode_s: float) -> None:
        """A step of decoding alone (every piece a sequence's next token, with its drafted ones
        or not) took `seconds`, `decode_s` of them in llama_decode: what it cost against the
        policy's prediction and the tokens a second it gave, for the policy's checks
        (scheduler/costs.py)."""
        if self.drafter is None or not all(c.end - c.start == 1 + c.drafted
                                           for c in plan.chunks):
            return
        costs, n = self.scheduler.costs, len(plan.chunks)
        costs.observe_draft_step(plan.draft_s, decode_s)
        costs.observe_decoding_step(n, n + self.step_accepted, seconds,
                                    any(c.drafted for c in plan.chunks))


def _merged(a: Event, b: Event) -> Event:
    """Two events of one request in one step as one (its text and tokens in order)."""
    if not a.num_tokens and not a.text and a.logprobs is None:
        return b
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs or b.logprobs else None
    return Event(a.text + b.text, a.num_tokens + b.num_tokens, b.finish_reason, b.error,
                 b.error_kind, logprobs, b.index)
