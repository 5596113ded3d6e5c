"""Processes sharing one disk tier directory (replicas on one machine; kvcache/snapshots/, module
doc): writing, reading and trimming at once, they keep the directory within its byte limit,
never restore a state for other tokens and never read half a file; a process that only reads
holds its limit too."""
from __future__ import annotations

import hashlib
import logging
import multiprocessing
import queue
import random
import struct
import time
from pathlib import Path

from kvcache import PrefixStore, block_hashes
from kvcache.snapshots import files as snapshot_files

BS = 4
IDENTITY = {"model": "m", "kv_type": "f16"}
LIMIT = 8_000            # the writers' byte limit for the directory
READER_LIMIT = 3_000     # the reading process's, smaller
OPS = 250                # puts and lookups of each writer (half each)


def tokens_of(i: int) -> list[int]:
    """Prompt i of a pool whose prompts share heads (so longer snapshots replace shorter ones)."""
    rng = random.Random(i % 7)
    head = [rng.randrange(1000) for _ in range(8)]
    rng = random.Random(i)
    return head + [rng.randrange(1000) for _ in range(BS * rng.randrange(1, 5))]


def state_of(tokens) -> bytes:
    """The state put for these tokens: they themselves, then filler, 100 to 700 bytes in all, so
    a restore says which tokens it was put for."""
    digest = hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).digest()
    n = 100 + int.from_bytes(digest[:2], "little") % 600
    body = struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    return body + (digest * (n // len(digest) + 1))[:max(0, n - len(body))]


def put_for(data: bytes) -> tuple[int, ...]:
    (n,) = struct.unpack_from("<I", data)
    return struct.unpack_from(f"<{n}I", data, 4)


def dir_bytes(directory: Path) -> int:
    """Bytes of snapshot files, counted holding the directory's lock (between two writers'
    renames and trims)."""
    with snapshot_files.dir_lock(directory):
        total = 0
        for path in directory.glob("*/*.kv"):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def work(role: str, seed: int, directory: str, ops: int, start, writers_done,
         results) -> None:
    """One process: `ops` random puts and lookups (a reader only looks up, then goes on until
    the writers are done). Every restore is checked against the tokens looked up."""
    warnings = Warnings()
    logging.getLogger("pagedllama.kvcache").addHandler(warnings)
    rng = random.Random(seed)
    directory_path = Path(directory)
    limit = READER_LIMIT if role == "reader" else LIMIT
    store = PrefixStore(ram_limit=0, disk_dir=directory_path, disk_limit=limit, min_tokens=BS)
    space = store.space(IDENTITY, BS, whole_only=False)
    out = {"role": role, "puts": 0, "lookups": 0, "restores": 0, "wrong": [], "max_bytes": 0}
    start.wait(timeout=60)   # all at once

    def look(tokens):
        out["lookups"] += 1
        space.refresh()   # as the engine does before it plans
        found = space.find(block_hashes(tokens, BS), tokens, len(tokens))
        if found is None:
            return
        snap, n = found
        restore = space.fetch(snap, n)
        if restore is None:
            return
        out["restores"] += 1
        data = bytes(restore.data)
        if data != state_of(put_for(data)) or list(put_for(data)[:n]) != tokens[:n] \
                or restore.n_tokens != n:
            out["wrong"].append((tokens, n, put_for(data)))

    i = 0
    while i < ops or (role == "reader" and not writers_done.is_set()):
        i += 1
        tokens = tokens_of(rng.randrange(40))
        if role == "writer" and rng.random() < 0.5:
            space.put(tokens, state_of(tokens))
            out["puts"] += 1
            if rng.random() < 0.5:
                store.flush()
        else:
            look(tokens)
        if i % 10 == 0:
            out["max_bytes"] = max(out["max_bytes"], dir_bytes(directory_path))
    store.flush()
    if role == "reader":   # the writers are done: a last lookup sees their last files
        look(tokens_of(0))
        store.flush()
        out["end_bytes"] = dir_bytes(directory_path)
    store.close()
    out["bad"] = store.counts["disk"].bad
    out["warnings"] = warnings.lines
    results.put(out)


def test_processes_sharing_a_directory_hold_its_limit_and_restore_only_what_was_put(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    roles = ["writer", "writer", "writer", "reader"]
    start, writers_done, results = ctx.Barrier(len(roles)), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=work, args=(role, seed, str(tmp_path), OPS, start,
                                            writers_done, results))
             for seed, role in enumerate(roles)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    outs: list[dict] = []
    try:
        while len(outs) < len(roles):
            if len(outs) == len(roles) - 1:
                writers_done.set()
            try:
                outs.append(results.get(timeout=0.5))
            except queue.Empty:
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a process failed"
                assert time.monotonic() - t0 < 60, "stuck"
    finally:
        writers_done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert sum(o["puts"] for o in outs) > 300 and sum(o["restores"] for o in outs) > 100, outs
    for o in outs:
        assert o["wrong"] == [], o["wrong"]           # no state restored for other tokens
        assert o["bad"] == 0 and o["warnings"] == [], o["warnings"]   # no half file read
        assert o["max_bytes"] <= LIMIT, o
    reader = next(o for o in outs if o["role"] == "reader")
    assert reader["restores"] > 0
    assert reader["end_bytes"] <= READER_LIMIT        # a reader trims to its own limit
    assert dir_bytes(tmp_path) <= READER_LIMIT
    assert time.monotonic() - t0 < 30


def put_files(directory: Path, n: int) -> list[list[int]]:
    s = PrefixStore(ram_limit=0, disk_dir=directory, disk_limit=1 << 20, min_tokens=BS)
    space = s.space(IDENTITY, BS, whole_only=False)
    token_lists = [[1000 + i] * 8 for i in range(n)]
    for tokens in token_lists:
        space.put(tokens, state_of(tokens))
        s.flush()
        time.sleep(0.01)      # distinct file times: the oldest go first
    s.close()
    return token_lists


def test_a_process_that_only_reads_trims_the_directory_to_its_limit(tmp_path):
    reader = PrefixStore(ram_limit=0, disk_dir=tmp_path, disk_limit=READER_LIMIT, min_tokens=BS)
    space = reader.space(IDENTITY, BS, whole_only=False)
    token_lists = put_files(tmp_path, 12)      # another process writes, within its own limit
    assert dir_bytes(tmp_path) > READER_LIMIT
    last = token_lists[-1]
    space.refresh()                                               # sees the new files
    found = space.find(block_hashes(last, BS), last, len(last))
    reader.flush()
    assert dir_bytes(tmp_path) <= READER_LIMIT
    assert found is not None and bytes(space.fetch(*found).data) == state_of(last)
    first = token_lists[0]
    assert space.find(block_hashes(first, BS), first, len(first)) is None   # trimmed away
    reader.close()


def test_a_process_started_on_a_directory_over_its_limit_trims_it(tmp_path):
    put_files(tmp_path, 12)
    reader = PrefixStore(ram_limit=0, disk_dir=tmp_path, disk_limit=READER_LIMIT, min_tokens=BS)
    reader.flush()
    assert dir_bytes(tmp_path) <= READER_LIMIT and reader.disk_bytes <= READER_LIMIT
    reader.close()
