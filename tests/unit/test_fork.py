"""n > 1 as one prefill and a fork (Scheduler.fork, BlockManager.fork), with the fake KV cache."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Sequence, Status
from tests.unit.test_scheduler import BS, make, seq, workload_scheduler
from tests.unit.test_scheduler import step as scheduler_step


def group(n_prompt, n, max_tokens=3, base=0):
    """A sequence with n - 1 pending forks, as the worker links them."""
    first = seq(n_prompt, max_tokens, base=base)
    forks = [seq(n_prompt, max_tokens, base=base) for _ in range(n - 1)]
    for f in forks:
        f.fork_of = first
    first.forks = forks
    return [first, *forks]


def add(sched, seqs):
    for s in seqs:
        sched.add(s)


def step(sched, kv, now=None):
    """test_scheduler's step; each choice samples its own first token from the same logits."""
    return scheduler_step(sched, kv, lambda s: 1000 + 10 * s.num_output + (s.arrival % 7), now)


def run_to_end(sched, kv, limit=200):
    plans = []
    for _ in range(limit):
        if not sched.has_work():
            return plans
        plans.append(step(sched, kv))
        sched.manager.check_invariants()
    raise AssertionError("did not finish")


def prompt_tokens_computed(plans, seqs):
    return sum(c.end - c.start for p in plans for c in p.chunks
               if c.seq in seqs and c.start < c.seq.num_prompt)


def test_the_prompt_of_a_group_is_computed_once():
    sched, kv = make(max_seqs=4, budget=24)
    seqs = group(10, 3)
    add(sched, seqs)
    plans = run_to_end(sched, kv)
    assert prompt_tokens_computed(plans, seqs) == 10
    assert all(s.status is Status.FINISHED and s.num_output == 3 for s in seqs)


def test_pending_forks_are_not_admitted_on_their_own():
    sched, kv = make(max_seqs=4, budget=4 + BS)    # one 4-token chunk a step: a long prefill
    seqs = group(10, 3)
    add(sched, seqs)
    step(sched, kv)
    assert sched.running == [seqs[0]] and all(f in sched.waiting for f in seqs[1:])


def test_forks_start_with_a_copy_of_the_computed_prompt():
    sched, kv = make(max_seqs=4, budget=24, prefill_chunk=3 * BS)   # the prompt in one step
    first, *forks = group(10, 3, max_tokens=4)
    add(sched, [first, *forks])
    step(sched, kv)
    assert all(f.status is Status.RUNNING and f.num_computed == 10 for f in forks)
    assert all(kv.read(f.seq_id) == kv.read(first.seq_id)[:10] for f in forks)
    step(sched, kv)   # each decodes its own first token on its own copy
    for s in [first, *forks]:
        assert kv.read(s.seq_id) == [tuple(s.tokens[:p + 1]) for p in range(s.num_computed)]


def test_a_fork_shares_the_cached_full_blocks_and_owns_its_tail():
    sched, kv = make(max_seqs=4, budget=24, prefill_chunk=3 * BS)   # the prompt in one step
    first, fork = group(10, 2, max_tokens=4)
    add(sched, [first, fork])
    step(sched, kv)
    full = 10 // BS
    assert fork.alloc.blocks[:full] == first.alloc.blocks[:full]
    assert fork.alloc.blocks[full] is not first.alloc.blocks[full]


@pytest.mark.parametrize("share_cells", [True, False])
def test_forks_finish_and_free_everything(share_cells):
    sched, kv = make(max_seqs=4, budget=24, share_cells=share_cells)
    seqs = group(10, 4)
    add(sched, seqs)
    run_to_end(sched, kv)
    assert sched.manager.num_used_blocks == 0 and not sched.manager.live


def test_admission_counts_the_pending_forks():
    sched, kv = make(max_seqs=3, budget=24)
    seqs, other = group(10, 3), seq(5, base=500)
    add(sched, seqs + [other])
    step(sched, kv)
    assert other in sched.waiting and other.status is Status.WAITING
    run_to_end(sched, kv)
    assert other.status is Status.FINISHED


def test_aborting_every_choice_before_the_fork_frees_everything():
    sched, kv = make(max_seqs=4, budget=4 + BS)
    seqs = group(10, 3)
    add(sched, seqs)
    step(sched, kv)
    for s in seqs:
        sched.abort(s)
    kv.apply(sched.manager.take_ops())
    assert not sched.has_work() and sched.manager.num_used_blocks == 0
    assert not sched.manager.live and kv.used_cells == sched.manager.num_cached_blocks * BS


def test_forks_of_a_cancelled_first_choice_compute_the_prompt_themselves():
    sched, kv = make(max_seqs=4, budget=4 + BS)
    first, *forks = group(10, 3)
    add(sched, [first, *forks])
    step(sched, kv)
    sched.abort(first)
    assert all(f.fork_of is None for f in forks)
    run_to_end(sched, kv)
    assert all(f.status is Status.FINISHED and f.num_output == 3 for f in forks)


def test_a_cancelled_fork_is_no_longer_forked():
    sched, kv = make(max_seqs=4, budget=4 + BS)
    first, a, b = group(10, 3)
    add(sched, [first, a, b])
    step(sched, kv)
    sched.abort(a)
    assert first.forks == [b]
    run_to_end(sched, kv)
    assert a.num_output == 0 and b.num_output == 3


def test_a_prompt_that_wants_its_logprobs_reuses_no_cached_prefix():
    sched, kv = make(max_seqs=4, budget=24)
    add(sched, [seq(12, 1)])
    run_to_end(sched, kv)
    again = seq(12, 1)
    again.prompt_logits = True
    add(sched, [again])
    plans = run_to_end(sched, kv)
    assert again.num_cached_tokens == 0
    assert prompt_tokens_computed(plans, [again]) == 12
    assert all(c.num_logits == c.end - c.start for p in plans for c in p.chunks)


GROUPS = st.lists(st.fixed_dictionaries({
    "arrival": st.integers(0, 6),
    "n": st.integers(1, 3),
    "own": st.integers(3, 14),
    "salt": st.integers(0, 1),
    "max_tokens": st.integers(1, 5),
    "abort": st.none() | st.tuples(st.integers(0, 2), st.integers(0, 12)),   # (choice, step)
}), min_size=2, max_size=6)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@settings(max_examples=60, deadline=None)
@given(share_cells=st.booleans(), blocks=st.integers(12, 20), groups=GROUPS)
def test_random_groups_under_kv_pressure_end_with_balanced_books(preemption, share_cells, blocks,
                                                                 groups):
    """Groups arriving, forking, being preempted and cancelled: every sequence sees exactly its
    own tokens, the books balance after every step, and every choice ends."""
    config = dict(share_cells=share_cells, blocks=blocks, max_seqs=3, prefill_chunk=BS,
                  spare_budget=2, spare_seq_ids=2)
    sched, kv = workload_scheduler("fifo", preemption, config, 3 * len(groups))
    live: list[list[Sequence]] = [None] * len(groups)
    for now in range(400):
        for i, g in enumerate(groups):
            if g["arrival"] == now:
                live[i] = group(g["own"], g["n"], g["max_tokens"], base=100 * g["salt"])
                add(sched, live[i])
            elif g["abort"] and live[i] and g["arrival"] + g["abort"][1] == now:
                choice = g["abort"][0]
                if choice < len(live[i]):
                    sched.abort(live[i][choice])
        kv.apply(sched.manager.take_ops())
        if not sched.has_work() and all(live):
            break
        for s in sched.running:
            if s.alloc is not None and s.num_computed:
                assert kv.read(s.seq_id)[:s.num_computed] == [
                    tuple(s.tokens[:p + 1]) for p in range(s.num_computed)]
        step(sched, kv, now=float(now))
        sched.manager.check_invariants()
    assert all(s.status is Status.FINISHED for g in live for s in g)
    assert sched.manager.num_used_blocks == 0 and kv.saved == {}
