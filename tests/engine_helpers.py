"""Helpers for tests that drive a real Worker in-process."""
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


def on_a_thread_of_its_own(compute):
    """compute() on a thread that ends after it. llama.cpp's threads are OpenMP's: each thread
    that computes with 2+ threads keeps a team of them until it ends, and libgomp, once it
    manages more threads than there are cores, makes every team wait for work by sleeping
    instead of spinning, so every later step of this process (every worker) is ~1.5 times
    slower. Workers end their threads when they stop; the tests' own thread must not compute."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(compute).result()


def computes_on_a_thread_of_its_own(test):
    """A test that computes with llama.cpp contexts of its own, run on_a_thread_of_its_own."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return on_a_thread_of_its_own(lambda: test(*args, **kwargs))
    return run


def idle(worker) -> None:
    """Wait until the worker has nothing to do (its inbox empty, no sequence left) and sleeps:
    the KV ops of what ended are applied (a worker that just took a cancel from its inbox has
    no work left but has not applied them yet)."""
    async def wait():
        for _ in range(400):
            if worker.sleeping and not worker.scheduler.has_work() and not worker.inbox:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("worker did not go idle")
    asyncio.run(wait())


def expected_ranges(worker) -> dict[int, tuple[int, int]]:
    """The manager's view: which positions each llama.cpp seq id holds."""
    bs, ranges = worker.manager.block_size, {}
    for seq in worker.scheduler.running:
        ranges[seq.seq_id] = (0, seq.num_computed - 1)
    for block in worker.manager.cache.values():
        if block.owner not in ranges or block.owner not in worker.manager.live:
            lo, hi = ranges.get(block.owner, (0, -1))
            ranges[block.owner] = (0, max(hi, (block.index + 1) * bs - 1))
    return ranges


def assert_books_match_kv(worker) -> dict[int, tuple[int, int]]:
    """An idle worker's block manager is consistent, holds no sequence's blocks, and says which
    positions every llama.cpp seq id holds exactly as llama.cpp does; returns that view."""
    worker.manager.check_invariants()
    assert worker.manager.num_used_blocks == 0
    expected = expected_ranges(worker)
    for seq_id in range(worker.config.n_seq_max):
        got = worker.context.seq_pos_range(seq_id)
        assert got == expected.get(seq_id, (-1, -1)), (seq_id, got, expected.get(seq_id))
    return expected
