"""The benchmark workloads' request mixes (pure Python: no model, no server)."""
from collections import Counter

from benchmarks.harness import datasets as ds


def test_shared_prefix_requests_are_spread_evenly_over_the_prefixes_in_a_seeded_order():
    cal = ds.Calibration()
    convs = ds.shared_prefix_dataset(64, 24, 100, 4, cal, seed=0)
    assert Counter(c.tag for c in convs) == {f"prefix-{k}": 16 for k in range(4)}
    tags = [c.tag for c in convs]
    assert tags != sorted(tags)                      # shuffled, not in blocks
    assert tags == [c.tag for c in ds.shared_prefix_dataset(64, 24, 100, 4, cal, seed=0)]
    assert tags != [c.tag for c in ds.shared_prefix_dataset(64, 24, 100, 4, cal, seed=1)]
    # the system prompt goes with the tag
    system = {c.tag: c.system for c in convs}
    assert all(c.system == system[c.tag] for c in convs) and len(set(system.values())) == 4


def test_an_uneven_count_gives_the_first_prefixes_one_request_more():
    convs = ds.shared_prefix_dataset(10, 24, 50, 4, ds.Calibration(), seed=3)
    assert Counter(c.tag for c in convs) == {"prefix-0": 3, "prefix-1": 3, "prefix-2": 2,
                                             "prefix-3": 2}
