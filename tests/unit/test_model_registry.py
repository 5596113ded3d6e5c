"""The catalogue's load and unload policy (server/service/catalog.py) with fake loads: the budget,
least recently used idle models unloaded first, leases, keep_alive, pins, one load for many
waiters, failures. The real loads are in tests/test_models_on_demand.py."""
import asyncio
import random
import time
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.memory import MemoryEstimate
from server.config import ModelSpec, Settings
from server.http.errors import APIError
from server.service.catalog import Entry, Models, State

MB = 1_000_000


class FakeLoaded:
    def __init__(self, name):
        self.name, self.in_flight = name, 0


class FakeModels(Models):
    """Models whose loads take `load_s` seconds on the load thread and allocate nothing; every
    load and unload is recorded, and the memory counted is checked against the budget at each."""

    def __init__(self, sizes: dict[str, int], budget: int, pins=(), keep_alive=300.0,
                 load_s=0.02, fail=()):
        self.sizes, self.load_s, self.fail = sizes, load_s, set(fail)
        self.log: list[tuple[str, str]] = []
        specs = [ModelSpec(name, Path(f"/models/{name}.gguf"), EngineConfig(),
                           pin=name in pins, keep_alive=-1 if name in pins else keep_alive)
                 for name in sizes]
        super().__init__(Settings(specs, memory_budget=budget, memory_budget_source="test",
                                  load_timeout=5.0, elastic_threads=False))

    def _entry(self, spec):
        size = self.sizes[spec.name]
        return Entry(spec, {}, MemoryEstimate(size, 0, 0, 0, 0, size // 10),
                     keep_alive=spec.keep_alive)

    def _load_sync(self, entry, reason):
        assert self.reserved <= self.budget
        time.sleep(self.load_s)
        if entry.name in self.fail:
            raise RuntimeError("no such luck")
        self.log.append(("load", entry.name))
        entry.loads += 1
        return FakeLoaded(entry.name)

    def _unload_sync(self, entry, lm, reason):
        if lm is not None:
            self.log.append(("unload", entry.name))


def run(coro):
    return asyncio.run(coro)


async def use(models, name, keep_alive=None, hold_s=0.0):
    """A request: lease the model, have it loaded, keep it hold_s seconds, release it."""
    entry = models.entry(name)
    lease = models.lease(entry, keep_alive)
    try:
        lm = await models.loaded_model(entry)
        await asyncio.sleep(hold_s)
        return lm
    finally:
        lease.release()


def test_concurrent_first_requests_load_a_model_once():
    async def main():
        models = FakeModels({"a": 100 * MB}, budget=200 * MB, load_s=0.2)
        got = await asyncio.gather(*[use(models, "a") for _ in range(8)])
        assert len({id(lm) for lm in got}) == 1 and models.log == [("load", "a")]
    run(main())


def test_a_model_that_does_not_fit_unloads_the_least_recently_used_idle_one_first():
    async def main():
        models = FakeModels({"a": 60 * MB, "b": 60 * MB, "c": 60 * MB}, budget=130 * MB)
        await use(models, "a")
        await use(models, "b")
        await use(models, "a")          # a is now the more recently used
        await use(models, "c")
        assert models.log[-2:] == [("unload", "b"), ("load", "c")]
        assert models.entries["a"].state is State.LOADED
        assert models.entries["b"].state is State.UNLOADED
        assert models.reserved == 120 * MB <= models.budget
    run(main())


def test_a_model_with_a_request_in_flight_is_never_unloaded_and_the_newcomer_gets_a_503():
    async def main():
        models = FakeModels({"a": 100 * MB, "b": 100 * MB}, budget=150 * MB)
        entry = models.entry("a")
        lease = models.lease(entry)
        await models.loaded_model(entry)
        with pytest.raises(APIError) as exc:
            await use(models, "b")
        assert exc.value.status == 503 and exc.value.headers["Retry-After"]
        assert exc.value.code == "model_capacity_exceeded"
        entry.loaded.in_flight = 1    # its request is in the engine, its lease released
        lease.release()
        with pytest.raises(APIError):
            await use(models, "b")
        entry.loaded.in_flight = 0
        await use(models, "b")        # idle now: a makes room
        assert models.log == [("load", "a"), ("unload", "a"), ("load", "b")]
    run(main())


def test_a_model_larger_than_the_whole_budget_is_a_400_naming_it():
    async def main():
        models = FakeModels({"big": 300 * MB, "a": 10 * MB}, budget=200 * MB)
        with pytest.raises(APIError) as exc:
            await use(models, "big")
        assert exc.value.status == 400 and exc.value.code == "model_exceeds_memory_budget"
        assert "'big'" in str(exc.value.message) and models.log == []
        assert models.reserved == 0
    run(main())


def test_pinned_models_load_at_start_and_are_never_unloaded():
    async def main():
        models = FakeModels({"pinned": 100 * MB, "a": 100 * MB, "b": 100 * MB},
                            budget=250 * MB, pins={"pinned"}, keep_alive=0)
        models.start()
        assert models.entries["pinned"].state is State.LOADED
        await use(models, "a")
        await use(models, "b")      # room from a, never from the pinned one
        assert models.reap(time.monotonic() + 10_000) == ["b"]
        big = FakeModels({"pinned": 100 * MB, "c": 200 * MB}, budget=250 * MB, pins={"pinned"})
        big.start()
        with pytest.raises(APIError) as exc:   # fits the budget, never beside the pinned one
            await use(big, "c")
        assert exc.value.status == 400 and "pinned" in exc.value.message
        with pytest.raises(APIError) as exc:
            models.unload(models.entry("pinned"), "asked")
        assert exc.value.status == 409
        assert models.entries["pinned"].state is State.LOADED
        assert ("unload", "pinned") not in models.log
    run(main())


def test_pinned_models_that_do_not_fit_together_stop_the_server():
    models = FakeModels({"a": 100 * MB, "b": 100 * MB}, budget=150 * MB, pins={"a", "b"})
    with pytest.raises(ValueError, match="pinned models"):
        models.start()


def test_an_idle_model_unloads_after_its_keep_alive_and_a_requests_keep_alive_wins():
    async def main():
        models = FakeModels({"a": 10 * MB, "b": 10 * MB}, budget=100 * MB, keep_alive=60)
        await use(models, "a")
        await use(models, "b", keep_alive=-1)            # never, for b
        t = models.entries["a"].last_used
        assert models.reap(t + 59) == []
        assert models.reap(t + 61) == ["a"]
        assert models.reap(t + 10**6) == []
        await asyncio.sleep(0.05)
        assert models.entries["a"].state is State.UNLOADED
        assert models.entries["b"].state is State.LOADED
        await use(models, "a", keep_alive=0)              # 0: as soon as it is idle
        assert models.reap(time.monotonic()) == ["a"]
    run(main())


def test_unloading_a_busy_model_waits_for_its_requests_then_happens():
    async def main():
        models = FakeModels({"a": 10 * MB}, budget=100 * MB)
        entry = models.entry("a")
        lease = models.lease(entry)
        await models.loaded_model(entry)
        assert models.unload(entry, "asked") is False and entry.state is State.LOADED
        assert models.reap(time.monotonic()) == []
        lease.release()
        assert models.reap(time.monotonic()) == ["a"]
        await asyncio.sleep(0.05)
        assert entry.state is State.UNLOADED
    run(main())


def test_a_failed_load_is_a_500_for_its_waiters_and_the_next_request_tries_again():
    async def main():
        models = FakeModels({"a": 10 * MB}, budget=100 * MB, fail={"a"})
        results = await asyncio.gather(*[use(models, "a") for _ in range(3)],
                                       return_exceptions=True)
        assert all(isinstance(r, APIError) and r.status == 500
                   and r.code == "model_load_failed" for r in results)
        assert models.entries["a"].state is State.UNLOADED and models.reserved == 0
        assert models.entries["a"].error == "no such luck"
        models.fail.clear()
        await use(models, "a")
        assert models.entries["a"].state is State.LOADED
    run(main())


def test_a_request_arriving_while_its_model_unloads_loads_it_again():
    async def main():
        models = FakeModels({"a": 10 * MB}, budget=100 * MB, load_s=0.1)
        await use(models, "a")
        models.unload(models.entry("a"), "asked")
        assert models.entries["a"].state is State.UNLOADING
        await use(models, "a")
        assert models.log == [("load", "a"), ("unload", "a"), ("load", "a")]
    run(main())


def test_the_embedding_context_is_counted_on_first_use_and_may_make_room():
    async def main():
        models = FakeModels({"a": 60 * MB, "b": 60 * MB}, budget=125 * MB)
        await use(models, "b")
        entry = models.entry("a")
        lease = models.lease(entry)
        await models.loaded_model(entry)
        await models.reserve_embedding(entry)   # 6 MB more: b goes
        assert entry.reserved == 66 * MB and models.entries["b"].state is State.UNLOADED
        await models.reserve_embedding(entry)   # counted once
        assert entry.reserved == 66 * MB
        lease.release()
    run(main())


def test_random_traffic_never_counts_more_than_the_budget_and_answers_every_request():
    """Requests for five models of random sizes, some holding theirs a while, some going
    past the budget: every request is served or gets a 503 (never a 400: each fits alone),
    the memory counted never exceeds the budget, and loads alternate with unloads."""
    rng = random.Random(3)
    sizes = {f"m{i}": rng.randint(20, 90) * MB for i in range(5)}

    async def main():
        models = FakeModels(sizes, budget=150 * MB, load_s=0.005)
        outcomes = []

        async def one(i):
            await asyncio.sleep(rng.random() * 0.5)
            try:
                await use(models, rng.choice(list(sizes)), hold_s=rng.random() * 0.05)
                outcomes.append(200)
            except APIError as exc:
                outcomes.append(exc.status)
            assert models.reserved <= models.budget

        await asyncio.gather(*[one(i) for i in range(60)])
        assert set(outcomes) <= {200, 503} and outcomes.count(200) > 30
        loads = sum(1 for kind, _ in models.log if kind == "load")
        assert loads > len(sizes)    # models came and went
    run(main())
