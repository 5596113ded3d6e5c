"""Helpers for tests that drive a real Worker in-process."""
import asyncio
import functools
import struct
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


_STATE_MAGIC = 0xAF143CD8   # llama.cpp's sequence-state magic (llama-context.cpp: io_magic)


def kv_positions(context, seq_id: int) -> list[int]:
    """The position of every KV cell llama.cpp holds for `seq_id`, sorted (one entry per cell:
    a position held twice shows twice), read from the cell list in its sequence state
    (llama_state_seq_get_data; llama-kv-cache.cpp's state_write): the magic and the seq id,
    the stream count, then per stream its cell count and, if any, each cell's position and seq
    ids, then the cells' K and V rows, skipped here. The whole state must be read to its end,
    so a layout this does not expect fails the test rather than giving wrong positions. (A
    model whose cells carry more, M-RoPE's or per-layer embeddings', is not read.)"""
    data = bytes(context.state_bytes(seq_id))
    at = 0

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    magic, owner = take("Ii")
    assert (magic, owner) == (_STATE_MAGIC, seq_id), (hex(magic), owner)
    positions = []
    for _ in range(take("I")):
        cells = take("I")
        if not cells:
            continue
        for _ in range(cells):
            pos, n_ids = take("iI")
            ids = [take("i") for _ in range(n_ids)]
            assert ids == [seq_id], (pos, ids)
            positions.append(pos)
        v_trans, n_layer = take("II")
        for _ in range(n_layer):   # K: a type, a row size, a row per cell
            _, row = take("iQ")
            at += cells * row
        for _ in range(n_layer):   # V: the same, or transposed: an element size and a width
            if v_trans:
                _, size, width = take("iII")
                at += cells * size * width
            else:
                _, row = take("iQ")
                at += cells * row
    assert at == len(data), (at, len(data))
    return sorted(positions)


def assert_books_match_kv(worker) -> dict[int, tuple[int, int]]:
    """An idle worker's block manager is consistent, holds no sequence's blocks, and says which
    positions every llama.cpp seq id holds exactly as llama.cpp does, cell by cell (each
    position in one cell, none missing, none beyond); returns that view."""
    worker.manager.check_invariants()
    assert worker.manager.num_used_blocks == 0
    expected = expected_ranges(worker)
    for seq_id in range(worker.config.n_seq_max):
        lo, hi = expected.get(seq_id, (-1, -1))
        assert worker.context.seq_pos_range(seq_id) == (lo, hi), seq_id
        got = kv_positions(worker.context, seq_id)
        assert got == list(range(lo, hi + 1) if hi >= 0 else []), (seq_id, (lo, hi), _spans(got))
    return expected


def _spans(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as runs (first, last): what a failing comparison shows (a position
    held twice starts a run of its own)."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return [(a, b) for a, b in runs]
