"""BlockManager behaviour, checked against a fake unified KV cache that applies its ops."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import BlockManager, CopyOp, RemoveOp
from kvcache.seq_ids import TAIL_CELLS_PER_TOKEN
from tests.fakes import FakeKV

BS = 4


def make(num_blocks=16, seq_ids=8, caching=True, prefill_chunk=BS, share_cells=True,
         stream_cells=0):
    streams = 1 if share_cells else seq_ids     # split KV: cells of their own for each seq id
    return (BlockManager(num_blocks, block_size=BS, num_seq_ids=seq_ids, prefix_caching=caching,
                         prefill_chunk=prefill_chunk, share_cells=share_cells,
                         stream_cells=stream_cells),
            FakeKV(num_blocks * BS * streams))


def compute(manager, kv, alloc, tokens, start, end):
    """Apply pending ops, then 'decode' tokens[start:end] the way the engine would."""
    assert manager.ensure(alloc, end)
    kv.apply(manager.take_ops())
    for pos in range(start, end):
        kv.write(alloc.seq_id, pos, tuple(tokens[:pos + 1]))
    manager.commit(alloc, tokens, end)
    kv.apply(manager.take_ops())


def finished(manager, kv, tokens):
    """A sequence of `tokens`, computed and ended (its cached blocks held), its ops applied."""
    alloc = manager.open(tokens, len(tokens) - 1, len(tokens) + 1)
    compute(manager, kv, alloc, tokens, 0, len(tokens))
    manager.free(alloc)
    kv.apply(manager.take_ops())
    return alloc


def swapped(manager, kv, alloc, tokens, max_tokens):
    """Preemption by swap: a sequence's state saved, the sequence freed and its state restored
    in a new one (None where that does not fit), the ops applied. Returns it and the key."""
    key = manager.save(alloc)
    manager.free(alloc)
    kv.apply(manager.take_ops())
    restored = manager.open_for_restore(key, tokens, max_tokens)
    kv.apply(manager.take_ops())
    return restored, key


def test_fresh_sequence_gets_no_cached_tokens():
    manager, kv = make()
    alloc = manager.open(list(range(10)), 9, 11)
    assert alloc.num_cached == 0 and manager.take_ops() == []


def test_second_sequence_reuses_full_blocks_of_the_first():
    manager, kv = make()
    tokens = list(range(10))
    a = manager.open(tokens, 9, 11)
    compute(manager, kv, a, tokens, 0, 10)
    b = manager.open(tokens, 9, 11)
    assert b.num_cached == 8
    assert manager.take_ops() == [CopyOp(a.seq_id, b.seq_id, 0, 8)]


def test_last_prompt_token_is_always_recomputed():
    manager, kv = make()
    tokens = list(range(8))
    a = manager.open(tokens, 7, 9)
    compute(manager, kv, a, tokens, 0, 8)
    b = manager.open(tokens, 7, 9)
    assert b.num_cached == 7      # block 0 shared, 3 tokens of block 1 copied: never the last


def test_a_hit_may_end_inside_a_block_copying_the_cells_from_the_block_that_continues_it():
    manager, kv = make(num_blocks=32, prefill_chunk=2 * BS)
    a_tokens = list(range(16))
    a = manager.open(a_tokens, 15, 17)
    compute(manager, kv, a, a_tokens, 0, 16)
    b_tokens = list(range(6)) + [99] * 8          # shares 6 tokens: block 0 and 2 of block 1
    b = manager.open(b_tokens, 13, 15)
    assert b.num_cached == 6
    ops = manager.take_ops()
    assert ops == [CopyOp(a.seq_id, b.seq_id, 0, 6)]
    kv.apply(ops)
    assert [blk.hash is not None for blk in b.blocks] == [True, False]   # partial: b's own
    compute(manager, kv, b, b_tokens, 6, 14)
    assert kv.read(b.seq_id) == [tuple(b_tokens[:p + 1]) for p in range(14)]
    manager.check_invariants()


def test_of_several_cached_continuations_the_longest_is_copied():
    manager, kv = make(num_blocks=48)
    allocs = []
    for tail in ([4, 50, 51, 52], [4, 5, 60, 61], [70, 71, 72, 73]):
        tokens = [0, 1, 2, 3] + tail + [9, 9]
        allocs.append(manager.open(tokens, 9, 11))
        compute(manager, kv, allocs[-1], tokens, 0, 10)
    c = manager.open([0, 1, 2, 3, 4, 5, 6, 7, 8, 8], 8, 11)
    assert c.num_cached == 6
    assert manager.take_ops() == [CopyOp(allocs[1].seq_id, c.seq_id, 0, 6)]


def test_a_partial_hit_never_leaves_a_single_token_before_a_grid_line():
    manager, kv = make(num_blocks=32, prefill_chunk=2 * BS)
    a_tokens = list(range(16))
    a = manager.open(a_tokens, 15, 17)
    compute(manager, kv, a, a_tokens, 0, 16)
    # 7 shared tokens would leave [7, 8) as a piece of one token: the hit stops at 6
    assert manager.open(list(range(7)) + [99] * 8, 13, 16).num_cached == 6


def test_a_block_differing_in_one_token_is_a_partial_hit():
    manager, kv = make()
    a_tokens = list(range(10))
    a = manager.open(a_tokens, 9, 11)
    compute(manager, kv, a, a_tokens, 0, 10)
    b_tokens = [0, 1, 2, 99] + list(range(4, 10))
    assert manager.open(b_tokens, 9, 11).num_cached == 2   # not 3: [3, 4) would be a 1-token piece


def test_finished_sequence_stays_cached_as_holder():
    manager, kv = make()
    tokens = list(range(10))
    finished(manager, kv, tokens)
    assert manager.num_cached_blocks == 2 and manager.num_used_blocks == 0
    assert kv.used_cells == 8   # the partial tail block was removed, the full ones kept
    b = manager.open(tokens, 9, 11)
    kv.apply(manager.take_ops())
    assert b.num_cached == 8 and kv.read(b.seq_id) == [tuple(tokens[:p + 1]) for p in range(8)]


def test_eviction_takes_tail_blocks_first_and_releases_the_holder():
    manager, kv = make(num_blocks=4, seq_ids=2)
    tokens = list(range(12))
    a = finished(manager, kv, tokens)
    other = list(range(100, 108))
    b = manager.open(other, 7, 9)
    compute(manager, kv, b, other, 0, 8)     # needs 2 blocks: 1 free + 1 evicted (the tail)
    assert manager.lookup(tokens) == 8
    c = manager.open(list(range(200, 204)), 3, 5)   # evicts until the seq id of a is released
    assert c is not None and manager.lookup(tokens) == 0
    kv.apply(manager.take_ops())
    assert a.seq_id not in kv.seqs or not kv.seqs[a.seq_id]
    manager.check_invariants()


def test_a_parent_becomes_evictable_in_lru_order_after_its_last_child():
    """P (head) is released after x and before z, its child before both: once the child is
    evicted, P goes after x and before z."""
    manager, kv = make()
    head, x_tokens, z_tokens = [1, 2, 3, 4], list(range(100, 105)), list(range(200, 205))
    a_tokens, b_tokens = head + [5, 6], head + [7, 8, 9, 10, 11]
    a = manager.open(a_tokens, 5, 7)
    compute(manager, kv, a, a_tokens, 0, 6)          # caches P (A's tail stays partial)
    b = manager.open(b_tokens, 8, 10)
    compute(manager, kv, b, b_tokens, 4, 9)          # caches P's child
    x, z = manager.open(x_tokens, 4, 6), manager.open(z_tokens, 4, 6)
    compute(manager, kv, x, x_tokens, 0, 5)
    compute(manager, kv, z, z_tokens, 0, 5)
    for alloc in (b, x, a, z):                       # releases: P's child, x, P, z
        manager.free(alloc)
    kv.apply(manager.take_ops())
    manager.ids.evict_oldest()
    assert manager.lookup(b_tokens) == 4 and manager.lookup(x_tokens) == 4
    manager.ids.evict_oldest()
    assert manager.lookup(x_tokens) == 0 and manager.lookup(a_tokens) == 4
    manager.ids.evict_oldest()
    assert manager.lookup(a_tokens) == 0 and manager.lookup(z_tokens) == 4
    manager.check_invariants()


def test_a_chain_released_together_is_evicted_tail_to_head_before_newer_leaves():
    manager, kv = make()
    a_tokens, y_tokens = list(range(9)), list(range(100, 105))
    a = manager.open(a_tokens, 8, 10)
    compute(manager, kv, a, a_tokens, 0, 9)
    y = manager.open(y_tokens, 4, 6)
    compute(manager, kv, y, y_tokens, 0, 5)
    manager.free(a)
    manager.free(y)
    manager.ids.evict_oldest()
    manager.ids.evict_oldest()
    assert manager.lookup(a_tokens) == 0 and manager.lookup(y_tokens) == 4
    manager.check_invariants()


def test_caching_off_frees_everything():
    manager, kv = make(caching=False)
    tokens = list(range(10))
    finished(manager, kv, tokens)
    assert manager.num_free_blocks == manager.num_blocks and kv.used_cells == 0
    assert manager.open(tokens, 9, 11).num_cached == 0


def test_twin_block_computed_twice_is_deduplicated():
    manager, kv = make()
    tokens = list(range(8))
    a = manager.open(tokens, 7, 9)
    b = manager.open(tokens, 7, 9)
    compute(manager, kv, a, tokens, 0, 8)
    compute(manager, kv, b, tokens, 0, 8)
    assert a.blocks[0] is b.blocks[0] and a.blocks[0].ref_count == 2
    assert kv.used_cells == 8
    manager.check_invariants()


def test_open_fails_without_blocks_and_leaves_no_trace():
    manager, kv = make(num_blocks=2)
    assert manager.open(list(range(20)), 19, 21) is None
    assert manager.num_free_blocks == 2 and len(manager.ids.free_seq_ids) == 8
    assert manager.take_ops() == []


def test_a_saved_state_comes_back_in_a_new_sequence():
    manager, kv = make()
    tokens = list(range(6))
    a = manager.open(tokens, 5, 7)
    compute(manager, kv, a, tokens, 0, 6)
    b, _ = swapped(manager, kv, a, tokens, 7)
    assert kv.read(b.seq_id) == [tuple(tokens[:p + 1]) for p in range(6)] and kv.saved == {}


def test_a_dropped_saved_state_is_forgotten():
    manager, kv = make()
    a = manager.open(list(range(6)), 5, 7)
    compute(manager, kv, a, list(range(6)), 0, 6)
    key = manager.save(a)
    manager.free(a)
    manager.drop_saved(key)
    kv.apply(manager.take_ops())
    assert kv.saved == {}


def test_each_saved_state_gets_its_own_key():
    manager, kv = make()
    a, b = manager.open([1, 2], 1, 3), manager.open([3, 4], 1, 3)
    assert manager.save(a) != manager.save(b)


class ManagerMachine(RuleBasedStateMachine):
    """Random interleavings of open / compute / fork (shared prefix) / swap out and back in /
    grow into every free block / finish / evict."""
    share_cells = True
    stream_cells = 0

    def __init__(self):
        super().__init__()
        self.manager, self.kv = make(num_blocks=24, seq_ids=6, share_cells=self.share_cells,
                                     stream_cells=self.stream_cells)
        self.live = []   # (alloc, tokens, computed)

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 14), salt=st.integers(0, 2))
    def open(self, prefix, length, salt):
        tokens = [7, 8, 9, 10, 11, 12, 13, 14][:prefix * 2] + [salt * 50 + i for i in range(length)]
        alloc = self.manager.open(tokens, len(tokens) - 1, len(tokens) + 1)
        self.kv.apply(self.manager.take_ops())   # eviction may emit ops even when open fails
        if alloc is not None:
            assert self.kv.read(alloc.seq_id) == [tuple(tokens[:p + 1]) for p in range(alloc.num_cached)]
            self.live.append([alloc, tokens, alloc.num_cached])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), n=st.integers(1, 6))
    def compute_some(self, i, n):
        entry = self.live[i % len(self.live)]
        alloc, tokens, done = entry
        if done >= len(tokens):
            tokens.append(1000 + len(tokens))   # a generated token
        end = min(len(tokens), done + n)
        if not self.manager.ensure(alloc, end):
            return
        compute(self.manager, self.kv, alloc, tokens, done, end)
        entry[2] = end

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), n_draft=st.integers(1, 9), n_accepted=st.integers(0, 9))
    def verify_a_draft(self, i, n_draft, n_accepted):
        """Speculative decoding: the pending tokens and n_draft drafted ones are computed in
        one piece; the first n_accepted drafted tokens are accepted with the model's own next
        token after them, and the rest leave the KV (rollback). Only verified tokens are
        committed to the prefix cache."""
        entry = self.live[i % len(self.live)]
        alloc, tokens, done = entry
        if done >= len(tokens):
            tokens.append(1000 + len(tokens))   # the sampled token, not yet computed
        draft = [2000 + len(tokens) + p for p in range(n_draft)]
        guessed = tokens + draft
        if not self.manager.ensure(alloc, len(guessed)):
            return
        self.kv.apply(self.manager.take_ops())
        for pos in range(done, len(guessed)):
            self.kv.write(alloc.seq_id, pos, tuple(guessed[:pos + 1]))
        self.manager.commit(alloc, tokens, len(tokens))   # the pending tokens are verified
        tokens += draft[:min(n_accepted, n_draft)]
        verified = len(tokens)
        tokens.append(3000 + verified)                    # the model's token after them
        self.manager.rollback(alloc, verified)
        self.manager.commit(alloc, tokens, verified)
        self.kv.apply(self.manager.take_ops())
        entry[2] = verified

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def ride_on_the_cache(self, i):
        """Take blocks another sequence computed since this one opened (in-flight sharing)."""
        entry = self.live[i % len(self.live)]
        alloc, tokens, done = entry
        gained = self.manager.extend(alloc, tokens, done, len(tokens) - 1)
        self.kv.apply(self.manager.take_ops())
        entry[2] = done + gained

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def swap_out_and_back_in(self, i):
        """Preemption by swap: save the state, free the sequence, restore it in a new one."""
        entry = self.live[i % len(self.live)]
        alloc, tokens, done = entry
        restored, key = swapped(self.manager, self.kv, alloc, tokens[:done], len(tokens) + 1)
        if restored is None:
            self.manager.drop_saved(key)
            self.kv.apply(self.manager.take_ops())
            self.live.remove(entry)
        else:
            entry[0] = restored

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def grow_into_every_free_block(self, i):
        """Whatever num_free_blocks counts, a sequence can get (evicting as it must)."""
        alloc = self.live[i % len(self.live)][0]
        assert self.manager.ensure(alloc, (len(alloc.blocks) + self.manager.num_free_blocks) * BS)
        assert self.manager.num_free_blocks == 0
        self.kv.apply(self.manager.take_ops())

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        alloc, _, _ = self.live.pop(i % len(self.live))
        self.manager.free(alloc)
        self.kv.apply(self.manager.take_ops())

    @rule()
    def evict(self):
        self.manager.ids.evict_oldest()
        self.kv.apply(self.manager.take_ops())

    @invariant()
    def books_balance(self):
        m = self.manager
        m.check_invariants()
        refs = {}
        for alloc, _, _ in self.live:
            for block in alloc.blocks:
                refs[block.id] = refs.get(block.id, 0) + 1
        assert all(b.ref_count == refs.get(b.id, 0) for b in m.pool.blocks)
        assert m.num_free_blocks + m.num_used_blocks == m.num_blocks
        if self.share_cells:   # (split KV streams have their own cells per seq id instead)
            assert self.kv.used_cells <= (m.num_blocks - len(m.free_list)) * BS

    @invariant()
    def every_evictable_block_can_be_evicted_now(self):
        """Only leaves are evicted: an evictable ancestor of a referenced block could not be,
        yet num_free_blocks would count it."""
        stuck = set()
        for block in self.manager.cache.values():
            parent = block.parent if block.ref_count else None
            while parent is not None:
                if not parent.ref_count:
                    stuck.add(parent.id)
                parent = parent.parent
        assert not stuck

    @invariant()
    def every_holder_keeps_the_cells_up_to_its_last_block_and_no_more(self):
        m, ends = self.manager, {}
        for block in m.cache.values():
            ends[block.owner] = max(ends.get(block.owner, 0), (block.index + 1) * BS)
        for seq_id in set(self.kv.seqs) - m.live:
            assert sorted(self.kv.seqs[seq_id]) == list(range(ends.get(seq_id, 0)))

    @invariant()
    def every_live_sequence_sees_its_own_tokens(self):
        for alloc, tokens, done in self.live:
            assert self.kv.read(alloc.seq_id) == [tuple(tokens[:p + 1]) for p in range(done)]


class SplitKVManagerMachine(ManagerMachine):
    """The same with split KV: no twin sharing, finished sequences move to high seq ids, and a
    prompt continuing a holder's chain but for a tail of up to 3 blocks runs on its seq id."""
    share_cells = False
    stream_cells = 3 * BS * TAIL_CELLS_PER_TOKEN


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSplitKVManagerMachine = SplitKVManagerMachine.TestCase
TestSplitKVManagerMachine.settings = TestManagerMachine.settings


def test_split_kv_twin_block_does_not_stop_caching_the_rest():
    manager, kv = make(share_cells=False, num_blocks=32)
    head = [1, 2, 3, 4]
    a_tokens, b_tokens = head + list(range(100, 120)), head + list(range(200, 220))
    a = manager.open(a_tokens, len(a_tokens) - 1, len(a_tokens) + 1)
    b = manager.open(b_tokens, len(b_tokens) - 1, len(b_tokens) + 1)
    assert b.num_cached == 0          # both compute the shared head block at once
    compute(manager, kv, a, a_tokens, 0, len(a_tokens))
    compute(manager, kv, b, b_tokens, 0, len(b_tokens))   # its head block meets its twin
    manager.free(b)
    kv.apply(manager.take_ops())
    again = manager.open(b_tokens, len(b_tokens) - 1, len(b_tokens) + 1)
    kv.apply(manager.take_ops())
    n = len(b_tokens) - 1             # all but the last token, which is computed for logits
    assert again.num_cached == n
    assert kv.read(again.seq_id) == [tuple(b_tokens[:p + 1]) for p in range(n)]
    manager.check_invariants()


def test_split_kv_holder_moves_to_the_highest_free_seq_id():
    manager, kv = make(seq_ids=4, share_cells=False)
    tokens = list(range(10))
    a = manager.open(tokens, 9, 11)
    compute(manager, kv, a, tokens, 0, 10)
    manager.free(a)
    assert manager.take_ops()[0] == CopyOp(a.seq_id, 3, 0, 8)
    assert manager.ids.owned == {3: 2}
    manager.open(list(range(100, 110)), 9, 11)               # live: 0
    assert manager.open(tokens, 9, 11).seq_id == 1           # 3 would leave a gap: a copy
    manager.check_invariants()


def test_split_kv_a_prompt_that_continues_a_holder_whole_runs_on_its_seq_id():
    """Nothing else live: the next turn of a conversation runs where its cells are, no copy."""
    manager, kv = make(seq_ids=4, share_cells=False)
    tokens = list(range(10))
    finished(manager, kv, tokens)
    longer = tokens + [50, 51, 52, 53, 54, 55]
    b = manager.open(longer, 14, 17)
    assert b.seq_id == 3 and b.num_cached == 8
    assert not any(isinstance(op, CopyOp) for op in manager.take_ops())
    compute(manager, kv, b, longer, 8, 16)
    assert kv.read(3) == [tuple(longer[:p + 1]) for p in range(16)]
    manager.check_invariants()


def test_split_kv_a_prompt_that_leaves_a_short_tail_of_a_holder_runs_on_its_seq_id():
    """The next turn renders the last answer's end to other tokens: the holder's chain but its
    last blocks. Where dropping them costs less than copying a stream, they are evicted and the
    prompt runs on the holder's seq id; otherwise the stream is copied and they stay cached."""
    tokens = list(range(14))                    # 3 full blocks (cached) and a partial one
    nxt = tokens[:8] + [60, 61, 62, 63, 64]     # continues 2 blocks, then differs: a tail of 1
    for stream_cells, adopted in ((BS * TAIL_CELLS_PER_TOKEN, True),
                                  (BS * TAIL_CELLS_PER_TOKEN - 1, False)):
        manager, kv = make(seq_ids=4, share_cells=False, stream_cells=stream_cells)
        finished(manager, kv, tokens)
        holder = next(iter(manager.ids.owned))
        b = manager.open(nxt, 12, 14)
        ops = manager.take_ops()
        kv.apply(ops)
        assert b.num_cached == 8
        assert (b.seq_id == holder) is adopted
        assert any(isinstance(op, CopyOp) for op in ops) is not adopted
        assert manager.lookup(tokens) == (8 if adopted else 12)   # the tail: dropped or kept
        compute(manager, kv, b, nxt, 8, 13)
        assert kv.read(b.seq_id) == [tuple(nxt[:p + 1]) for p in range(13)]
        manager.check_invariants()


def test_split_kv_a_tail_another_chain_continues_is_not_dropped():
    """A holder's tail block that another holder's chain goes on from stays: the prompt that
    leaves it takes the copy path."""
    manager, kv = make(num_blocks=32, seq_ids=4, share_cells=False,
                       stream_cells=8 * BS * TAIL_CELLS_PER_TOKEN)
    tokens = list(range(12))
    finished(manager, kv, tokens)
    longer = tokens + [70, 71, 72, 73, 74]      # continues the whole chain, from another id
    other = manager.open(list(range(500, 505)), 4, 6)
    b = manager.open(longer, 16, 18)
    compute(manager, kv, b, longer, b.num_cached, 17)
    manager.free(b)
    manager.free(other)
    kv.apply(manager.take_ops())
    nxt = tokens[:8] + [90, 91, 92]
    c = manager.open(nxt, 10, 12)
    kv.apply(manager.take_ops())
    assert c.num_cached == 8 and manager.lookup(longer) == 16
    compute(manager, kv, c, nxt, 8, 11)
    assert kv.read(c.seq_id) == [tuple(nxt[:p + 1]) for p in range(11)]
    manager.check_invariants()


def test_split_kv_live_seq_ids_stay_contiguous_when_a_holder_sits_in_the_gap():
    """Four seq ids, all taken (ids 0-2 live, 3 a holder): a sequence in the middle ends, its
    holder stays on id 1 (no higher id is free). The next sequence must run on id 1 beside 0
    and 2, not on the id eviction frees: the holder moves there, its prefix still hits."""
    manager, kv = make(num_blocks=32, seq_ids=4, share_cells=False)
    prompts = [[100 * k + i for i in range(10)] for k in range(4)]
    allocs = []
    for k in range(4):
        alloc = manager.open(prompts[k], 9, 11)
        compute(manager, kv, alloc, prompts[k], 0, 10)
        allocs.append(alloc)
    manager.free(allocs[3])                        # id 3 becomes a holder, ids 0-2 live
    kv.apply(manager.take_ops())
    manager.free(allocs[1])                        # id 1 ends; no free id above: stays a holder
    kv.apply(manager.take_ops())
    assert sorted(manager.live) == [0, 2] and set(manager.ids.owned) >= {1, 3}
    new = manager.open([7, 7, 7, 7, 7], 4, 6)      # no prefix hit; evicts a holder for an id
    kv.apply(manager.take_ops())
    assert new.seq_id == 1 and sorted(manager.live) == [0, 1, 2]
    manager.check_invariants()
    assert manager.ids.owned[3] == 2 and kv.read(3) == [tuple(prompts[1][:p + 1]) for p in range(8)]
    manager.free(new)
    again = manager.open(prompts[1], 9, 11)        # the moved holder's blocks still hit
    kv.apply(manager.take_ops())
    assert again.seq_id == 1 and again.num_cached == 8
    assert kv.read(1)[:8] == [tuple(prompts[1][:p + 1]) for p in range(8)]
    manager.check_invariants()


def test_split_kv_sequence_can_grow_into_every_block_counted_free():
    """B computes the head block A cached at the same time, and caches its next block below
    A's. Once A ends, everything counted free (the head included) must be B's to take."""
    manager, kv = make(num_blocks=5, seq_ids=4, prefill_chunk=2 * BS, share_cells=False)
    head = [1, 2, 3, 4]
    a_tokens, b_tokens = head + [10, 11, 12, 13, 14], head + [20, 21, 22, 23, 24]
    a, b = manager.open(a_tokens, 8, 10), manager.open(b_tokens, 8, 10)
    compute(manager, kv, a, a_tokens, 0, 8)
    compute(manager, kv, b, b_tokens, 0, 8)
    manager.free(a)
    kv.apply(manager.take_ops())
    assert manager.ensure(b, (len(b.blocks) + manager.num_free_blocks) * BS)
    manager.check_invariants()


def test_restored_split_kv_sequence_can_grow_into_every_block_counted_free():
    """A swapped-out sequence comes back over its own cached blocks and caches more below them."""
    manager, kv = make(num_blocks=8, share_cells=False)
    tokens = list(range(9))
    a = manager.open(tokens, 8, 10)
    compute(manager, kv, a, tokens, 0, 9)
    b, _ = swapped(manager, kv, a, tokens, 10)
    tokens += [100, 101, 102]
    compute(manager, kv, b, tokens, 9, 12)
    assert manager.ensure(b, (len(b.blocks) + manager.num_free_blocks) * BS)
    manager.check_invariants()


def test_evicting_a_chain_leaves_each_holder_the_cells_of_its_own_blocks_only():
    """H caches blocks 0 and 2 of a chain, X block 1 (which H computed too, and swapped for X's):
    once blocks 2 and 1 are evicted, H holds the cells of block 0 and nothing more."""
    manager, kv = make()
    tokens = list(range(13))
    h, x = manager.open(tokens, 12, 14), manager.open(tokens, 12, 14)
    compute(manager, kv, h, tokens, 0, 4)
    compute(manager, kv, x, tokens, 0, 8)
    compute(manager, kv, h, tokens, 4, 13)
    manager.free(x)
    manager.free(h)
    manager.ids.evict_oldest()
    manager.ids.evict_oldest()
    kv.apply(manager.take_ops())
    assert manager.num_cached_blocks == 1 and kv.used_cells == BS
    assert sorted(kv.seqs[h.seq_id]) == list(range(BS))


def test_a_rollback_removes_the_rejected_tokens_and_frees_their_blocks():
    manager, kv = make(num_blocks=8)
    tokens = list(range(6))
    a = manager.open(tokens, 5, 7)
    compute(manager, kv, a, tokens, 0, 6)
    tokens.append(50)                                  # sampled; 6 drafted tokens after it
    guessed = tokens + [60, 61, 62, 63, 64, 65]
    assert manager.ensure(a, len(guessed)) and len(a.blocks) == 4
    for pos in range(6, len(guessed)):
        kv.write(a.seq_id, pos, tuple(guessed[:pos + 1]))
    free = manager.num_free_blocks
    manager.rollback(a, 8)                             # 50 and 60 verified, 61 rejected
    assert manager.take_ops() == [RemoveOp(a.seq_id, 8)]
    kv.apply([RemoveOp(a.seq_id, 8)])
    assert len(a.blocks) == 2 and manager.num_free_blocks == free + 2
    assert kv.read(a.seq_id) == [tuple(guessed[:p + 1]) for p in range(8)]
    manager.check_invariants()


def test_everything_returns_after_all_sequences_end():
    manager, kv = make()
    for salt in range(5):
        tokens = [1, 2, 3, 4, 5, 6, 7, 8] + [salt] * 5
        alloc = manager.open(tokens, len(tokens) - 1, len(tokens) + 1)
        compute(manager, kv, alloc, tokens, alloc.num_cached, len(tokens))
        manager.free(alloc)
        kv.apply(manager.take_ops())
    while manager.ids.evict_oldest():
        pass
    kv.apply(manager.take_ops())
    assert kv.used_cells == 0 and len(manager.free_list) == manager.num_blocks
    assert sorted(manager.ids.free_seq_ids) == list(range(manager.ids.num_seq_ids))


def own_cells(kv, alloc, tokens, n):
    return kv.read(alloc.seq_id)[:n] == [tuple(tokens[:p + 1]) for p in range(n)]


def test_with_no_seq_ids_kept_for_the_cache_a_holder_of_a_shared_prefix_gives_its_id_up():
    """Split KV, as many seq ids as sequences run (cache_seqs 0): the sequence that computed a
    shared prefix ends while others still use the prefix. A new sequence takes the holder's
    seq id; the prefix stays cached, now held by a sequence that shares it, and still hits."""
    manager, kv = make(num_blocks=64, seq_ids=3, share_cells=False)
    shared = list(range(8))
    a_tokens, b_tokens, c_tokens = shared + [50, 51], shared + [60, 61], shared + [70, 71]
    a = manager.open(a_tokens, 9, 12)
    compute(manager, kv, a, a_tokens, 0, 10)
    b = manager.open(b_tokens, 9, 12)
    c = manager.open(c_tokens, 9, 12)
    assert b.num_cached == c.num_cached == 8
    compute(manager, kv, b, b_tokens, 8, 10)
    compute(manager, kv, c, c_tokens, 8, 10)
    manager.free(a)                          # a holds the prefix b and c use; no id is free
    kv.apply(manager.take_ops())
    d_tokens = shared + [80, 81]
    d = manager.open(d_tokens, 9, 12)
    assert d is not None and d.seq_id == a.seq_id and d.num_cached == 8
    kv.apply(manager.take_ops())
    compute(manager, kv, d, d_tokens, 8, 10)
    assert own_cells(kv, d, d_tokens, 10)
    manager.check_invariants()
    for alloc in (b, c, d):
        manager.free(alloc)
    kv.apply(manager.take_ops())
    e_tokens = shared + [90, 91]
    e = manager.open(e_tokens, 9, 12)        # the prefix outlived every sequence that used it
    kv.apply(manager.take_ops())
    assert e.num_cached == 8 and own_cells(kv, e, e_tokens, 8)
    manager.check_invariants()


def test_a_holder_with_blocks_of_its_own_is_not_handed_on_but_evicted():
    """A holder that still holds a block nobody else references keeps it until eviction (LRU
    decides what goes), so handing on never drops a cached block by itself."""
    manager, kv = make(num_blocks=64, seq_ids=2, share_cells=False)
    a_tokens = list(range(16)) + [1]
    a = manager.open(a_tokens, 16, 18)
    compute(manager, kv, a, a_tokens, 0, 17)
    b_tokens = list(range(8)) + [99] * 5          # shares block 0 only
    b = manager.open(b_tokens, 12, 14)
    compute(manager, kv, b, b_tokens, 8, 13)
    manager.free(a)
    kv.apply(manager.take_ops())
    assert not manager.ids.rehome_one()              # a's block 1 is referenced by nobody
    c = manager.open(list(range(300, 305)), 4, 6)  # evicts a's block 1, then hands block 0 on
    kv.apply(manager.take_ops())
    assert c is not None and c.seq_id == a.seq_id
    assert manager.lookup(a_tokens) == 8 and manager.lookup(b_tokens) == 12
    manager.check_invariants()


def test_a_newer_conversation_survives_when_an_older_one_that_shares_its_head_gives_its_id_up():
    """Split KV, two seq ids, both holders: an older conversation (a) and a newer one (b) that
    continued a's first block. A new sequence needs a seq id: a's own blocks go (least recently
    used), a's first block is handed to b, whose cells hold it, and b's whole chain stays."""
    manager, kv = make(num_blocks=64, seq_ids=2, share_cells=False)
    a_tokens = list(range(4)) + [1] * 12 + [2]
    a = manager.open(a_tokens, 16, 18)
    compute(manager, kv, a, a_tokens, 0, 17)
    manager.free(a)
    kv.apply(manager.take_ops())
    b_tokens = list(range(4)) + [7] * 12 + [3]        # shares a's first block only
    b = manager.open(b_tokens, 16, 18)
    kv.apply(manager.take_ops())
    assert b.num_cached == 4
    compute(manager, kv, b, b_tokens, 4, 17)
    manager.free(b)
    kv.apply(manager.take_ops())
    c_tokens = b_tokens + [5] * 4                     # b's next turn
    c = manager.open(c_tokens, 20, 22)
    kv.apply(manager.take_ops())
    assert c is not None and c.num_cached == 16
    assert own_cells(kv, c, c_tokens, 16)
    manager.check_invariants()
