"""The prompt pool: cheapest job first, small prompts never behind big ones, abandoned jobs
dropped, errors handed back."""
import asyncio
import threading
import time

import numpy as np
import pytest

from server.service.prompts import PromptPool, TokenBound


def run(coro):
    return asyncio.run(coro)


def blocker():
    """A job that holds its lane until released, and a way to know it started."""
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        release.wait(5)
        return "blocker"
    return job, started, release


async def occupied(pool: PromptPool):
    """The pool busy with a 1,000-byte job until `release` is set: its future and `release`."""
    job, started, release = blocker()
    running = asyncio.ensure_future(pool.run(1000, job))
    await asyncio.to_thread(started.wait, 5)
    return running, release


def test_a_lane_runs_its_cheapest_waiting_job_first():
    async def main():
        pool, order = PromptPool(small_bytes=10), []
        first, release = await occupied(pool)
        waiting = [asyncio.ensure_future(pool.run(cost, lambda c=cost: order.append(c)))
                   for cost in (900, 100, 500)]
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(first, *waiting)
        pool.close()
        return order
    assert run(main()) == [100, 500, 900]


def test_a_small_prompt_does_not_wait_behind_a_large_one():
    async def main():
        pool = PromptPool(small_bytes=10)
        large, release = await occupied(pool)
        t0 = time.monotonic()
        small = await pool.run(5, lambda: "small")
        waited = time.monotonic() - t0
        release.set()
        await large
        pool.close()
        return small, waited
    small, waited = run(main())
    assert small == "small" and waited < 1.0


def test_a_job_whose_request_went_away_is_dropped_before_it_starts():
    async def main():
        pool, ran = PromptPool(small_bytes=10), []
        first, release = await occupied(pool)
        abandoned = asyncio.ensure_future(pool.run(2000, lambda: ran.append("abandoned")))
        await asyncio.sleep(0.05)
        abandoned.cancel()
        release.set()
        await first
        await pool.run(3000, lambda: None)     # the lane has passed the abandoned job
        pool.close()
        return ran
    assert run(main()) == []


def test_an_error_in_a_job_is_raised_to_its_request():
    async def main():
        pool = PromptPool()

        def fails():
            raise ValueError("bad prompt")
        try:
            await pool.run(1, fails)
        finally:
            pool.close()
    with pytest.raises(ValueError, match="bad prompt"):
        run(main())


def test_the_token_bound_sums_byte_weights_and_rounds_down():
    weights = np.zeros(256)
    weights[ord("a")] = 1 / 4            # the longest token holding "a" is 4 bytes
    weights[ord("b")] = 1.0
    bound = TokenBound(weights)
    assert bound.at_least("aaaaaaaa") == 2 and bound.at_least("aaab") == 1
    assert bound.at_least("aaaabb") == 3 and bound.at_least("") == 0


def test_a_model_without_byte_weights_gives_no_bound():
    assert TokenBound(None).at_least("x" * 10_000) == 0
