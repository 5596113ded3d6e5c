"""benchmarks.evict compares the leaf queue with the scan it replaced: both must evict alike."""
import pytest

from benchmarks.evict import WORKLOADS, ScanningBlockManager
from kvcache import BlockManager


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_leaf_queue_evicts_the_blocks_the_scan_did_in_the_same_order(workload):
    old, new = WORKLOADS[workload](ScanningBlockManager, 64), WORKLOADS[workload](BlockManager, 64)
    assert old.take_ops() == new.take_ops() and new.num_cached_blocks == 64
    while old._evict_one():
        assert new._evict_one()
    assert not new._evict_one() and new.num_cached_blocks == 0
    assert old.take_ops() == new.take_ops()
    new.check_invariants()
