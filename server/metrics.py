"""Prometheus metrics (vLLM's names under our `pagedllama:` prefix) and a recent-window summary.

Two sources:
- the engine's hooks (worker thread): counters and histograms of tokens and request latencies,
  and a small ring buffer of recent TTFT / ITL / output tokens for /stats;
- each Worker.snapshot() read at scrape time (event loop): the current state gauges (running,
  waiting, KV use) and the engine's own cumulative counters (prefix cache, preemptions).

Nothing here waits for the engine: hooks only bump counters, and a scrape only reads plain
fields (the snapshot may be one step stale, never blocked by a running llama_decode).
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import ContextStats, Observer, Request, Worker
from scheduler import FinishReason

PREFIX = "pagedllama:"
disable_created_metrics()   # no `*_created` series (as vLLM): half the lines, no use to dashboards
MODEL = "model_name"

# vLLM's buckets, with a few finer ones at the low end (a 135M model on a CPU is quick).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 128, 192, 256, 384, 512, 768,
                     1024, 2048, 4096, 8192)


# series created up front (an engine error's series appears when one happens)
FINISH_REASONS = tuple(r.value for r in (FinishReason.STOP, FinishReason.LENGTH,
                                         FinishReason.ABORT, FinishReason.TIMEOUT))


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


class RecentWindow:
    """Recent TTFTs, ITLs and output-token counts, for percentiles and tokens/s in /stats.
    Appended by the worker thread, read by the event loop; bounded in length and in time."""

    def __init__(self, seconds: float = 60.0, max_latencies: int = 8192):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_latencies)
        self._itl: deque[tuple[float, float]] = deque(maxlen=max_latencies)
        self._tokens: deque[list] = deque(maxlen=4096)   # [time, count], one per engine step

    def token(self, now: float, itl: float | None) -> None:
        with self._lock:
            if self._tokens and self._tokens[-1][0] == now:   # same step: one entry
                self._tokens[-1][1] += 1
            else:
                self._tokens.append([now, 1])
            if itl is not None:
                self._itl.append((now, itl))

    def first_token(self, now: float, ttft: float) -> None:
        with self._lock:
            self._ttft.append((now, ttft))

    def tokens_per_second(self, now: float, span: float = 5.0) -> float:
        with self._lock:
            n = sum(c for t, c in self._tokens if t > now - span)
        return n / span

    def percentiles(self, which: str, now: float, qs=(0.5, 0.9, 0.99)) -> dict[str, float | None]:
        with self._lock:
            data = list(self._ttft if which == "ttft" else self._itl)
        values = sorted(v for t, v in data if t >= now - self.seconds)
        return {f"p{round(q * 100)}": _quantile(values, q) for q in qs} | {"n": len(values)}


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank quantile."""
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[i]


class _ModelMetrics:
    """One model's pre-bound metric children, so a hook is a dict lookup and an inc()."""

    def __init__(self, m: MetricsObserver, model: str):
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.generation_tokens = m.generation_tokens.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.e2e = m.e2e.labels(model)
        self.queue_time = m.queue_time.labels(model)
        self.iteration_tokens = m.iteration_tokens.labels(model)
        self.success = {r: m.request_success.labels(model, r) for r in FINISH_REASONS}


class MetricsObserver(Observer):
    """The engine's Observer: Prometheus metrics in a private registry, plus a RecentWindow."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.window = RecentWindow()
        self.started = time.time()
        self._workers: Callable[[], list[Worker]] = list
        self._catalog: Callable[[], object | None] = lambda: None
        self._batches: Callable[[], dict | None] = lambda: None
        self._by_worker: dict[str, _ModelMetrics] = {}
        r, lab = self.registry, [MODEL]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed "
                                     "(prompt tokens, cached ones included).", lab, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens "
                                         "processed.", lab, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by "
                                       "finish reason.", [MODEL, "finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token: "
                              "arrival to first sampled token.", lab, registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive "
                             "output tokens of a request.", lab, registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish of a "
                             "request.", lab, registry=r, buckets=REQUEST_BUCKETS)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first "
                                    "scheduled step of a request.", lab, registry=r,
                                    buckets=REQUEST_BUCKETS)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens", "Tokens computed per "
                                          "engine step (one batch).", lab, registry=r,
                                          buckets=ITERATION_BUCKETS)
        self.process = ProcessStats()
        self.registry.register(_StateCollector(self))

    def watch(self, workers: Callable[[], list[Worker]]) -> None:
        """Where the state gauges read from at scrape time (e.g. `lambda: service.workers`).
        Also creates every model's series, so they read 0 before the first request."""
        self._workers = workers
        for w in workers():
            self._of(w)

    def workers(self) -> list[Worker]:
        return self._workers()

    def watch_catalog(self, catalog: Callable[[], object | None]) -> None:
        """Where the model gauges read from (server/service/catalog.py's Models)."""
        self._catalog = catalog

    def catalog(self):
        return self._catalog()

    def watch_batches(self, stats: Callable[[], dict | None]) -> None:
        """Where the Batch API's figures come from (server/batch/runner.py's stats)."""
        self._batches = stats

    def batches(self) -> dict | None:
        return self._batches()

    def _of(self, worker: Worker) -> _ModelMetrics:
        m = self._by_worker.get(worker.name)
        if m is None:
            m = self._by_worker[worker.name] = _ModelMetrics(self, model_of(worker))
        return m

    # ---- hooks: the worker thread's hot loop, so keep them tiny ----------------------------------
    def on_step(self, worker: Worker, num_tokens: int, seconds: float) -> None:
        self._of(worker).iteration_tokens.observe(num_tokens)

    def on_token(self, worker: Worker, req: Request, now: float) -> None:
        m = self._of(worker)
        m.generation_tokens.inc()
        state = req.state
        if state.last_token_time is None:          # the first token: the prefill is done
            ttft = now - req.arrival_time
            m.prompt_tokens.inc(len(req.prompt))
            m.ttft.observe(ttft)
            scheduled = state.seq.first_scheduled_time if state.seq else None
            if scheduled is not None:
                m.queue_time.observe(max(0.0, scheduled - req.arrival_time))
            self.window.first_token(now, ttft)
            self.window.token(now, None)
        else:
            itl = now - state.last_token_time
            m.itl.observe(itl)
            self.window.token(now, itl)

    def on_finish(self, worker: Worker, req: Request) -> None:
        m = self._of(worker)
        reason = str(req.finish_reason or "unknown")
        (m.success.get(reason) or self.request_success.labels(model_of(worker), reason)).inc()
        if req.state.finish_time is not None:
            m.e2e.observe(req.state.finish_time - req.arrival_time)

    # ---- readers (event loop) ------------------------------------------------------------------
    def stats(self) -> dict:
        """The /stats snapshot: small JSON for humans, scripts and the dashboard."""
        now = time.monotonic()
        states = model_states(self.workers())
        total = ModelState()
        for s in states.values():
            total.add(s)
        return {
            "time": time.time(),
            "uptime_s": round(time.time() - self.started, 3),
            "active_streams": total.outstanding,
            "running": total.running,
            "waiting": total.waiting,
            "queue_length": total.waiting,
            "tokens_per_s": round(self.window.tokens_per_second(now), 3),
            "kv_cache_usage_perc": round(100 * total.kv_usage, 3),
            "kv_used_blocks": total.kv_used_blocks,
            "kv_total_blocks": total.kv_total_blocks,
            "prefix_cache_queries": total.prefix_query_tokens,
            "prefix_cache_hits": total.prefix_hit_tokens,
            "prefix_cache_hit_rate": total.prefix_hit_rate,
            "num_preemptions": total.num_preemptions,
            "spec_draft_tokens": total.spec_draft_tokens,
            "spec_accepted_tokens": total.spec_accepted_tokens,
            "spec_acceptance": total.spec_acceptance,
            "threads": total.threads,
            "configured_threads": total.configured_threads,
            "ttft_s": self.window.percentiles("ttft", now),
            "itl_s": self.window.percentiles("itl", now),
            **self.process.summary(),
            "models": {name: _model_json(s) for name, s in states.items()},
            **_catalog_json(self.catalog()),
            "batch": self.batches(),
        }


def _model_json(s: ModelState) -> dict:
    return {"running": s.running, "waiting": s.waiting, "active_streams": s.outstanding,
            "kv_cache_usage_perc": round(100 * s.kv_usage, 3), "kv_used_blocks": s.kv_used_blocks,
            "kv_total_blocks": s.kv_total_blocks, "prefix_cache_hit_rate": s.prefix_hit_rate,
            "num_preemptions": s.num_preemptions, "steps": s.steps, "threads": s.threads,
            "spec_draft_tokens": s.spec_draft_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_acceptance": s.spec_acceptance,
            "configured_threads": s.configured_threads, "thread_changes": s.thread_changes}


def _catalog_json(catalog) -> dict:
    """The catalogue for /stats and the dashboard: each model's state and memory, the budget,
    and the latest loads and unloads."""
    if catalog is None:
        return {}
    now = time.monotonic()
    return {
        "memory": catalog.memory(),
        "prefix_cache_tiers": catalog.tiers.stats(),
        "catalog": [{"model": e.name, "state": str(e.state), "pinned": e.pinned,
                     "keep_alive": e.keep_alive, "in_use": e.users,
                     "idle_s": round(now - e.last_used, 1) if not e.users else 0.0,
                     "estimate": e.estimate.total, "reserved": e.reserved,
                     "measured": e.measured, "loads": e.loads,
                     "unloads": sum(e.unloads.values()), "load_seconds": e.load_seconds}
                    for e in catalog.entries.values()],
        "lifecycle": [{"time": ev.time, "model": ev.model, "kind": ev.kind,
                       "reason": ev.reason, "seconds": round(ev.seconds, 3),
                       "memory_delta": ev.memory_delta} for ev in list(catalog.events)[-10:]],
    }


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


class ProcessStats:
    """This process's CPU and memory (psutil). CPU % is measured between reads at least half a
    second apart, so several pollers do not make it noisy."""

    def __init__(self):
        self.proc = psutil.Process(os.getpid())
        self.cores = psutil.cpu_count() or 1
        self._last = 0.0
        self._cpu = self._system_cpu = 0.0
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)

    def cpu(self) -> tuple[float, float]:
        """(this process, the whole machine) CPU use in percent of all cores."""
        now = time.monotonic()
        if now - self._last >= 0.5:
            self._cpu = self.proc.cpu_percent(None) / self.cores
            self._system_cpu = psutil.cpu_percent(None)
            self._last = now
        return self._cpu, self._system_cpu

    def summary(self) -> dict:
        cpu, system_cpu = self.cpu()
        rss = self.proc.memory_info().rss
        vm = psutil.virtual_memory()
        return {"cpu_percent": round(cpu, 2), "system_cpu_percent": round(system_cpu, 2),
                "ram_percent": round(vm.percent, 2),
                "process_ram_percent": round(100 * rss / vm.total, 3),
                "rss_bytes": rss, "cpu_count": self.cores}


class _StateCollector(Collector):
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
