"""Prometheus metrics (vLLM's names under our `pagedllama:` prefix) and a recent-window summary.

Two sources:
- the engine's hooks (worker thread): counters and histograms of tokens and request latencies,
  and a small ring buffer of recent TTFT / ITL / output tokens for /stats;
- each Worker.snapshot() read at scrape time (event loop): the current state gauges (running,
  waiting, KV use) and the engine's own cumulative counters (prefix cache, preemptions), built
  by server/metrics_state.py's StateCollector.

Nothing here waits for the engine: hooks only bump counters, and a scrape only reads plain
fields (the snapshot may be one step stale, never blocked by a running llama_decode).
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from engine import Observer, Request, Worker
from scheduler import FinishReason
from server.metrics_state import MODEL, PREFIX, ModelState, StateCollector, model_of, model_states

disable_created_metrics()   # no `*_created` series (as vLLM): half the lines, no use to dashboards

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
        self.registry.register(StateCollector(self))

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
