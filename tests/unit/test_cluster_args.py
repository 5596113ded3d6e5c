"""benchmarks.cluster's arrival options: all requests at once unless a rate is given."""
import math

from benchmarks.cluster import parse_args, summary_table

SUMMARY = {"cache_aware": {"output_throughput": 60.0, "request_throughput": 1.9,
                           "median_ttft_ms": 800.0, "p99_ttft_ms": 9000.0,
                           "prefix_hit_rate": 0.87, "failed": 0, "requests_per_replica": [32, 32]}}


def test_requests_arrive_all_at_once_by_default():
    args = parse_args([])
    assert math.isinf(args.request_rate)
    assert "Poisson" not in summary_table(SUMMARY, args)


def test_a_request_rate_gives_poisson_arrivals_and_the_table_says_so():
    args = parse_args(["--request-rate", "20"])
    assert args.request_rate == 20.0
    assert "Poisson arrivals at 20/s" in summary_table(SUMMARY, args)
