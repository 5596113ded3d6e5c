"""Prefix caching, side by side in one run: the TTFT of a request whose ~--prefix-len-token
prefix is cached against the same request cold, and a shared-prefix workload against our server
with prefix caching on and off (throughput ratio, hit rate), each next to its target.

    python -m benchmarks.prefix [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

import httpx

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model, make_client, payload, send
from benchmarks.harness.launch import launched, our_server
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import run_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.prefix", __doc__, "threads", "prefix_len",
               prefix_len={"default": 1000, "help": "tokens of the cached prefix (TTFT)"})
    p.add_argument("--ttft-reps", type=int, default=5)
    add(p, "shared_len", "num_prefixes", "num_prompts", "concurrency", "output_len", "rounds",
        "seed", "quick", "result_file", output_len=32,
        rounds={"help": "on/off alternations of the workload"})
    args = p.parse_args(argv)
    if args.quick:
        args.prefix_len, args.ttft_reps, args.shared_len = 300, 2, 200
        args.num_prefixes, args.num_prompts, args.concurrency, args.output_len = 2, 8, 4, 8
    return args


def words_for(tokens: int) -> int:
    return ds.Calibration().words_for(tokens, with_overhead=False)


async def one(base: str, model: str, messages: list[dict], max_tokens: int):
    async with make_client(1, 600.0) as client:
        body = payload(model, messages, True, max_tokens, True)
        out = await send(client, base + CHAT, body, True, 600.0)
    if not out.ok:
        raise RuntimeError(out.error)
    return out


async def ttft_pairs(base: str, model: str, args) -> list[dict]:
    """Per repetition: a new ~prefix_len document (cold), then the same document with another
    question (cached)."""
    rng = random.Random(f"prefix-ttft:{args.seed}")
    rows = []
    for i in range(args.ttft_reps):
        doc = f"Report {i}. " + ds.random_text(rng, words_for(args.prefix_len))
        cold = await one(base, model, [{"role": "system", "content": doc},
                                       {"role": "user", "content": "Summarize the report."}], 4)
        warm = await one(base, model, [{"role": "system", "content": doc},
                                       {"role": "user", "content": "List its main words."}], 4)
        rows.append({"prompt_tokens": cold.prompt_tokens, "cold_ttft_s": cold.ttft,
                     "cached_ttft_s": warm.ttft, "cached_tokens": warm.cached_tokens})
    return rows


def prefix_counters(base: str) -> tuple[int, int]:
    health = httpx.get(f"{base}/health", timeout=10).json()
    ctx = [c for m in health["models"].values() for c in m["contexts"]]
    return (sum(c["prefix_hit_tokens"] for c in ctx), sum(c["prefix_query_tokens"] for c in ctx))


async def shared_workload(base: str, model: str, args, seed: int) -> dict:
    convs = ds.shared_prefix_dataset(args.num_prompts, 24, args.shared_len, args.num_prefixes,
                                     ds.Calibration(), seed)
    hits0, queries0 = prefix_counters(base)
    report, _ = await run_workload(base, CHAT, model, convs, max_concurrency=args.concurrency,
                                   output_len=args.output_len, ignore_eos=True, seed=seed,
                                   desc="shared-prefix")
    hits1, queries1 = prefix_counters(base)
    report.pop("requests", None)
    report["prefix_hit_rate"] = (hits1 - hits0) / max(1, queries1 - queries0)
    return report


def run(args) -> dict:
    result: dict = {"config": vars(args).copy(), "ttft": [], "workload": {"on": [], "off": []}}
    servers = {"on": our_server(threads=args.threads, env={"PAGEDLLAMA_PREFIX_CACHING": "1"}),
               "off": our_server(threads=args.threads, env={"PAGEDLLAMA_PREFIX_CACHING": "0"})}
    with launched(servers["on"]) as base:
        model = first_model(base)
        result["ttft"] = asyncio.run(ttft_pairs(base, model, args))
    for r in range(args.rounds):
        for mode in ("on", "off"):
            with launched(servers[mode]) as base:
                report = asyncio.run(shared_workload(base, model, args, args.seed + r))
                result["workload"][mode].append(report)
    cold = statistics.median(x["cold_ttft_s"] for x in result["ttft"])
    warm = statistics.median(x["cached_ttft_s"] for x in result["ttft"])
    on = statistics.median(x["output_throughput"] for x in result["workload"]["on"])
    off = statistics.median(x["output_throughput"] for x in result["workload"]["off"])
    result["summary"] = {
        "prompt_tokens": result["ttft"][0]["prompt_tokens"], "cold_ttft_s": cold,
        "cached_ttft_s": warm, "ttft_ratio": warm / cold,
        "throughput_on": on, "throughput_off": off, "throughput_ratio": on / off,
        "ttft_p99_on": statistics.median(x["p99_ttft_ms"] for x in result["workload"]["on"]),
        "ttft_p99_off": statistics.median(x["p99_ttft_ms"] for x in result["workload"]["off"]),
        "hit_rate": statistics.median(x["prefix_hit_rate"] for x in result["workload"]["on"])}
    return result


def summary_table(s: dict, args) -> str:
    return "\n".join([
        f"cached vs cold TTFT ({s['prompt_tokens']}-token prompt, median of {args.ttft_reps}): "
        f"{s['cached_ttft_s'] * 1000:.0f} ms vs {s['cold_ttft_s'] * 1000:.0f} ms = "
        f"{s['ttft_ratio']:.2f}x   (target <= 0.2x)",
        f"shared-prefix workload ({args.num_prefixes} x ~{args.shared_len}-token system prompts, "
        f"{args.num_prompts} requests, {args.concurrency} concurrent, {args.output_len} out):",
        f"  output tok/s caching on {s['throughput_on']:.1f} vs off {s['throughput_off']:.1f} = "
        f"{s['throughput_ratio']:.2f}x   (target >= 3x)",
        f"  TTFT p99 on {s['ttft_p99_on']:.0f} ms vs off {s['ttft_p99_off']:.0f} ms; "
        f"prefix hit rate {s['hit_rate'] * 100:.0f}% of prompt tokens"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(summary_table(result["summary"], args))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
