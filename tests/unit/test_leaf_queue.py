"""LeafQueue: evictable leaves come out least recently used first, however they arrive."""
from hypothesis import given
from hypothesis import strategies as st

from kvcache import Block
from kvcache.leaves import LeafQueue


def leaf(block_id, last_used):
    return Block(block_id, last_used=last_used)


def drain(queue):
    out = []
    while (block := queue.pop_oldest()) is not None:
        out.append(block.last_used)
    return out


@given(st.permutations(range(1, 40)))
def test_leaves_come_out_oldest_first_whatever_order_they_arrive_in(ages):
    queue = LeafQueue()
    for i, age in enumerate(ages):
        queue.add(leaf(i, age))
        queue.check()
    assert drain(queue) == sorted(ages)


def test_a_leaf_older_than_all_queued_goes_to_the_front():
    queue = LeafQueue()
    for i, age in enumerate([5, 6, 2]):
        queue.add(leaf(i, age))
    assert drain(queue) == [2, 5, 6]


def test_a_discarded_leaf_never_comes_out():
    queue = LeafQueue()
    blocks = [leaf(i, age) for i, age in enumerate([1, 9, 5, 3])]   # 5 and 3 arrive out of order
    for block in blocks:
        queue.add(block)
    queue.discard(blocks[3])
    queue.discard(blocks[0])
    assert blocks[3] not in queue and drain(queue) == [5, 9]


def test_discarded_out_of_order_leaves_do_not_pile_up_in_the_heap():
    queue = LeafQueue()
    queue.add(leaf(0, 1))
    queue.add(leaf(1, 10_000))
    for i in range(2, 2000):
        block = leaf(i, i)      # between the two queued ones: the heap
        queue.add(block)
        queue.discard(block)
        queue.check()           # (bounds the heap by the live late leaves)
    assert len(queue) == 2 and drain(queue) == [1, 10_000]


def test_an_empty_queue_has_no_oldest():
    assert LeafQueue().pop_oldest() is None
