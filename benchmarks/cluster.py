"""Routing policies in front of several replicas (`make cluster`): the shared-prefix workload
through the cluster's router (HAProxy) to pagedllama replicas on this machine, a fresh cluster per policy;
throughput, TTFT, the prefix hit rate and the requests each replica served
(docs/scaling-out.md has the figures).

    python -m benchmarks.cluster [--rounds 2] [--result-file results/cluster.json]
    python -m benchmarks.cluster --policies session,least_conn    # by key, by load
    python -m benchmarks.cluster --scenario sessions [--kill-halfway]   # multi-turn sessions

`session` routes by a key the client names (here each request's system prompt tag in the
x-session-id header; in the sessions scenario the session's id); `least_conn` and
`round_robin` ignore it. The sessions scenario (benchmarks/cluster_sessions.py): sessions of
several turns with a context each, the replicas sharing one prefix-cache disk directory,
optionally one replica killed halfway.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import cluster_sessions
from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import by_policy, run_workload
from cluster.launch import ROUTING_KEY_HEADER, Cluster, ClusterSpec, free_cluster_port

COUNTERS = ("pagedllama:prefix_cache_hits_total", "pagedllama:prefix_cache_queries_total",
            "pagedllama:request_success_total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.cluster", __doc__)
    p.add_argument("--replicas", type=int, default=2)
    add(p, "threads", threads={"default": 1, "help": "llama.cpp threads per replica"})
    p.add_argument("--scenario", choices=("shared-prefix", "sessions"), default="shared-prefix")
    p.add_argument("--policies", default=None,
                   help="front-door policies, comma-separated, passed to cluster.launch as they "
                        "are (default: session,round_robin; sessions: "
                        "session,least_conn,round_robin)")
    add(p, "num_prefixes", "shared_len", "num_prompts", "concurrency", "output_len",
        "request_rate", output_len=32,
        request_rate={"help": "requests a second, Poisson arrivals (default: inf, all at once, "
                              "at most --concurrency in flight)"})
    p.add_argument("--router-args", default="",
                   help="more haproxy command-line flags")
    p.add_argument("--no-pin", action="store_true", help="do not pin replicas to their cores")
    add(p, "rounds", "seed", "quick", "request_timeout", "result_file",
        rounds={"help": "alternations of the policies"})
    cluster_sessions.add_arguments(p)
    args = p.parse_args(argv)
    if args.policies is None:
        args.policies = ("session,least_conn,round_robin" if args.scenario == "sessions"
                         else "session,round_robin")
    if args.quick:
        args.num_prefixes, args.shared_len, args.num_prompts = 2, 150, 8
        args.concurrency, args.output_len = 4, 4
    return args


def replica_counters(urls: list[str]) -> list[dict[str, float]]:
    """Per replica, the sum over labels of each counter in COUNTERS, read from /metrics."""
    out = []
    for url in urls:
        sums = dict.fromkeys(COUNTERS, 0.0)
        text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
        out.append(sums)
    return out


STEP_PARTS = ("decode_s", "plan_s", "sample_s", "deliver_s")


def replica_health(url: str) -> dict:
    """From a replica's /health, summed over its contexts: how often the contention governor
    changed threads (it runs only with 2+), and the seconds its step loops spent so far inside
    llama_decode and in their Python parts (`step_ms` holds per-step means and the step count)."""
    health = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
    contexts = [c for m in health["models"].values() for c in m["contexts"]]
    out = {"thread_changes": sum(c["thread_changes"] for c in contexts)}
    for part in STEP_PARTS:
        out[part] = sum(c["step_ms"][part] * c["step_ms"]["steps"] for c in contexts) / 1000
    return out


def _delta(after: list[dict], before: list[dict], name: str) -> list[float]:
    return [a[name] - b[name] for a, b in zip(after, before)]


def conversations(args, seed: int) -> list[ds.Conversation]:
    """The workload's requests, in the order the seed shuffles."""
    return ds.shared_prefix_dataset(args.num_prompts, 24, args.shared_len, args.num_prefixes,
                                    ds.Calibration(), seed)


async def _workload(url: str, model: str, args, seed: int, policy: str) -> dict:
    convs = conversations(args, seed)
    # the session policy routes by a key the client names: here the system prompt's tag
    headers_for = ((lambda conv: {ROUTING_KEY_HEADER: conv.tag}) if policy == "session" else None)
    report, _ = await run_workload(url, CHAT, model, convs, max_concurrency=args.concurrency,
                                   request_rate=args.request_rate,
                                   output_len=args.output_len, ignore_eos=True, seed=seed,
                                   desc="shared-prefix", headers_for=headers_for)
    report.pop("requests", None)
    return report


def run_policy(policy: str, args, seed: int) -> dict:
    spec = ClusterSpec(replicas=args.replicas, policy=policy,
                       port=free_cluster_port(args.replicas),
                       replica_env={"PAGEDLLAMA_THREADS": str(args.threads),
                                    "PAGEDLLAMA_LOG_LEVEL": "warning"},
                       router_args=args.router_args.split(), pin=not args.no_pin)
    with Cluster(spec) as cluster:
        urls = [r.url for r in cluster.replicas]
        model = first_model(urls[0])
        before, health_before = replica_counters(urls), [replica_health(u) for u in urls]
        report = asyncio.run(_workload(spec.url, model, args, seed, policy))
        after, health_after = replica_counters(urls), [replica_health(u) for u in urls]
    report["thread_changes_per_replica"] = [h["thread_changes"] for h in health_after]
    # where each replica's run went: llama.cpp's compute, or the step loop's Python around it
    report["decode_s_per_replica"] = _delta(health_after, health_before, "decode_s")
    report["step_python_s_per_replica"] = [
        sum(a[p] - b[p] for p in STEP_PARTS[1:]) for a, b in zip(health_after, health_before)]
    hits = sum(_delta(after, before, COUNTERS[0]))
    queries = sum(_delta(after, before, COUNTERS[1]))
    report["prefix_hit_rate"] = hits / queries if queries else 0.0
    report["requests_per_replica"] = [int(x) for x in _delta(after, before, COUNTERS[2])]
    report["policy"] = policy
    return report


def _describe(report: dict) -> str:
    return (f"{report['policy']}: {report['output_throughput']:.1f} output tok/s, hit rate "
            f"{report['prefix_hit_rate'] * 100:.0f}%, requests per replica "
            f"{report['requests_per_replica']}, llama_decode "
            f"{_seconds(report['decode_s_per_replica'])} and the step loop's Python "
            f"{_seconds(report['step_python_s_per_replica'])} of a "
            f"{report['duration_s']:.1f} s run")


def run(args) -> dict:
    result = by_policy(args, run_policy, _describe)
    result["summary"] = {p: _median_of(runs) for p, runs in result["runs"].items()}
    return result


def _seconds(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values) + " s"


def _median_of(runs: list[dict]) -> dict:
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "prefix_hit_rate", "failed")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {
        "requests_per_replica": runs[0]["requests_per_replica"]}


def summary_table(summary: dict, args) -> str:
    lines = [f"{args.replicas} replicas x {args.threads} thread(s) behind HAProxy; "
             f"{args.num_prefixes} x ~{args.shared_len}-token prefixes, {args.num_prompts} "
             f"requests, {args.concurrency} concurrent, {args.output_len} out; median of "
             f"{args.rounds} round(s)"
             + (f", Poisson arrivals at {args.request_rate:g}/s" if math.isfinite(args.request_rate)
                else ""),
             f"{'policy':<13} {'out tok/s':>9} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'hit rate':>8} {'failed':>6}  requests per replica"]
    for policy, s in summary.items():
        lines.append(f"{policy:<13} {s['output_throughput']:>9.1f} {s['request_throughput']:>6.2f} "
                     f"{s['median_ttft_ms'] / 1000:>8.1f}s {s['p99_ttft_ms'] / 1000:>8.1f}s "
                     f"{s['prefix_hit_rate'] * 100:>7.0f}% {s['failed']:>6.0f}  "
                     f"{s['requests_per_replica']}")
    for policy in ("session", "least_conn"):
        if {policy, "round_robin"} <= summary.keys():
            ratio = summary[policy]["output_throughput"] / summary["round_robin"]["output_throughput"]
            lines.append(f"{policy} / round_robin throughput: {ratio:.2f}x   (target >= 1.2x, "
                         f"with a hit rate >= 80%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario == "sessions":
        result = cluster_sessions.run(args)
        finish(cluster_sessions.summary_table(result, args), result, args.result_file)
        return 0
    result = run(args)
    finish(summary_table(result["summary"], args), result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
