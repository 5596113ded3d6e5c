"""Elastic threads: the budget contexts of one process take their threads from (no clock)."""
import threading

import pytest

from engine.threads import CoreBudget, own_share


def test_a_context_alone_with_work_uses_every_thread():
    budget = CoreBudget(2)
    assert budget.try_acquire("a", share=1, cap=2) == 2
    budget.release(2)
    assert budget.in_use == 0


def test_the_governor_caps_what_a_lone_context_borrows():
    budget = CoreBudget(2)
    assert budget.try_acquire("a", share=1, cap=1) == 1   # a busy neighbour: 1 thread left


def test_two_contexts_with_work_compute_side_by_side_on_their_own_shares():
    budget = CoreBudget(2)
    assert budget.try_acquire("a", share=1, cap=2) == 2
    budget.release(2)                            # a's step ended; a still has work
    assert budget.try_acquire("b", share=1, cap=2) == 1
    assert budget.try_acquire("a", share=1, cap=2) == 1
    assert budget.in_use == 2


@pytest.mark.parametrize("total,a,b", [(2, 1, 1), (4, 3, 1), (4, 1, 3)])
def test_a_context_waits_while_another_holds_the_threads_it_needs(total, a, b):
    # shares a + b == total; uneven shares never exceed it either
    budget = CoreBudget(total)
    assert budget.try_acquire("a", share=a, cap=total) == total   # alone: every thread
    assert budget.try_acquire("b", share=b, cap=total) is None    # b now has work, must wait
    budget.release(total)
    assert budget.try_acquire("b", share=b, cap=total) == b
    # a's next step: b has work, so a computes on its own share beside it
    assert budget.try_acquire("a", share=a, cap=total) == a
    assert budget.in_use == total


def test_a_context_gets_every_thread_again_once_the_other_goes_idle():
    budget = CoreBudget(2)
    budget.try_acquire("a", share=1, cap=2)
    budget.release(2)
    budget.try_acquire("b", share=1, cap=2)
    budget.release(1)
    assert budget.grant("a", share=1, cap=2) == 1     # b still has work
    budget.idle("b")
    assert budget.try_acquire("a", share=1, cap=2) == 2


def test_a_waiting_context_is_woken_when_the_threads_come_back():
    budget = CoreBudget(2)
    budget.try_acquire("a", share=1, cap=2)
    got = []
    t = threading.Thread(target=lambda: got.append(budget.acquire("b", share=1, cap=2)))
    t.start()
    while "b" not in budget._active:       # b is waiting inside acquire
        threading.Event().wait(0.001)
    assert not got
    budget.release(2)
    t.join(timeout=10)
    assert got == [1] and not t.is_alive()


def test_beside_others_a_context_computes_on_its_part_of_what_the_governor_leaves():
    # 4 cores, 2 contexts x 2 threads: quiet, each its 2; a neighbour on 2 cores, each 1
    assert own_share(cap=4, configured=2, share=0.5) == 2
    assert own_share(cap=2, configured=2, share=0.5) == 1
    # 2 cores, 2 contexts x 1 thread: never below 1
    assert own_share(cap=1, configured=1, share=0.5) == 1
