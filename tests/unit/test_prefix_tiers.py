"""The prefix cache's RAM and disk tiers (kvcache/snapshots/) and the block manager's use of them,
with a fake KV cache whose cells record what was computed there: a restored prefix must hold
exactly the values its cold computation wrote."""
import errno
import logging
import random

import pytest

from kvcache import BlockManager, LoadOp, PrefixStore, SnapshotOp
from kvcache.snapshots import store as snapshot_store
from scheduler import Scheduler, Sequence, make_policy
from tests.fakes import FakeKV

BS = 4
IDENTITY = {"model": "m", "kv_type": "f16"}


def store(tmp_path=None, ram=1 << 20, disk=1 << 20, min_tokens=8):
    return PrefixStore(ram_limit=ram, disk_dir=tmp_path, disk_limit=disk, min_tokens=min_tokens)


def make(space, seq_ids=2, num_blocks=64):
    manager = BlockManager(num_blocks, block_size=BS, num_seq_ids=seq_ids, prefill_chunk=BS,
                           share_cells=False, tiers=space)
    return manager, FakeKV(num_blocks * BS * seq_ids, tiers=space)


def run(manager, kv, tokens):
    """Open, compute what is not cached, check the cells, free. Returns (cached, tier)."""
    alloc = manager.open(tokens, len(tokens) - 2, len(tokens) + 1)
    assert alloc is not None
    cached, tier = alloc.num_cached, alloc.tier
    kv.apply(manager.take_ops())
    assert manager.ensure(alloc, len(tokens))
    kv.apply(manager.take_ops())
    for pos in range(cached, len(tokens)):
        kv.write(alloc.seq_id, pos, tuple(tokens[:pos + 1]))
    assert kv.read(alloc.seq_id) == [tuple(tokens[:p + 1]) for p in range(len(tokens))]
    manager.commit(alloc, tokens, len(tokens))
    manager.free(alloc)
    kv.apply(manager.take_ops())
    manager.check_invariants()
    return cached, tier


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_prefix_evicted_from_the_streams_comes_back_from_ram():
    space = store().space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space, seq_ids=2)
    a, b, c = prompt(1, 40), prompt(2, 40), prompt(3, 40)
    assert run(manager, kv, a) == (0, "kv")
    run(manager, kv, b)
    run(manager, kv, c)     # two seq ids: a's holder is gone from the streams
    assert manager.lookup(a) == 0
    cached, tier = run(manager, kv, a + [7, 7, 7])
    assert (cached, tier) == (40, "ram")
    assert space.store.counts["ram"].hits == 1


def test_short_chains_and_preempted_sequences_are_not_saved():
    space = store(min_tokens=32).space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space)
    alloc = manager.open(prompt(1, 20), 18, 21)
    kv.apply(manager.take_ops())
    manager.free(alloc)
    assert not any(isinstance(op, SnapshotOp) for op in manager.take_snapshots())
    tokens = prompt(2, 40)
    alloc = manager.open(tokens, 38, 41)
    manager.ensure(alloc, 40)
    manager.commit(alloc, tokens, 40)
    manager.free(alloc, snapshot=False)
    assert not any(isinstance(op, SnapshotOp) for op in manager.take_snapshots())


def test_a_holder_is_saved_when_idle_or_before_its_cells_change():
    space = store().space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space, seq_ids=1)
    a = prompt(1, 40)
    run(manager, kv, a)            # ends: not saved on the step it ended in
    assert manager.unsaved and not space.snapshots()
    alloc = manager.open(prompt(2, 40), 38, 41)   # needs the only seq id: saved first
    ops = manager.take_ops()
    kinds = [type(op).__name__ for op in ops]
    assert kinds.index("SnapshotOp") < kinds.index("RemoveOp")
    kv.apply(ops)
    assert len(space.snapshots()) == 1 and not manager.unsaved
    manager.free(alloc)
    kv.apply(manager.take_ops())
    assert not manager.unsaved          # it computed nothing: nothing to save
    b = prompt(3, 40)
    run(manager, kv, b)
    assert manager.unsaved
    kv.apply(manager.take_snapshots())   # nothing else to do: saved now
    assert not manager.unsaved and len(space.snapshots()) == 2


def test_a_small_gain_over_the_streams_loads_nothing():
    space = store().space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space, seq_ids=4, num_blocks=256)
    a = prompt(1, 400)
    run(manager, kv, a)
    alloc = manager.open(a + [1, 2], 400, 403)   # the streams hold all of it: no load
    assert alloc.tier == "kv" and alloc.num_cached == 400
    assert not any(isinstance(op, LoadOp) for op in manager.take_ops())


def on_disk_only(tmp_path, tokens):
    """A manager (3 seq ids) and its fake KV after `tokens` ran, were saved, reached the disk
    and left the streams and RAM: only the disk holds them."""
    s = store(tmp_path, ram=0)
    space = s.space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space, seq_ids=3)
    run(manager, kv, tokens)
    kv.apply(manager.take_snapshots())
    s.flush()
    while manager.ids.evict_oldest():
        pass
    kv.apply(manager.take_ops())
    return s, manager, kv


def damage_the_file(tmp_path):
    (path,) = tmp_path.glob("*/*.kv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def test_a_state_that_cannot_be_read_when_its_load_is_applied_is_unloaded(tmp_path):
    """Planning reads no file: a disk hit's state is read as its LoadOp is applied. A file
    damaged in between sends back the sequence loading it and one that shared its blocks in
    the same step: the blocks leave the cache, the counts are taken back, and opened again,
    the prompt is computed."""
    a = prompt(1, 40)
    s, manager, kv = on_disk_only(tmp_path, a)
    counts = (manager.query_tokens, manager.hit_tokens)
    first = manager.open(a + [7, 7, 7], 40, 44)
    second = manager.open(a + [8, 8, 8], 40, 44)   # shares the blocks the first loads
    assert (first.num_cached, first.tier, second.num_cached) == (40, "disk", 40)
    damage_the_file(tmp_path)
    assert kv.apply(manager.take_ops()) == [first.seq_id]
    assert manager.unload([first.seq_id]) == {first.seq_id, second.seq_id}
    manager.free(first, snapshot=False)
    manager.free(second, snapshot=False)
    kv.apply(manager.take_ops())
    manager.check_invariants()
    assert manager.lookup(a) == 0 and (manager.query_tokens, manager.hit_tokens) == counts
    assert kv.used_cells == 0 and s.counts["disk"].bad == 1
    assert run(manager, kv, a + [7, 7, 7]) == (0, "kv")


def test_a_sequence_whose_state_cannot_be_read_is_planned_again(tmp_path):
    """The scheduler's side, as the worker calls it (Scheduler.reopen): the sequence leaves the
    step's plan and waits; the next step opens it from the streams and computes its prompt."""
    a = prompt(1, 40)
    _, manager, kv = on_disk_only(tmp_path, a)
    sched = Scheduler(manager, make_policy("fifo"), max_seqs=2, max_batch_tokens=64)
    seq = Sequence(a + [7, 7, 7], 2, 0, None)
    sched.add(seq)
    plan = sched.schedule()
    assert (seq.cached_tier, seq.num_computed) == ("disk", 40) and plan.chunks
    damage_the_file(tmp_path)
    unread = kv.apply(plan.ops)
    assert unread == [seq.seq_id]
    sched.reopen(unread, plan)
    kv.apply(manager.take_ops())
    manager.check_invariants()
    assert not plan.chunks and seq.alloc is None and seq in sched.waiting
    plan = sched.schedule()
    assert kv.apply(plan.ops) == []
    assert (seq.cached_tier, seq.num_cached_tokens, plan.chunks[0].start) == ("kv", 0, 0)


def test_a_longer_snapshot_replaces_the_ones_it_continues():
    s = store()
    space = s.space(IDENTITY, BS, whole_only=False)
    first = prompt(1, 16)
    space.put(first, b"x" * 10)
    space.put(first + prompt(2, 8), b"y" * 20)
    assert len(s.ram) == 1 and s.ram_bytes == 20
    found = space.find(space_hashes(first + [5] * 4), first + [5] * 4, 100)
    assert found is not None and found[1] == 16 and found[0].n_tokens == 24


def space_hashes(tokens):
    from kvcache import block_hashes
    return block_hashes(tokens, BS)


def test_a_sliding_window_snapshot_is_used_whole_or_not_at_all():
    s = store()
    space = s.space(IDENTITY, BS, whole_only=True)
    tokens = prompt(1, 24)
    space.put(tokens, b"z" * 8)
    assert space.find(space_hashes(tokens[:20] + [9] * 8), tokens[:20] + [9] * 8, 100) is None
    longer = tokens + [3] * 8
    assert space.find(space_hashes(longer), longer, 100)[1] == 24
    assert space.find(space_hashes(longer), longer, 20) is None    # within max_reuse only


def test_the_ram_tier_keeps_the_most_recently_used_within_its_limit():
    s = store(ram=100)
    space = s.space(IDENTITY, BS, whole_only=False)
    a, b, c = prompt(1, 8), prompt(2, 8), prompt(3, 8)
    space.put(a, b"a" * 40)
    space.put(b, b"b" * 40)
    space.fetch(space.find(space_hashes(a), a, 8)[0], 8)   # a is used again
    space.put(c, b"c" * 40)
    assert s.ram_bytes == 80
    assert space.find(space_hashes(b), b, 8) is None
    assert space.find(space_hashes(a), a, 8) is not None
    assert s.shrink(0) == 80 and space.find(space_hashes(a), a, 8) is None


def test_snapshots_on_disk_outlive_the_process_and_are_checked(tmp_path, caplog):
    s1 = store(tmp_path)
    a, b = prompt(1, 16), prompt(2, 16)
    space1 = s1.space(IDENTITY, BS, whole_only=False)
    space1.put(a, b"A" * 64)
    space1.put(b, b"B" * 64)
    s1.close()
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) == 2
    # a new process: found on disk, read, checked, kept in RAM
    s2 = store(tmp_path)
    space2 = s2.space(IDENTITY, BS, whole_only=False)
    snap, n = space2.find(space_hashes(a), a, 16)
    restore = space2.fetch(snap, n)
    assert restore.tier == "disk" and bytes(restore.data) == b"A" * 64
    assert space2.fetch(snap, n).tier == "ram"
    # one flipped byte: skipped with a log line, deleted, not found again
    path = next(p for p in files if b"B" * 64 in p.read_bytes())
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1     # the state's last byte (the file's checksum follows)
    path.write_bytes(bytes(raw))
    snap, n = space2.find(space_hashes(b), b, 16)
    with caplog.at_level(logging.WARNING, "pagedllama.kvcache"):
        assert space2.fetch(snap, n) is None
    assert "checksum mismatch" in caplog.text and not path.exists()
    assert space2.find(space_hashes(b), b, 16) is None
    assert s2.counts["disk"].bad == 1
    # other numbers (another model, build or setting) never match
    s3 = store(tmp_path)
    assert s3.space({**IDENTITY, "kv_type": "q8_0"}, BS, False).find(
        space_hashes(a), a, 16) is None


def test_a_truncated_file_is_skipped(tmp_path, caplog):
    s1 = store(tmp_path)
    a = prompt(1, 16)
    s1.space(IDENTITY, BS, whole_only=False).put(a, b"A" * 64)
    s1.close()
    path = next(tmp_path.glob("*/*.kv"))
    path.write_bytes(path.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, "pagedllama.kvcache"):
        s2 = store(tmp_path)
        space = s2.space(IDENTITY, BS, whole_only=False)   # its length is checked on the scan
        assert space.find(space_hashes(a), a, 16) is None
    assert "truncated" in caplog.text and not path.exists() and s2.counts["disk"].bad == 1


def test_two_processes_share_a_directory(tmp_path):
    s1, s2 = store(tmp_path), store(tmp_path)
    sp1, sp2 = s1.space(IDENTITY, BS, False), s2.space(IDENTITY, BS, False)
    a = prompt(1, 16)
    sp1.put(a, b"A" * 64)
    s1.flush()
    sp2.refresh()                                # written by the other one since it started
    found = sp2.find(space_hashes(a), a, 16)
    assert found is not None and bytes(sp2.fetch(*found).data) == b"A" * 64


def test_the_disk_tier_keeps_to_its_byte_limit(tmp_path):
    s = store(tmp_path, ram=0, disk=600)
    space = s.space(IDENTITY, BS, False)
    for i in range(6):
        space.put(prompt(i, 16), bytes(200))
        s.flush()
    assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kv")) <= 600
    assert s.disk_bytes <= 600
    assert space.find(space_hashes(prompt(5, 16)), prompt(5, 16), 16) is not None
    assert space.find(space_hashes(prompt(0, 16)), prompt(0, 16), 16) is None


def test_a_failing_disk_turns_writing_off_and_requests_go_on(tmp_path, monkeypatch, caplog):
    s = store(tmp_path)
    space = s.space(IDENTITY, BS, False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(snapshot_store, "write_temp", full)
    with caplog.at_level(logging.WARNING, "pagedllama.kvcache"):
        space.put(prompt(1, 16), b"A" * 64)
        s.flush()
    assert not s.disk_writable and "No space left" in s.disk_note
    assert "stops writing" in caplog.text
    space.put(prompt(2, 16), b"B" * 64)     # still kept in RAM
    assert space.find(space_hashes(prompt(2, 16)), prompt(2, 16), 16)[0].data == b"B" * 64


def test_a_directory_that_cannot_be_written_is_read_only(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    s = store(blocker / "cache")
    assert not s.disk_writable and s.disk_note.startswith("read-only")
    s.space(IDENTITY, BS, False).put(prompt(1, 16), b"A" * 64)   # RAM only, no error


@pytest.mark.parametrize("seed", range(3))
def test_many_sessions_through_few_seq_ids_read_only_what_was_computed(seed, tmp_path):
    """Random agent-like sessions (a shared head, growing histories) through 3 seq ids with a
    tight RAM tier and a disk: every sequence's cells hold exactly its cold values (run checks
    them), whichever tier they came from."""
    rng = random.Random(seed)
    s = store(tmp_path, ram=4000, disk=20000, min_tokens=12)
    space = s.space(IDENTITY, BS, whole_only=False)
    manager, kv = make(space, seq_ids=3, num_blocks=96)
    head = prompt(99, 13)
    histories = {i: head + prompt(i, rng.randrange(2, 9)) for i in range(6)}
    tiers = set()
    for _ in range(40):
        i = rng.randrange(6)
        tokens = histories[i] + prompt(rng.random(), rng.randrange(1, 6))
        if len(tokens) > 90:
            tokens = head + prompt(rng.random(), 5)
        histories[i] = tokens
        s.flush()
        tiers.add(run(manager, kv, tokens)[1])
    assert "kv" in tiers and tiers & {"ram", "disk"}
