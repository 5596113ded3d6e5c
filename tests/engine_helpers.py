"""Helpers for tests that drive a real Worker in-process."""
import asyncio


def idle(worker) -> None:
    """Wait until the worker has nothing to do (its inbox empty, no sequence left)."""
    async def wait():
        for _ in range(400):
            if not worker.scheduler.has_work() and not worker.inbox:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("worker did not go idle")
    asyncio.run(wait())
