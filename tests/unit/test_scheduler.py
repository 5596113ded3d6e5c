"""Scheduler behaviour with a fake engine (FakeKV applies KV ops; 'decoding' writes cells)."""
import signal
from contextlib import contextmanager

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache import BlockManager, RestoreOp, SaveOp
from scheduler import Scheduler, Sequence, Status, make_policy
from scheduler.scheduler import BACKGROUND_QUIET_S
from scheduler.sequence import BACKGROUND
from tests.fakes import FakeKV

BS = 4


def make(policy="fifo", max_seqs=4, budget=24, blocks=64, prefill_chunk=BS, preemption="swap",
         seq_ids=8, caching=True, share_cells=True):
    manager = BlockManager(blocks, block_size=BS, num_seq_ids=seq_ids, prefix_caching=caching,
                           prefill_chunk=prefill_chunk, share_cells=share_cells)
    streams = 1 if share_cells else seq_ids     # split KV: cells of their own for each seq id
    return (Scheduler(manager, make_policy(policy), max_seqs=max_seqs, max_batch_tokens=budget,
                      preemption=preemption), FakeKV(blocks * BS * streams))


def step(sched, kv, next_token=lambda seq: 1000 + seq.num_output, now=None):
    """One engine step as the worker runs it: plan, apply ops, 'decode', advance; a sequence
    whose prompt was just computed forks its pending forks (n > 1), and each sequence that
    produced logits appends its sampled token."""
    plan = sched.schedule(now)
    unread = kv.apply(plan.ops)
    if unread:   # a state that could not be read: planned again
        sched.reopen(unread, plan)
        kv.apply(sched.manager.take_ops())
    for c in plan.chunks:
        for pos in range(c.start, c.end):
            kv.write(c.seq.seq_id, pos, tuple(c.seq.tokens[:pos + 1]))
    sched.advance(plan)
    for c in plan.chunks:
        if c.wants_logits:
            for s in [c.seq, *(sched.fork(c.seq) if c.seq.forks else [])]:
                s.tokens.append(next_token(s))
                if s.num_output >= s.max_tokens:
                    sched.finish(s, "length")
    kv.apply(sched.manager.take_ops())
    return plan


def seq(n_prompt, max_tokens=4, priority=0, base=0, deadline=None):
    return Sequence([base + i for i in range(n_prompt)], max_tokens, priority, deadline)


@contextmanager
def time_limit(seconds):
    """Fail, rather than hang, when a step loops forever."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_to_end(sched, kv, limit=500):
    for _ in range(limit):
        if not sched.has_work():
            return
        step(sched, kv)
    raise AssertionError("did not finish")


def test_fifo_admits_in_arrival_order():
    sched, kv = make(max_seqs=1)
    a, b = seq(3, base=0), seq(3, base=100)
    sched.add(a)
    sched.add(b)
    step(sched, kv)
    assert sched.running == [a] and sched.waiting == [b]


def test_priority_admits_lower_value_first_and_ties_by_arrival():
    sched, kv = make("priority", max_seqs=1)
    low, high1, high2 = seq(3, priority=10), seq(3, priority=0, base=100), seq(3, priority=0, base=200)
    for s in (low, high1, high2):
        sched.add(s)
    step(sched, kv)
    assert sched.running == [high1]
    assert [s for s in sorted(sched.waiting, key=sched.policy.key)] == [high2, low]


def test_shortest_prompt_first_admits_the_short_prompt():
    sched, kv = make("spf", max_seqs=1)
    long, short = seq(12), seq(2, base=100)
    sched.add(long)
    sched.add(short)
    step(sched, kv)
    assert sched.running == [short]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        make_policy("random")


def test_decodes_are_planned_before_prompt_chunks():
    sched, kv = make(max_seqs=2, budget=2 + BS, prefill_chunk=BS)
    a = seq(2, max_tokens=10)
    sched.add(a)
    step(sched, kv)                       # a prefilled, now decoding
    b = seq(20, base=100)
    sched.add(b)
    plan = step(sched, kv)
    assert [(c.seq, c.end - c.start) for c in plan.chunks] == [(a, 1), (b, 4)]


def test_prompt_chunks_are_aligned_and_respect_the_budget():
    sched, kv = make(max_seqs=1, budget=2 * BS + 1, prefill_chunk=2 * BS)
    s = seq(19)
    sched.add(s)
    spans = []
    while s.num_computed < 19:
        plan = step(sched, kv)
        spans += [(c.start, c.end) for c in plan.chunks]
    assert spans == [(0, 8), (8, 16), (16, 19)]


def test_budget_too_small_for_decodes_plus_a_chunk_is_rejected():
    with pytest.raises(ValueError):
        make(max_seqs=8, budget=8, prefill_chunk=BS)


def test_running_decodes_are_never_starved_by_a_long_prompt():
    sched, kv = make(max_seqs=4, budget=4 + BS, prefill_chunk=BS)
    streams = [seq(2, max_tokens=50, base=100 * i) for i in range(3)]
    for s in streams:
        sched.add(s)
    while any(s.num_output == 0 for s in streams):
        step(sched, kv)
    sched.add(seq(60, base=9000))
    for _ in range(10):
        before = [s.num_output for s in streams]
        step(sched, kv)
        assert [s.num_output for s in streams] == [b + 1 for b in before]


def test_finished_sequence_frees_its_slot_and_blocks():
    sched, kv = make()
    s = seq(5, max_tokens=3)
    sched.add(s)
    run_to_end(sched, kv)
    assert s.status is Status.FINISHED and s.num_output == 3
    assert sched.manager.num_used_blocks == 0 and not sched.manager.live


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "swapped"])
def test_cancel_works_in_every_state(where):
    sched, kv = make(max_seqs=1, blocks=12, budget=1 + BS)
    s = seq(12, max_tokens=20)
    if where == "swapped":
        sched = make("priority", max_seqs=1, blocks=12, budget=1 + BS)[0]
        s.priority = 5
    sched.add(s)
    if where == "prefilling":
        step(sched, kv)
        assert 0 < s.num_computed < 12
    elif where == "decoding":
        while s.num_output == 0:
            step(sched, kv)
    elif where == "swapped":
        while s.num_output == 0:
            step(sched, kv)
        sched.add(seq(4, priority=0, base=500))
        step(sched, kv)
        assert s.saved_key is not None and s in sched.waiting
    sched.abort(s)
    kv.apply(sched.manager.take_ops())
    assert s.status is Status.FINISHED and s not in sched.waiting and s not in sched.running
    assert s.alloc is None
    if where == "swapped":
        assert kv.saved == {}
    run_to_end(sched, kv)
    assert sched.manager.num_used_blocks == 0


def test_kv_exhaustion_preempts_the_newest_under_fifo():
    sched, kv = make(max_seqs=4, blocks=6, budget=4 + BS)
    old, new = seq(4, max_tokens=12, base=0), seq(4, max_tokens=12, base=100)
    sched.add(old)
    sched.add(new)
    while not sched.num_preemptions:
        step(sched, kv)
    assert new.num_preemptions == 1 and old.num_preemptions == 0


def test_kv_exhaustion_preempts_the_lowest_priority_under_priority():
    sched, kv = make("priority", max_seqs=4, blocks=6, budget=4 + BS)
    vip, bulk = seq(4, max_tokens=12, priority=0, base=100), seq(4, max_tokens=12, priority=9)
    sched.add(bulk)
    sched.add(vip)
    while not sched.num_preemptions:
        step(sched, kv)
    assert bulk.num_preemptions == 1 and vip.num_preemptions == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequence_resumes_and_sees_the_same_kv(mode):
    sched, kv = make(max_seqs=4, blocks=6, budget=4 + BS, preemption=mode)
    a, b = seq(4, max_tokens=10, base=0), seq(4, max_tokens=10, base=100)
    sched.add(a)
    sched.add(b)
    seen = []

    def token(s):
        # the 'model' checks that the KV it attends to is exactly its own tokens so far
        assert kv.read(s.seq_id) == [tuple(s.tokens[:p + 1]) for p in range(len(s.tokens))]
        seen.append(s)
        return 1000 + s.num_output

    for _ in range(200):
        if not sched.has_work():
            break
        step(sched, kv, token)
    assert sched.num_preemptions >= 1
    assert a.tokens[4:] == b.tokens[4:] == [1000 + i for i in range(10)]


@pytest.mark.parametrize("bound", [0, 6, None])
def test_swap_keeps_at_most_its_bound_of_tokens_in_ram_and_recomputes_beyond_it(bound):
    """A priority request preempts a running one twice over: with room for its state in the
    swap bound it is swapped out (its tokens saved), beyond it recomputed; the books of the
    swapped tokens end balanced and the answer is the same either way."""
    sched, kv = make("priority", max_seqs=1)
    sched.max_swapped_tokens = bound
    bulk = seq(3, max_tokens=30, priority=10)
    sched.add(bulk)
    step(sched, kv)
    step(sched, kv)                              # 3 prompt tokens + 2 generated: 4 computed
    vip = seq(3, max_tokens=2, priority=0, base=100)
    sched.add(vip)
    plan = step(sched, kv)
    saved = [op for op in plan.ops if isinstance(op, SaveOp)]
    assert bulk.num_preemptions == 1
    assert (len(saved) == 1) == (bound is None or bound >= 4)
    assert sched.swapped_tokens == (4 if saved else 0)
    for _ in range(100):
        if not sched.has_work():
            break
        step(sched, kv)
    assert bulk.tokens[3:] == [1000 + i for i in range(30)] and sched.swapped_tokens == 0
    assert kv.saved == {}


def test_priority_request_preempts_a_running_low_priority_one():
    sched, kv = make("priority", max_seqs=1)
    bulk = seq(3, max_tokens=30, priority=10)
    sched.add(bulk)
    step(sched, kv)
    vip = seq(3, priority=0, base=100)
    sched.add(vip)
    step(sched, kv)
    assert sched.running == [vip] and bulk in sched.waiting and bulk.num_preemptions == 1


@pytest.mark.parametrize("policy", ["fifo", "priority", "spf"])
def test_background_work_pauses_while_foreground_work_runs(policy):
    """A batch line (priority BACKGROUND) gets no tokens in a step where a foreground sequence
    runs or waits, keeps its KV meanwhile, and goes on where it stopped; its answer is the one it
    gets alone."""
    sched, kv = make(policy, max_seqs=4)
    alone = seq(6, max_tokens=12, priority=BACKGROUND)
    sched.add(alone)
    run_to_end(sched, kv)
    bulk = seq(6, max_tokens=12, priority=BACKGROUND)
    sched.add(bulk)
    step(sched, kv)
    step(sched, kv)
    before = bulk.num_computed
    chat = seq(5, max_tokens=3, base=100)
    sched.add(chat)
    while chat.status is not Status.FINISHED:
        plan = step(sched, kv)
        assert all(c.seq is not bulk for c in plan.chunks)
        assert bulk.num_computed == before and bulk.status is Status.RUNNING
    run_to_end(sched, kv)
    assert bulk.tokens == alone.tokens and sched.num_preemptions == 0


def test_background_work_alone_takes_short_steps():
    """Alone, background prompts advance a grid cell a step until costs are known (then what
    fits BACKGROUND_STEP_S), never in a wave: foreground work arriving waits one short step."""
    sched, kv = make(max_seqs=4, budget=64)
    lines = [seq(40, max_tokens=2, priority=BACKGROUND, base=100 * i) for i in range(6)]
    for line in lines:
        sched.add(line)
    while sched.has_work():
        plan = step(sched, kv)
        assert not plan.wave and plan.num_prompt_tokens <= BS
    assert all(line.status is Status.FINISHED for line in lines)


def test_a_stopped_background_step_counts_nothing_and_frees_its_claims():
    """A background step stopped part-way for a client's request (the worker removes its KV
    positions) advances nothing; the prefix blocks it was computing first can be claimed by the
    client's request, which shares them, and the line later computes the same pieces again
    and ends with the answer it gets alone."""
    sched, kv = make(max_seqs=4, budget=64)
    line = seq(16, max_tokens=6, priority=BACKGROUND, base=50)
    line_alone = seq(16, max_tokens=6, priority=BACKGROUND, base=50)
    sched.add(line_alone)
    run_to_end(sched, kv)
    sched, kv = make(max_seqs=4, budget=64)
    sched.add(line)
    plan = sched.schedule()
    kv.apply(plan.ops)
    assert plan.background and [c.seq for c in plan.chunks] == [line] and plan.chunks[0].claims
    sched.stopped(plan.chunks)   # stopped: nothing written, nothing advanced
    assert line.num_computed == 0 and not sched.inflight
    chat = Sequence(line.tokens[:8] + [900, 901], 3, 0)   # shares the line's first two blocks
    sched.add(chat)
    plan = step(sched, kv)
    assert not plan.background and [c.seq for c in plan.chunks] == [chat]
    run_to_end(sched, kv)
    assert chat.status is Status.FINISHED and line.tokens == line_alone.tokens


@pytest.mark.parametrize("policy", ["fifo", "priority", "spf"])
def test_foreground_work_preempts_background_work_for_its_slot(policy):
    sched, kv = make(policy, max_seqs=1)
    bulk = seq(3, max_tokens=30, priority=BACKGROUND)
    sched.add(bulk)
    step(sched, kv)
    chat = seq(3, base=100)
    sched.add(chat)
    step(sched, kv)
    assert sched.running == [chat] and bulk in sched.waiting and bulk.num_preemptions == 1
    run_to_end(sched, kv)
    assert bulk.status is Status.FINISHED and bulk.num_output == 30


def test_fifo_never_preempts_for_a_waiting_request():
    sched, kv = make(max_seqs=1)
    first = seq(3, max_tokens=30)
    sched.add(first)
    step(sched, kv)
    sched.add(seq(3, base=100))
    step(sched, kv)
    assert sched.running == [first] and sched.num_preemptions == 0


def test_deadline_ends_a_request_and_reports_it():
    sched, kv = make()
    s = seq(3, max_tokens=100, deadline=10.0)
    sched.add(s)
    step(sched, kv, now=5.0)
    step(sched, kv, now=11.0)
    assert s.finish_reason == "timeout" and sched.expired == [s]
    assert sched.manager.num_used_blocks == 0


def test_prefix_hit_skips_the_cached_blocks():
    sched, kv = make()
    first = seq(10, max_tokens=1)
    sched.add(first)
    run_to_end(sched, kv)
    again = seq(10, max_tokens=1)
    sched.add(again)
    plan = step(sched, kv)
    assert again.num_cached_tokens == 8
    assert [(c.start, c.end) for c in plan.chunks] == [(8, 10)]


def test_inflight_prefix_is_computed_once_and_shared():
    sched, kv = make(max_seqs=2, budget=2 + BS, prefill_chunk=BS)
    a, b = seq(17, max_tokens=1), seq(17, max_tokens=1)
    sched.add(a)
    sched.add(b)
    computed_by_b = 0
    for _ in range(40):
        if not sched.has_work():
            break
        plan = step(sched, kv)
        computed_by_b += sum(c.end - c.start for c in plan.chunks if c.seq is b)
    assert a.status is b.status is Status.FINISHED
    assert b.num_cached_tokens == 16 and computed_by_b == 1
    assert a.tokens[-1] == b.tokens[-1]


def swapped_mid_prompt(sched, kv):
    """A (21 tokens, priority 1) is two chunks into its prompt when B (priority 0) arrives and
    there are blocks for only one of them: A is swapped out with 16 of 21 tokens computed."""
    a, b = seq(21, priority=1), seq(6, priority=0, base=100)
    sched.add(a)
    plans = [step(sched, kv), step(sched, kv)]
    sched.add(b)
    with time_limit(5):
        while sched.has_work() and len(plans) < 100:
            plans.append(step(sched, kv))
    assert a.status is b.status is Status.FINISHED and a.num_preemptions >= 1
    return plans


def split_kv_under_pressure():
    return make("priority", max_seqs=2, budget=10, blocks=7, prefill_chunk=2 * BS,
                share_cells=False)


def test_a_step_never_readmits_a_sequence_it_preempted():
    for plan in swapped_mid_prompt(*split_kv_under_pressure()):
        saved = {op.key for op in plan.ops if isinstance(op, SaveOp)}
        assert not saved & {op.key for op in plan.ops if isinstance(op, RestoreOp)}


def test_a_swapped_out_sequence_comes_back_only_with_room_for_the_rest_of_its_prompt():
    for plan in swapped_mid_prompt(*split_kv_under_pressure()):
        restored = set()
        for op in plan.ops:
            if isinstance(op, RestoreOp):
                restored.add(op.seq)
            elif isinstance(op, SaveOp):
                assert op.seq not in restored, "restored, then swapped out again"


class OpenCountingManager(BlockManager):
    """Fails a step that opens sequences more often than any step can (each waiting sequence
    once, each failed open followed by a preemption): a livelock fails fast instead of hanging."""

    def __init__(self, *args, max_opens_per_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_opens, self.opens = max_opens_per_step, 0

    def open(self, *args, **kwargs):
        self._count()
        return super().open(*args, **kwargs)

    def open_for_restore(self, *args, **kwargs):
        self._count()
        return super().open_for_restore(*args, **kwargs)

    def take_ops(self):
        self.opens = 0          # the scheduler takes the ops at the end of each step
        return super().take_ops()

    def _count(self):
        self.opens += 1
        assert self.opens <= self.max_opens, "a step keeps opening sequences"


REQUESTS = st.lists(st.fixed_dictionaries({
    "arrival": st.integers(0, 8),                        # step
    "shared": st.sampled_from([0, BS, 2 * BS]),          # tokens every request may start with
    "salt": st.integers(0, 2),                           # same salt, same prompt
    "own": st.integers(6, 16),
    "max_tokens": st.integers(1, 6),
    "priority": st.integers(0, 2),
    "deadline": st.none() | st.integers(1, 40),          # steps after arrival
    "abort": st.none() | st.integers(1, 40),             # steps after arrival
}), min_size=6, max_size=12)
CONFIGS = st.fixed_dictionaries({
    "share_cells": st.booleans(),
    "blocks": st.integers(8, 9),        # every request fits alone (at most 30 tokens)
    "max_seqs": st.integers(1, 4),
    "prefill_chunk": st.sampled_from([BS, 2 * BS]),
    "spare_budget": st.integers(0, 4),
    "spare_seq_ids": st.integers(0, 2),
})


def workload_scheduler(policy, preemption, config, n_requests):
    c = config
    manager = OpenCountingManager(
        c["blocks"], block_size=BS, num_seq_ids=c["max_seqs"] + c["spare_seq_ids"],
        prefill_chunk=c["prefill_chunk"], share_cells=c["share_cells"],
        max_opens_per_step=3 * n_requests + 1)
    sched = Scheduler(manager, make_policy(policy), max_seqs=c["max_seqs"],
                      max_batch_tokens=c["max_seqs"] + c["prefill_chunk"] + c["spare_budget"],
                      preemption=preemption)
    streams = 1 if c["share_cells"] else manager.ids.num_seq_ids
    return sched, FakeKV(c["blocks"] * BS * streams)


def arrive(sched, requests, seqs, now):
    """Add the requests that arrive at step `now` (seqs[i] for requests[i]), abort those whose
    time has come."""
    for i, r in enumerate(requests):
        if r["arrival"] == now:
            prompt = list(range(1, r["shared"] + 1)) + [100 * (r["salt"] + 1) + k
                                                       for k in range(r["own"])]
            deadline = None if r["deadline"] is None else float(now + r["deadline"])
            seqs[i] = Sequence(prompt, r["max_tokens"], r["priority"], deadline)
            sched.add(seqs[i])
        elif r["abort"] is not None and r["arrival"] + r["abort"] == now:
            sched.abort(seqs[i])


def request(own, *, shared=0, salt=0, max_tokens=1, priority=0, arrival=0):
    return dict(arrival=arrival, shared=shared, salt=salt, own=own, max_tokens=max_tokens,
                priority=priority, deadline=None, abort=None)


def kv_config(blocks, max_seqs, prefill_chunk, *, share_cells=False, seq_ids=0):
    return dict(share_cells=share_cells, blocks=blocks, max_seqs=max_seqs,
                prefill_chunk=prefill_chunk, spare_budget=0, spare_seq_ids=seq_ids)


def step_and_check(sched, kv, seqs, now, max_ops):
    """One step of a random workload, checking what every step must hold."""
    def sample(s):
        assert kv.read(s.seq_id) == [tuple(s.tokens[:p + 1]) for p in range(len(s.tokens))]
        return 1000 + s.num_output

    before = [s.num_preemptions for s in seqs]
    plan = step(sched, kv, sample, now=float(now))
    preempted = {s: s.num_preemptions - n for s, n in zip(seqs, before) if s.num_preemptions > n}
    assert all(n == 1 for n in preempted.values()), "preempted twice in one step"
    assert all(s.status is Status.WAITING for s in preempted), "preempted, then readmitted"
    assert plan.num_tokens or preempted or not sched.has_work(), "an idle step"
    assert len(plan.ops) <= max_ops
    sched.manager.check_invariants()


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("policy", ["fifo", "priority", "spf"])
@settings(max_examples=60, deadline=None)
@given(config=CONFIGS, requests=REQUESTS)
@example(config=kv_config(8, 2, BS),   # split KV, the same prompt twice at once: twin blocks
         requests=[request(15, shared=2 * BS, max_tokens=3)] * 2)
@example(config=kv_config(7, 2, 2 * BS, seq_ids=6),   # a long prompt swapped out mid-way
         requests=[request(21, max_tokens=4, priority=1),
                   request(6, salt=1, max_tokens=4, arrival=2)])
def test_random_workloads_under_kv_pressure_end_with_balanced_books(policy, preemption, config,
                                                                   requests):
    """Every step computes tokens or preempts while there is work, preempts a sequence at most
    once and never readmits it, keeps its op list bounded and the block manager's books
    balanced; every sequence sees exactly its own tokens, and every request ends."""
    sched, kv = workload_scheduler(policy, preemption, config, len(requests))
    max_ops, seqs = 8 * (config["blocks"] + len(requests)), {}
    for now in range(1000):
        arrive(sched, requests, seqs, now)
        kv.apply(sched.manager.take_ops())
        if not sched.has_work() and len(seqs) == len(requests):
            break
        step_and_check(sched, kv, list(seqs.values()), now, max_ops)
    assert all(s.status is Status.FINISHED for s in seqs.values())
    assert sched.manager.num_used_blocks == 0 and kv.saved == {} and sched.swapped_tokens == 0


def test_merged_cells_take_a_lone_prompt_in_one_piece_and_keep_a_one_token_tail_apart():
    """While nothing decodes, a prompt takes several grid cells at once, up to the budget;
    pieces end on the grid except the tail, and a 1-token tail is a piece of its own (a cache
    hit can leave exactly that token, whose 1-token piece computes other numbers)."""
    def pieces(n_prompt, budget=24, others=(), few=0):
        sched, kv = make(budget=budget, blocks=128)
        sched.few_decoding, sched.finish_piece = few, 10
        for o in others:
            sched.add(o)
            while not o.is_decoding:
                step(sched, kv)
        s = seq(n_prompt, base=500)
        sched.add(s)
        cuts = []
        while s.num_output == 0:
            plan = step(sched, kv)
            cuts += [(c.start, c.end) for c in plan.chunks if c.seq is s]
        return cuts
    assert pieces(10) == [(0, 10)]
    assert pieces(9) == [(0, 8), (8, 9)]                   # 9 = 2 cells + a 1-token tail
    assert pieces(30) == [(0, 24), (24, 30)]               # the budget, cut on the grid
    assert pieces(10, others=[seq(3, max_tokens=50)]) == [(0, 4), (4, 8), (8, 10)]   # a stream decodes
    # ... unless it is one of few: then a prompt with at most finish_piece tokens left finishes
    assert pieces(10, others=[seq(3, max_tokens=50)], few=1) == [(0, 10)]
    assert pieces(14, others=[seq(3, max_tokens=50)], few=1) == [(0, 4), (4, 14)]


def _prompt_pieces(sched, kv, prompts, streams=1, few=0, finish=0):
    """Start `streams` decoding streams, then add the prompts together; per step, the prompt
    tokens planned, and per prompt the step its first token came in and the pieces it took.
    few, finish: the scheduler's few_decoding and finish_piece (0: one cell per prompt beside
    any stream)."""
    sched.few_decoding, sched.finish_piece = few, finish
    for i in range(streams):
        s = seq(3, max_tokens=500, base=900 + 10 * i)
        sched.add(s)
        while not s.is_decoding:
            step(sched, kv)
    for p in prompts:
        sched.add(p)
    per_step, first, cuts = [], {}, {id(p): [] for p in prompts}
    for k in range(1, 40):
        plan = step(sched, kv)
        pieces = [c for c in plan.chunks if c.seq in prompts and c.start < c.seq.num_prompt]
        per_step.append(sum(c.end - c.start for c in pieces))
        for c in pieces:
                cuts[id(c.seq)].append((c.start, c.end))
        for p in prompts:
            if p.num_output and id(p) not in first:
                first[id(p)] = k
        if len(first) == len(prompts):
            break
    return per_step, [first[id(p)] for p in prompts], [cuts[id(p)] for p in prompts]


def test_while_streams_decode_prompts_take_their_cells_in_order_and_the_last_is_not_later():
    """Beside a decoding stream, each step computes as many prompt tokens as one cell per
    prompt gives (the stream's steps are no longer), but in policy order, several cells at once:
    the first prompt finishes a step earlier, the last no later (the first lends its cell)."""
    sched, kv = make(budget=24, blocks=128, max_seqs=4)
    a, b = seq(12, base=100), seq(12, base=200)
    per_step, first, cuts = _prompt_pieces(sched, kv, [a, b])
    assert per_step == [8, 8, 8]                      # 2 cells of 4 a step, as one cell each
    assert first == [2, 3]                            # one cell each: [3, 3]
    assert cuts == [[(0, 8), (8, 12)], [(0, 4), (4, 12)]]


def test_one_prompt_beside_streams_still_takes_one_cell_a_step():
    """A long prompt arriving while streams decode gets one cell a step, as before: the
    streams' steps stay short (the interference benchmark's largest gap)."""
    sched, kv = make(budget=24, blocks=128, max_seqs=4)
    p = seq(16, base=300)
    per_step, first, cuts = _prompt_pieces(sched, kv, [p], streams=2)
    assert per_step == [4, 4, 4, 4] and first == [4]


@pytest.mark.parametrize("streams,n_prompt,per_step", [
    (2, 12, [12]),                 # few streams, a short prompt: one piece
    (2, 20, [4, 4, 12]),           # a longer one: cells until the rest fits in finish_piece
    (3, 12, [4, 4, 4])])           # more streams than few_decoding: one cell a step
def test_beside_few_streams_a_prompt_finishes_its_last_piece_at_once(streams, n_prompt, per_step):
    """While at most few_decoding sequences decode, a prompt with at most finish_piece tokens
    left computes them in one piece (cheaper per token; a few streams wait on one longer step);
    a long prompt still takes a cell a step before that, and beside more streams every prompt
    does."""
    sched, kv = make(budget=24, blocks=128, max_seqs=4)
    p = seq(n_prompt, base=300)
    got, first, cuts = _prompt_pieces(sched, kv, [p], streams=streams, few=2, finish=12)
    assert got == per_step and first == [len(per_step)]


def test_a_finishing_prompt_does_not_take_the_cells_of_the_others():
    """Beside few streams, a short prompt finishing in one piece leaves the allowance (one cell
    per prompt) to a long prompt computed beside it."""
    sched, kv = make(budget=40, blocks=128, max_seqs=4)
    short, long = seq(8, base=400), seq(24, base=300)      # the short one first in FIFO order
    per_step, first, cuts = _prompt_pieces(sched, kv, [short, long], streams=1, few=2, finish=8)
    assert cuts[0] == [(0, 8)]                                # the short one: one piece
    assert cuts[1][0] == (0, 8)                               # the long one, in the same step:
    assert per_step[0] == 16                                  # its own and the short one's cell


def test_a_prompt_waiting_on_a_shared_prefix_lends_its_cell_to_the_one_computing_it():
    """Two prompts with the same first 16 tokens beside a stream: the second waits for the
    first's blocks (prefix cache) and gives its cell to it, so the shared part is computed at
    two cells a step, and the second is served from the cache."""
    sched, kv = make(budget=24, blocks=128, max_seqs=4)
    shared = list(range(700, 716))
    a = Sequence(shared + [1, 2, 3], 4)
    b = Sequence(shared + [4, 5, 6], 4)
    per_step, first, cuts = _prompt_pieces(sched, kv, [a, b])
    assert cuts[0][:2] == [(0, 8), (8, 16)]
    assert b.num_cached_tokens == 16 and first[0] <= 3




def _wave_sched(wave=64, ratio=2.0):
    sched, kv = make(budget=24, blocks=256, max_seqs=8, seq_ids=16)
    sched.wave_batch_tokens, sched.wave_ratio = wave, ratio
    return sched, kv


def _decoding(sched, kv, n):
    streams = [seq(3, max_tokens=500, base=900 + 10 * i) for i in range(n)]
    for s in streams:
        sched.add(s)
    while not all(s.is_decoding for s in streams):
        step(sched, kv)
    return streams


def _arrive(sched, n, n_prompt=10, base=0):
    wave = [seq(n_prompt, max_tokens=5, base=base + 100 * i) for i in range(n)]
    for s in wave:
        sched.add(s)
    return wave


def test_a_wave_of_prompts_arriving_together_is_computed_in_one_step_and_decodes_in_step():
    sched, kv = _wave_sched()
    wave = _arrive(sched, 5)
    plan = step(sched, kv)
    assert plan.wave and plan.budget == 64
    assert [(c.seq, c.start, c.end) for c in plan.chunks] == [(s, 0, 10) for s in wave]
    plan = step(sched, kv)                       # now they decode: one token each, in step
    assert [(c.seq, c.end - c.start) for c in plan.chunks] == [(s, 1) for s in wave]


@pytest.mark.parametrize("stops,quiet", [(False, 10.0), (True, 10.0), (True, 1.0)])
def test_background_lines_arriving_together_are_a_wave_once_clients_are_quiet(stops, quiet):
    """Where a client's request stops a background step (a CPU context), background work alone
    is planned as a client's once no client's request has run for BACKGROUND_QUIET_S: lines
    that start together are a wave, computed in one step and decoded in step, as a client's
    requests are. Sooner after a client's request, or where steps cannot be stopped, its steps
    stay short."""
    sched, kv = _wave_sched()
    sched.background_stops = stops
    chat = seq(3, max_tokens=1, base=5000)
    sched.add(chat)
    step(sched, kv, now=100.0)
    assert chat.status is Status.FINISHED
    lines = [seq(10, max_tokens=5, priority=BACKGROUND, base=100 * i) for i in range(5)]
    for line in lines:
        sched.add(line)
    plan = step(sched, kv, now=100.0 + quiet)
    wave = stops and quiet >= BACKGROUND_QUIET_S
    assert plan.background and plan.wave == wave
    if wave:
        assert [(c.seq, c.start, c.end) for c in plan.chunks] == [(s, 0, 10) for s in lines]
    else:
        assert plan.num_prompt_tokens <= BS


def test_without_waves_the_same_prompts_spread_over_steps():
    sched, kv = _wave_sched(wave=0)
    wave = _arrive(sched, 5)
    assert not step(sched, kv).wave
    assert [s.num_output for s in wave] == [1, 1, 0, 0, 0]


def test_a_few_prompts_are_no_wave():
    """At most few_decoding prompts: chunked as without waves (beside few streams a prompt
    is cheaper computed next to their decode tokens than in a step of its own)."""
    sched, kv = _wave_sched()
    wave = _arrive(sched, 4)
    assert not step(sched, kv).wave
    assert [s.num_output for s in wave] == [1, 1, 0, 0]


def test_a_wave_beside_a_few_streams_is_computed_whole_in_one_step():
    """Five prompts beside one decoding stream (at least wave_ratio times as many): one step
    takes the stream's token and every prompt whole."""
    sched, kv = _wave_sched()
    (a,) = _decoding(sched, kv, 1)
    wave = _arrive(sched, 5)
    plan = step(sched, kv)
    assert plan.wave
    assert [(c.seq, c.end - c.start) for c in plan.chunks] == [(a, 1)] + [(s, 10) for s in wave]


def test_one_prompt_beside_streams_is_no_wave_and_still_takes_one_cell_a_step():
    """Fewer prompts than wave_ratio times the streams: the streams' steps stay short."""
    sched, kv = _wave_sched(wave=200)
    p = seq(16, base=300)
    per_step, first, _ = _prompt_pieces(sched, kv, [p], streams=2)
    assert per_step == [4, 4, 4, 4] and first == [4]


def test_a_wave_that_does_not_fit_one_step_beside_streams_is_chunked_as_before():
    sched, kv = _wave_sched(wave=40)
    _decoding(sched, kv, 1)
    _arrive(sched, 5)                    # 50 prompt tokens + 1 > 40
    assert not sched.is_wave(1)
    assert not step(sched, kv).wave


def test_a_wave_counts_what_the_prefix_cache_holds_as_computed():
    """Five prompts that share a cached 16-token prefix have 4 tokens each to compute: they
    fit a 40-token wave beside a stream, though their 100 prompt tokens do not."""
    sched, kv = _wave_sched(wave=40)
    first = seq(20, max_tokens=1)
    sched.add(first)
    run_to_end(sched, kv)
    (stream,) = _decoding(sched, kv, 1)
    for i in range(5):
        sched.add(Sequence(list(range(16)) + [500 + 10 * i + j for j in range(4)], 5, 0, None))
    assert sched.is_wave(1)
    plan = step(sched, kv)
    assert plan.wave and sum(c.end - c.start for c in plan.chunks if c.seq is not stream) == 20


def test_a_wave_counts_the_requests_still_expected():
    sched, kv = _wave_sched()
    _decoding(sched, kv, 2)
    sched.add(seq(10, base=100))
    assert not sched.is_wave(2)
    assert sched.is_wave(2, arriving=4)


def test_in_a_wave_a_prompt_whose_prefix_another_computes_waits_and_then_takes_the_whole_hit():
    """The first of a wave sharing an uncached prefix computes it; the others stay waiting (were
    they opened now on a hit ending inside a block, they could not take those blocks later)
    and open in the next step with the prefix as a hit, computing only their own tokens."""
    sched, kv = _wave_sched()
    shared = list(range(16))
    wave = [Sequence(shared + [500 + 10 * i + j for j in range(4)], 5, 0, None) for i in range(6)]
    for s in wave:
        sched.add(s)
    plan = step(sched, kv)
    assert plan.wave and [c.seq for c in plan.chunks] == [wave[0]]
    assert all(s in sched.waiting for s in wave[1:])
    plan = step(sched, kv)
    assert plan.wave
    assert [(c.seq, c.start, c.end) for c in plan.chunks][1:] == [(s, 16, 20) for s in wave[1:]]
