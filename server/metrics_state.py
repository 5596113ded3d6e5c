"""What a scrape of /metrics reads at its own time: each Worker.snapshot() summed by model
(ModelState), and the state gauges and the engine's cumulative counters built from them, the
catalogue's, the Batch API's, the prefix cache tiers' and the process's (StateCollector).
server/metrics.py's MetricsObserver registers it; nothing here waits for the engine (the
snapshots are plain fields, at most one step stale)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import ContextStats, Worker

if TYPE_CHECKING:
    from server.metrics import MetricsObserver

PREFIX = "pagedllama:"
MODEL = "model_name"


def model_of(worker: Worker) -> str:
    """Workers are named MODEL/REPLICA."""
    return worker.name.rsplit("/", 1)[0]



@dataclass
class ModelState:
    """One model's snapshot, summed over its contexts."""
    running: int = 0
    waiting: int = 0
    outstanding: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    steps: int = 0
    threads: int = 0                 # llama.cpp threads in use now, summed over contexts
    configured_threads: int = 0
    thread_changes: int = 0
    spec_drafts: int = 0             # speculative decoding: verifications, tokens drafted and
    spec_draft_tokens: int = 0       # accepted (by position in the draft too)
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float | None:
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else None

    @property
    def spec_acceptance(self) -> float | None:
        """Drafted tokens the model accepted, of those it verified (None: none verified)."""
        n = self.spec_draft_tokens
        return self.spec_accepted_tokens / n if n else None

    def add(self, stats: ContextStats | ModelState) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(stats, f.name)
            if isinstance(mine, tuple):   # per position: element by element
                n = max(len(mine), len(theirs))
                mine, theirs = (tuple(v) + (0,) * (n - len(v)) for v in (mine, theirs))
                setattr(self, f.name, tuple(a + b for a, b in zip(mine, theirs)))
            else:
                setattr(self, f.name, mine + theirs)


def model_states(workers: Iterable[Worker]) -> dict[str, ModelState]:
    states: dict[str, ModelState] = {}
    for w in workers:
        states.setdefault(model_of(w), ModelState()).add(w.snapshot())
    return states

def _tier_metrics(stats: dict):
    """The prefix cache's RAM and disk tiers (kvcache/snapshots/), a `tier` label each."""
    tier = ["tier"]
    families = [
        (GaugeMetricFamily, "prefix_cache_tier_bytes", "Bytes of saved sequence states a tier "
         "holds.", "bytes"),
        (GaugeMetricFamily, "prefix_cache_tier_limit_bytes", "The most bytes a tier may hold "
         "now (RAM: what the memory budget leaves).", "limit"),
        (GaugeMetricFamily, "prefix_cache_tier_entries", "Saved sequence states a tier holds.",
         "entries"),
        (CounterMetricFamily, "prefix_cache_tier_hits", "Prompts that started from a state "
         "restored from a tier.", "hits"),
        (CounterMetricFamily, "prefix_cache_tier_misses", "Long prompts that found no state in "
         "any tier (counted under ram).", "misses"),
        (CounterMetricFamily, "prefix_cache_tier_tokens", "Prompt tokens restored from a tier "
         "instead of computed.", "tokens"),
        (CounterMetricFamily, "prefix_cache_tier_restore_seconds", "Time spent reading and "
         "loading restored states.", "restore_s"),
        (CounterMetricFamily, "prefix_cache_tier_bad_entries", "Entries skipped because a "
         "check failed (truncated, corrupted, other numbers).", "bad"),
        (CounterMetricFamily, "prefix_cache_tier_writes", "States written to the tier (ram: "
         "saved from a context; disk: files written).", "written")]
    for kind, name, text, key in families:
        family = kind(PREFIX + name, text, labels=tier)
        for t in ("ram", "disk"):
            family.add_metric([t], stats[t].get(key, 0))
        yield family


class StateCollector(Collector):
    """Gauges and engine counters read from the workers' snapshots at scrape time."""

    def __init__(self, observer: MetricsObserver):
        self.observer = observer

    def collect(self):
        def family(kind, name, doc):
            return kind(PREFIX + name, doc, labels=[MODEL])

        running = family(GaugeMetricFamily, "num_requests_running", "Requests in the running "
                         "batch (prefilling or decoding).")
        waiting = family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be "
                         "scheduled (queued or preempted).")
        kv = family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage: fraction of KV "
                    "blocks held by live sequences (1 = 100%).")
        queries = family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up "
                         "in the prefix cache.")
        hits = family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the "
                      "prefix cache.")
        preemptions = family(CounterMetricFamily, "num_preemptions", "Sequences preempted.")
        threads = family(GaugeMetricFamily, "engine_threads", "llama.cpp threads in use now, "
                         "summed over the model's contexts (fewer while other processes use our "
                         "cores: PAGEDLLAMA_ADAPTIVE_THREADS; with several contexts an idle one "
                         "holds none and a lone busy one may use all: "
                         "PAGEDLLAMA_ELASTIC_THREADS).")
        changes = family(CounterMetricFamily, "thread_changes", "Changes of a context's thread "
                         "count by the contention-aware thread governor.")
        drafts = family(CounterMetricFamily, "spec_decode_num_drafts", "Speculative decoding: "
                        "drafts verified (one per sequence and step that verified drafted "
                        "tokens).")
        draft_tokens = family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Speculative "
                              "decoding: drafted tokens verified by the model.")
        accepted = family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Speculative "
                          "decoding: drafted tokens the model accepted.")
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: drafted tokens accepted, by their "
                                      "position in the draft (0: the first).",
                                      labels=[MODEL, "position"])
        for model, s in model_states(self.observer.workers()).items():
            running.add_metric([model], s.running)
            waiting.add_metric([model], s.waiting)
            kv.add_metric([model], s.kv_usage)
            queries.add_metric([model], s.prefix_query_tokens)
            hits.add_metric([model], s.prefix_hit_tokens)
            preemptions.add_metric([model], s.num_preemptions)
            threads.add_metric([model], s.threads)
            changes.add_metric([model], s.thread_changes)
            drafts.add_metric([model], s.spec_drafts)
            draft_tokens.add_metric([model], s.spec_draft_tokens)
            accepted.add_metric([model], s.spec_accepted_tokens)
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([model, str(pos)], n)
        yield from (running, waiting, kv, queries, hits, preemptions, threads, changes, drafts,
                    draft_tokens, accepted, per_pos)
        yield from self._step_target()
        yield from self._models()
        yield from self._batches()
        yield from self._process()

    def _step_target(self):
        """Steps that carried prompt work beside decoding streams (PAGEDLLAMA_STEP_TARGET_MS):
        how many, the largest, and how many went past the target, per context."""
        labels = [MODEL, "context"]
        steps = CounterMetricFamily(PREFIX + "steps_beside_streams", "Steps that computed prompt "
                                    "tokens beside decoding streams under the step target.",
                                    labels=labels)
        largest = GaugeMetricFamily(PREFIX + "step_beside_streams_max_seconds", "The largest "
                                    "such step's llama_decode time since start.", labels=labels)
        wall = GaugeMetricFamily(PREFIX + "step_beside_streams_max_wall_seconds", "The largest "
                                 "such step from its plan to the next plan (what a stream "
                                 "waits between two tokens).", labels=labels)
        over = CounterMetricFamily(PREFIX + "steps_over_target", "Such steps that took longer "
                                   "than the step target.", labels=labels)
        for w in self.observer.workers():
            watch = w.scheduler.watch
            at = [model_of(w), w.name]
            steps.add_metric(at, watch.steps)
            largest.add_metric(at, watch.max_s)
            wall.add_metric(at, watch.max_wall_s)
            over.add_metric(at, watch.over)
        yield from (steps, largest, wall, over)

    def _batches(self):
        """The Batch API: lines done since start (by outcome) and their tokens, lines running
        and pending, unfinished batches by status."""
        b = self.observer.batches()
        if b is None:
            return
        lines = CounterMetricFamily(PREFIX + "batch_lines", "Batch lines finished since start, "
                                    "by outcome (completed: a 200 answer; failed: an error "
                                    "line).", labels=["outcome"])
        lines.add_metric(["completed"], b["lines_completed"])
        lines.add_metric(["failed"], b["lines_failed"])
        tokens = CounterMetricFamily(PREFIX + "batch_tokens", "Tokens of the batch lines "
                                     "finished since start (prompt: cached ones included).",
                                     labels=["kind"])
        for kind in ("prompt", "cached", "completion"):
            tokens.add_metric([kind], b[f"{kind}_tokens"])
        batches = GaugeMetricFamily(PREFIX + "batches", "Unfinished batches, by status.",
                                    labels=["status"])
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            batches.add_metric([status], b["batches"].get(status, 0))
        yield from (lines, tokens, batches)
        yield GaugeMetricFamily(PREFIX + "batch_lines_running", "Batch lines in flight now.",
                                value=b["lines_running"])
        yield GaugeMetricFamily(PREFIX + "batch_lines_pending", "Lines of unfinished batches "
                                "not yet done nor in flight.", value=b["lines_pending"])

    def _models(self):
        """Per catalogued model: its state, memory (estimate, counted, measured), loads,
        unloads by reason and time spent loading; the memory budget and what it counts."""
        catalog = self.observer.catalog()
        if catalog is None:
            return
        state = GaugeMetricFamily(PREFIX + "model_state", "1 for the state a catalogued model is "
                                  "in now (unloaded, loading, loaded, unloading), 0 for the "
                                  "others.", labels=[MODEL, "state"])
        estimate = GaugeMetricFamily(PREFIX + "model_memory_estimate_bytes", "A model's "
                                     "memory estimate from its GGUF header and settings "
                                     "(weights, KV, buffers, swap allowance).", labels=[MODEL])
        reserved = GaugeMetricFamily(PREFIX + "model_memory_reserved_bytes", "Memory counted "
                                     "against the budget for a model now (0 while unloaded; "
                                     "plus its embedding context once used).", labels=[MODEL])
        measured = GaugeMetricFamily(PREFIX + "model_memory_measured_bytes", "The process's "
                                     "resident memory change across a model's last load.",
                                     labels=[MODEL])
        loads = CounterMetricFamily(PREFIX + "model_loads", "Loads of a model.", labels=[MODEL])
        unloads = CounterMetricFamily(PREFIX + "model_unloads", "Unloads of a model, by reason "
                                      "(idle, room, asked, shutdown).",
                                      labels=[MODEL, "reason"])
        load_time = CounterMetricFamily(PREFIX + "model_load_seconds", "Time spent loading a "
                                        "model.", labels=[MODEL])
        last_load = GaugeMetricFamily(PREFIX + "model_last_load_seconds", "How long a model's "
                                      "last load took.", labels=[MODEL])
        for e in catalog.entries.values():
            for s in ("unloaded", "loading", "loaded", "unloading"):
                state.add_metric([e.name, s], 1.0 if str(e.state) == s else 0.0)
            estimate.add_metric([e.name], e.estimate.total)
            reserved.add_metric([e.name], e.reserved)
            if e.measured is not None:
                measured.add_metric([e.name], e.measured)
            loads.add_metric([e.name], e.loads)
            for reason, n in e.unloads.items():
                unloads.add_metric([e.name, reason], n)
            load_time.add_metric([e.name], e.load_seconds_total)
            if e.load_seconds is not None:
                last_load.add_metric([e.name], e.load_seconds)
        yield from (state, estimate, reserved, measured, loads, unloads, load_time, last_load)
        memory = catalog.memory()
        yield GaugeMetricFamily(PREFIX + "memory_budget_bytes", "The memory the loaded models "
                                "may take together (PAGEDLLAMA_MEMORY_BUDGET).",
                                value=memory["budget"])
        yield GaugeMetricFamily(PREFIX + "memory_reserved_bytes", "Memory counted against the "
                                "budget now (the loaded and loading models' estimates).",
                                value=memory["reserved"])
        yield GaugeMetricFamily(PREFIX + "process_base_memory_bytes", "This process's resident "
                                "memory before any model was loaded.", value=memory["base"])
        yield from _tier_metrics(catalog.tiers.stats())

    def _process(self):
        p = self.observer.process
        cpu = p.proc.cpu_times()
        rss = p.proc.memory_info().rss
        vm = psutil.virtual_memory()
        yield CounterMetricFamily(PREFIX + "process_cpu_seconds", "CPU time of this process "
                                  "(user + system), from psutil.", value=cpu.user + cpu.system)
        yield GaugeMetricFamily(PREFIX + "process_resident_memory_bytes", "Resident memory of "
                                "this process, from psutil.", value=rss)
        yield GaugeMetricFamily(PREFIX + "process_memory_usage_perc", "Resident memory of this "
                                "process as a fraction of the machine's RAM.", value=rss / vm.total)
        yield GaugeMetricFamily(PREFIX + "system_memory_usage_perc", "RAM in use on the machine "
                                "(fraction).", value=vm.percent / 100)
        yield GaugeMetricFamily(PREFIX + "cpu_count", "Logical CPU cores of the machine.",
                                value=p.cores)
