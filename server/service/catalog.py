"""The models this process may serve (the catalogue), which of them are loaded, and the memory
budget they share.

Every catalogued model has an entry with its state (unloaded, loading, loaded, unloading), its
memory estimate (engine/memory.py: from its GGUF header and settings, before loading) and what
its load measured. A request for a model that is not loaded loads it (`Models.acquire`); the
requests that arrive meanwhile wait for that one load. Loading would go past the budget: the
least recently used idle models are unloaded first; a model with requests in flight (or waiting
for it) is never unloaded; when nothing can make room the request gets a 503 with Retry-After
(a 400 when the model alone is larger than the budget). Pinned models load at start-up and never
unload; the others unload after `keep_alive` seconds idle (the model's, or the last request's).

Invariants:
- The memory counted against the budget (`reserved`) never exceeds it: a model's estimate is
  counted from the moment its load is decided, and a model chosen to make room stops counting
  then, because loads and unloads run one at a time, in the order they were decided, on one
  thread (`self.executor`): the room is free before the next load takes it.
- State changes happen on the event loop; the loading and unloading (seconds of llama.cpp work)
  on that thread, never on the event loop.
- A request holds its model (`Lease`) from the moment it names it until its exchange ends: its
  client keeps the lease (server/service/client.py; server/http/client.py releases an HTTP
  request's when the answer has been sent), streaming included.

The loading and unloading themselves (the llama.cpp work: weights, contexts, chat template,
embedding context), and what a model file says before it loads (its header, its context cap,
its memory estimate), are server/service/loading.py's (`ModelLoader`, `LoadedModel`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import psutil

from engine import ChatTemplate, Observer
from engine.memory import MemoryEstimate, MiB
from kvcache import PrefixStore
from server.config import ModelSpec, Settings
from server.errors import APIError
from server.service.loading import LoadedModel, ModelLoader, cap_context, spec_estimate, spec_header

log = logging.getLogger("pagedllama.models")

RETRY_AFTER_S = 2      # what a 503 for room tells the client
REAP_EVERY_S = 1.0     # how often idle models are checked against their keep_alive


def rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss



class State(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(eq=False)
class Entry:
    """One catalogued model."""
    spec: ModelSpec
    facts: dict                   # from the GGUF header (engine/gguf_info.py)
    estimate: MemoryEstimate
    state: State = State.UNLOADED
    loaded: LoadedModel | None = None
    task: asyncio.Future | None = None   # the load or unload under way
    users: int = 0                # requests holding it (leases), waiting for its load included
    reserved: int = 0             # bytes counted against the budget now
    embedding_reserved: bool = False
    keep_alive: float = 300.0     # seconds idle before unloading (< 0: never): the model's, or
                                  # the last request's
    unload_when_idle: bool = False   # asked to unload while requests were in flight
    last_used: float = field(default_factory=time.monotonic)
    measured: int | None = None   # the process's memory change across its last load
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)   # by unload_kind
    load_seconds: float | None = None     # the last load's
    unload_seconds: float | None = None   # the last unload's
    load_seconds_total: float = 0.0
    error: str | None = None      # why the last load failed
    tool_format: str | None = None   # from its chat template (LoadedModel.tool_format)
    thinks: bool = False             # its chat template writes reasoning blocks

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pinned(self) -> bool:
        return self.spec.pin

    @property
    def idle(self) -> bool:
        return self.users == 0 and (self.loaded is None or self.loaded.in_flight == 0)

    def memory(self) -> dict:
        return {"estimate": self.estimate.as_dict(), "reserved": self.reserved,
                "measured": self.measured}


class Lease:
    """A request's hold on a model: while any is held, the model is not unloaded."""

    def __init__(self, models: Models, entry: Entry):
        self.models, self.entry, self.held = models, entry, True
        entry.users += 1
        entry.last_used = time.monotonic()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.models.release(self.entry)


@dataclass
class LifecycleEvent:
    time: float
    model: str
    kind: str          # "load", "unload", "load_failed"
    reason: str
    seconds: float
    memory_delta: int  # the process's memory change across it


class Models:
    """The catalogue, its budget and the load/unload policy (module doc)."""

    def __init__(self, settings: Settings, observer: Observer | None = None):
        self.settings, self.observer = settings, observer
        self.budget = settings.memory_budget
        self.load_timeout = settings.load_timeout
        self.entries: dict[str, Entry] = {}
        for spec in settings.models:
            self.entries[spec.name] = self._entry(spec)
        # loads and unloads, one at a time, in the order decided (module doc)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="model-load")
        self.events: deque[LifecycleEvent] = deque(maxlen=64)
        self.base_rss = rss()     # the process without models (set again by start)
        self._reaper: asyncio.Task | None = None
        self._kick: asyncio.Event | None = None
        self.load_seconds_sum = 0.0
        cache = settings.cache
        # the prefix cache's tiers: RAM within what the models leave of the budget
        self.tiers = PrefixStore(ram_limit=self._cache_room, disk_dir=cache.disk_dir,
                                 disk_limit=cache.disk, min_tokens=cache.min_tokens)
        log.info("prefix cache tiers: RAM %s, disk %s, snapshots of %d tokens or more",
                 "off" if cache.ram == 0 else (f"up to {_mib(cache.ram)} within the budget"
                                               if cache.ram else "what the budget leaves"),
                 self.tiers.disk_note if cache.disk_dir is None
                 else f"{self.tiers.disk_note}, up to {_mib(cache.disk)}", cache.min_tokens)
        self.loader = ModelLoader(settings, observer, self.tiers)   # works on self.executor

    def _cache_room(self) -> int:
        """Bytes the RAM tier may hold now: what the loaded models leave of the budget (and at
        most PAGEDLLAMA_CACHE_RAM)."""
        room = self.budget - self.reserved
        cap = self.settings.cache.ram
        return room if cap is None else min(cap, room)

    def _entry(self, spec: ModelSpec) -> Entry:
        header = spec_header(spec)
        cap_context(spec, header, self.settings.beyond_trained)
        facts, est = spec_estimate(spec, header)
        entry = Entry(spec, facts, est, keep_alive=spec.keep_alive)
        source = (spec.chat_template.read_text() if spec.chat_template is not None
                  else header.metadata.get("tokenizer.chat_template"))
        if source:   # what the template does is known before loading (engine/chat.py)
            template = ChatTemplate(source)
            entry.tool_format = "template" if template.knows_tools else "fallback"
            entry.thinks = template.thinks
        return entry

    # ---- start and stop (not on the event loop) -------------------------------------------------
    def start(self) -> None:
        """Load the pinned models now (they must fit the budget together)."""
        self.base_rss = rss()
        pinned = [e for e in self.entries.values() if e.pinned]
        need = sum(e.estimate.total for e in pinned)
        if need > self.budget:
            raise ValueError(
                f"the pinned models ({', '.join(e.name for e in pinned)}) need an estimated "
                f"{_mib(need)} together, more than the memory budget of {_mib(self.budget)} "
                f"({self.settings.memory_budget_source}); raise PAGEDLLAMA_MEMORY_BUDGET or "
                "unpin one")
        log.info("memory budget %s (%s); %d model(s) catalogued, %d pinned; process memory "
                 "without models %s", _mib(self.budget), self.settings.memory_budget_source,
                 len(self.entries), len(pinned), _mib(self.base_rss))
        for entry in self.entries.values():
            log.info("catalogued %s from %s: estimate %s (weights %s, KV %s, compute %s, "
                     "swap %s, python %s; embeddings %s more)%s", entry.name, entry.spec.path,
                     _mib(entry.estimate.total), _mib(entry.estimate.weights),
                     _mib(entry.estimate.kv), _mib(entry.estimate.compute),
                     _mib(entry.estimate.swap), _mib(entry.estimate.python),
                     _mib(entry.estimate.embedding),
                     ", pinned" if entry.pinned else
                     f", keep_alive {_keep_alive_text(entry.keep_alive)}")
        for entry in pinned:
            entry.reserved, entry.state = entry.estimate.total, State.LOADING
            try:
                self._finish_load(entry, self._load_sync(entry, "pinned"))
            except Exception:
                entry.reserved, entry.state = 0, State.UNLOADED
                raise

    def close(self) -> None:
        """Unload everything (the server stops: nothing is in flight any more)."""
        if self._reaper is not None:
            self._reaper.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)
        for entry in self.entries.values():
            if entry.loaded is not None:
                lm, entry.loaded = entry.loaded, None
                self._unload_sync(entry, lm, "shutdown")
            entry.state, entry.reserved = State.UNLOADED, 0
        self.tiers.close()   # what is queued for disk is written first

    def start_reaper(self) -> None:
        """Unload idle models past their keep_alive (on the running event loop)."""
        self._kick = asyncio.Event()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    # ---- what the service and the routes read ---------------------------------------------------
    @property
    def loaded(self) -> dict[str, LoadedModel]:
        return {name: e.loaded for name, e in self.entries.items()
                if e.state is State.LOADED and e.loaded is not None}

    @property
    def reserved(self) -> int:
        return sum(e.reserved for e in self.entries.values())

    def entry(self, name: str | None) -> Entry:
        entry = self.entries.get(name or "")
        if entry is None:
            raise APIError(404, f"The model '{name}' does not exist. Available: "
                           f"{', '.join(self.entries)}", "model_not_found", "model")
        return entry

    def memory(self) -> dict:
        return {"budget": self.budget, "budget_source": self.settings.memory_budget_source,
                "reserved": self.reserved, "prefix_cache_ram": self.tiers.ram_bytes,
                "process": rss(), "base": self.base_rss}

    # ---- acquiring a model for a request --------------------------------------------------------
    def lease(self, entry: Entry, keep_alive: float | None = None) -> Lease:
        if keep_alive is not None and not entry.pinned:
            entry.keep_alive = keep_alive   # the last request's keep_alive wins (Ollama's)
        return Lease(self, entry)

    def release(self, entry: Entry) -> None:
        entry.users -= 1
        entry.last_used = time.monotonic()
        if entry.users == 0 and self._kick is not None:
            self._kick.set()   # keep_alive 0, or an unload asked for while it was busy

    async def loaded_model(self, entry: Entry, disconnected: Callable | None = None,
                           reason: str = "request") -> LoadedModel:
        """The entry's loaded model, loading it first if need be (the caller holds a lease).
        Waits at most load_timeout; `disconnected` (an async callable) ends the wait early when
        the client has gone."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            if entry.state is State.LOADED and entry.loaded is not None:
                entry.last_used = time.monotonic()
                return entry.loaded
            if entry.state is State.UNLOADED:
                self._start_load(entry, reason)
            assert entry.task is not None
            await self._wait(entry, entry.task, deadline, disconnected)

    async def _wait(self, entry: Entry, task: asyncio.Future, deadline: float,
                    disconnected: Callable | None) -> None:
        while not task.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(503, f"The model '{entry.name}' is still loading after "
                               f"{self.load_timeout:g} s; retry shortly.", "model_loading",
                               "model", headers={"Retry-After": str(RETRY_AFTER_S)})
            await asyncio.wait({task}, timeout=min(0.5, left))
            if not task.done() and disconnected is not None and await disconnected():
                raise APIError(499, "client disconnected", "client_disconnected")
        if task.exception() is not None:
            raise APIError(500, f"The model '{entry.name}' could not be loaded: "
                           f"{task.exception()}", "model_load_failed", "model")

    # ---- the budget -----------------------------------------------------------------------------
    def make_room(self, need: int, for_entry: Entry, what: str) -> list[Entry]:
        """Pick the least recently used idle models whose unloading leaves `need` bytes free,
        and stop counting them (their unloads are queued before anything else loads). Raises a
        400 when `need` alone exceeds the budget, a 503 when the models that could make room
        are busy."""
        pinned = sum(e.reserved for e in self.entries.values()
                     if e.pinned and e is not for_entry)
        if need > self.budget - pinned:
            beside = f" beside the pinned models' {_mib(pinned)}" if pinned else ""
            raise APIError(400, f"The model '{for_entry.name}' needs an estimated "
                           f"{_mib(need)} ({what}), more than this server's memory budget of "
                           f"{_mib(self.budget)} (PAGEDLLAMA_MEMORY_BUDGET) leaves{beside}.",
                           "model_exceeds_memory_budget", "model")
        free = self.budget - self.reserved - self.tiers.ram_bytes
        if free < need:   # the RAM tier gives way first
            free += self.tiers.shrink(max(0, self.tiers.ram_bytes - (need - free)))
        if free >= need:
            return []
        idle = sorted((e for e in self.entries.values()
                       if e is not for_entry and e.state is State.LOADED and not e.pinned
                       and e.idle), key=lambda e: e.last_used)
        victims = []
        for victim in idle:
            victims.append(victim)
            free += victim.reserved
            if free >= need:
                break
        if free < need:
            busy = [e.name for e in self.entries.values()
                    if e is not for_entry and e.reserved and e not in victims]
            raise APIError(503, f"No memory for the model '{for_entry.name}' now: it needs "
                           f"an estimated {_mib(need)} ({what}) and {_mib(free)} of the "
                           f"{_mib(self.budget)} budget could be freed; "
                           f"{', '.join(busy) or 'other models'} are in use or pinned. Retry "
                           "once their requests have finished.", "model_capacity_exceeded",
                           "model", headers={"Retry-After": str(RETRY_AFTER_S)})
        for victim in victims:
            self._start_unload(victim, f"room for {for_entry.name}")
        return victims

    def _start_load(self, entry: Entry, reason: str) -> None:
        self.make_room(entry.estimate.total, entry, "weights, KV cache and buffers")
        entry.state, entry.reserved, entry.error = State.LOADING, entry.estimate.total, None
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, self._load_sync, entry, reason)
        entry.task = loop.create_task(self._after_load(entry, future))
        entry.task.add_done_callback(_retrieved)

    async def _after_load(self, entry: Entry, future: asyncio.Future) -> None:
        try:
            lm = await future
        except Exception as exc:
            entry.state, entry.reserved, entry.task = State.UNLOADED, 0, None
            entry.embedding_reserved = False
            entry.error = str(exc)
            self.events.append(LifecycleEvent(time.time(), entry.name, "load_failed", str(exc),
                                              0.0, 0))
            log.error("loading %s failed: %s", entry.name, exc)
            raise
        self._finish_load(entry, lm)

    def _finish_load(self, entry: Entry, lm: LoadedModel) -> None:
        entry.loaded, entry.state, entry.last_used = lm, State.LOADED, time.monotonic()

    def _start_unload(self, entry: Entry, reason: str) -> None:
        """Unload an idle loaded model: it stops counting now, the work is queued."""
        lm, entry.loaded = entry.loaded, None
        entry.state, entry.reserved = State.UNLOADING, 0
        entry.embedding_reserved = entry.unload_when_idle = False
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, self._unload_sync, entry, lm, reason)
        entry.task = loop.create_task(self._after_unload(entry, future))

    async def _after_unload(self, entry: Entry, future: asyncio.Future) -> None:
        try:
            await future
        finally:
            entry.state, entry.task = State.UNLOADED, None
            entry.keep_alive = entry.spec.keep_alive

    async def reserve_embedding(self, entry: Entry) -> None:
        """Count the embedding context against the budget before it is made (first use)."""
        if entry.embedding_reserved:
            return
        victims = self.make_room(entry.estimate.embedding, entry, "its embedding context")
        entry.reserved += entry.estimate.embedding
        entry.embedding_reserved = True
        for victim in victims:   # their memory is free before the context is made
            if victim.task is not None:
                await asyncio.shield(victim.task)

    # ---- explicit load and unload (POST /models/{id}/load, /unload) -----------------------------
    def unload(self, entry: Entry, reason: str) -> bool:
        """Unload now if idle (True); else once its requests have finished (False)."""
        if entry.pinned:
            raise APIError(409, f"The model '{entry.name}' is pinned (pin: true): it stays "
                           "loaded.", "model_pinned", "model")
        if entry.state is not State.LOADED:
            return entry.state in (State.UNLOADED, State.UNLOADING)
        if entry.idle:
            self._start_unload(entry, reason)
            return True
        entry.unload_when_idle = True
        return False

    # ---- unloading idle models ------------------------------------------------------------------
    async def _reap_forever(self) -> None:
        assert self._kick is not None
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=REAP_EVERY_S)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                self.reap(time.monotonic())
            except Exception:   # the reaper must outlive a surprise
                log.exception("checking idle models failed")

    def reap(self, now: float) -> list[str]:
        """Unload the idle models past their keep_alive (or asked to unload); their names."""
        done = []
        for entry in self.entries.values():
            if entry.state is not State.LOADED or entry.pinned or not entry.idle:
                continue
            if entry.unload_when_idle:
                self._start_unload(entry, "unload asked for (POST /models/{id}/unload)")
            elif entry.keep_alive >= 0 and now - entry.last_used >= entry.keep_alive:
                self._start_unload(entry, f"idle for {_keep_alive_text(entry.keep_alive)} "
                                   "(keep_alive)")
            else:
                continue
            done.append(entry.name)
        return done

    # ---- on the load thread ---------------------------------------------------------------------
    def _load_sync(self, entry: Entry, reason: str) -> LoadedModel:
        spec, t0, before = entry.spec, time.perf_counter(), rss()
        lm = self.loader.load(spec, entry.facts)
        seconds, delta = time.perf_counter() - t0, rss() - before
        entry.measured, entry.loads = delta, entry.loads + 1
        entry.load_seconds, entry.load_seconds_total = seconds, entry.load_seconds_total + seconds
        self.events.append(LifecycleEvent(time.time(), spec.name, "load", reason, seconds, delta))
        log.info("loaded %s (%s) in %.2f s: estimate %s, process memory %+.0f MiB (now %s); "
                 "budget %s of %s counted; %d context(s) x %d threads, n_ctx %d, %d sequences "
                 "+ %d cache, %s %s KV, %s attention, tool_format %s%s", spec.name, reason,
                 seconds, _mib(entry.estimate.total), delta / MiB, _mib(rss()),
                 _mib(self.reserved), _mib(self.budget), spec.contexts, spec.engine.n_threads,
                 spec.engine.n_ctx, spec.engine.max_seqs,
                 spec.engine.cache_seqs if spec.engine.prefix_caching else 0,
                 "unified" if spec.engine.kv_unified else "split", spec.engine.kv_type,
                 "flash" if lm.workers[0].config.flash_attn else "plain",
                 lm.tool_format or "none (no chat template)",
                 f", chat template from {spec.chat_template}" if spec.chat_template else "")
        return lm

    def _unload_sync(self, entry: Entry, lm: LoadedModel | None, reason: str) -> None:
        if lm is None:
            return
        t0, before = time.perf_counter(), rss()
        self.loader.unload(lm)
        seconds, delta = time.perf_counter() - t0, rss() - before
        kind = unload_kind(reason)
        entry.unloads[kind] = entry.unloads.get(kind, 0) + 1
        entry.unload_seconds = seconds
        self.events.append(LifecycleEvent(time.time(), entry.name, "unload", reason, seconds,
                                          delta))
        log.info("unloaded %s (%s) in %.2f s: process memory %+.0f MiB (now %s)", entry.name,
                 reason, seconds, delta / MiB, _mib(rss()))


def unload_kind(reason: str) -> str:
    """An unload's reason in one word: idle, room, asked or shutdown."""
    for prefix, kind in (("idle", "idle"), ("room", "room"), ("unload asked", "asked")):
        if reason.startswith(prefix):
            return kind
    return reason


def _retrieved(task: asyncio.Future) -> None:
    """Mark a load's failure as seen: its waiters report it (or there were none left)."""
    if not task.cancelled():
        task.exception()


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def _keep_alive_text(seconds: float) -> str:
    return "never" if seconds < 0 else f"{seconds:g} s"
