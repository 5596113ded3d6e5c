"""The figures benchmarks.neighbor derives from token times and /health samples (no servers)."""
from benchmarks.neighbor import rate, recovery_time, thread_contexts, threads_back, token_bins


class Out:
    def __init__(self, times):
        self.chunk_times = times


def test_tokens_fall_into_one_second_bins_from_the_start():
    bins = token_bins([Out([10.1, 10.2, 11.5]), Out([12.9, 99.0])], start=10.0, seconds=3)
    assert bins == [2, 1, 1, 0, 0]
    assert rate(bins, 0, 2) == 1.5


def test_recovery_needs_a_two_second_window_at_the_mark():
    bins = [100] * 5 + [40] * 5 + [60, 96, 94, 100, 100]
    assert recovery_time(bins, 10, 95.0) == 1.0       # bins 11-12 average 95
    assert recovery_time([100] * 10 + [90] * 5, 10, 95.0) is None   # a drifted after phase


def test_threads_back_is_the_first_sample_with_the_alone_counts_after_the_stop():
    samples = [(0.5, [2]), (5.0, [2]), (10.5, [1]), (19.9, [1]), (20.25, [1]), (20.75, [2])]
    assert threads_back(samples, on=10.0, off=20.0) == 0.75
    assert threads_back(samples[:5], on=10.0, off=20.0) is None
    assert threads_back([(12.0, [1])], on=10.0, off=20.0) is None   # nothing sampled alone


def test_thread_counts_come_from_our_health_answer_only():
    ours = {"models": {"m": {"loaded": True, "contexts": [{"threads": 2}, {"threads": 1}]}}}
    assert [c["threads"] for c in thread_contexts(ours)] == [2, 1]
    assert thread_contexts({"status": "ok"}) == []                            # llama-server
    assert thread_contexts({"models": {"m": {"contexts": [{"running": 0}]}}}) == []
