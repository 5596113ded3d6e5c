"""One context with all threads vs several replicas (contexts) sharing the cores, at several
concurrencies, measured side by side in one run (alternating).

    python -m benchmarks.replicas [--concurrency 1,4,16] [--num-prompts 32]
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model
from benchmarks.harness.launch import launched, our_server
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import run_workload

SETUPS = {"1 context x 2 threads": {"PAGEDLLAMA_CONTEXTS": "1", "PAGEDLLAMA_THREADS": "2"},
          "2 contexts x 1 thread": {"PAGEDLLAMA_CONTEXTS": "2", "PAGEDLLAMA_THREADS": "2"}}


def main(argv: list[str] | None = None) -> int:
    p = parser("benchmarks.replicas", __doc__)
    p.add_argument("--concurrency", default="1,4,16")
    add(p, "num_prompts", "input_len", "output_len", "seed", "result_file",
        num_prompts={"default": 32, "help": "requests per concurrency level"})
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    results: dict[str, dict[int, dict]] = {name: {} for name in SETUPS}
    for level in levels:
        for name, env in SETUPS.items():
            with launched(our_server(threads=2, env=env)) as base:
                model = first_model(base)
                convs = ds.random_dataset(max(args.num_prompts, level), args.input_len,
                                          ds.Calibration(), args.seed + level)
                report, _ = asyncio.run(run_workload(
                    base, "/v1/completions", model, convs, max_concurrency=level,
                    output_len=args.output_len, ignore_eos=True, seed=args.seed, desc=name))
                report.pop("requests", None)
                results[name][level] = report
    names = list(SETUPS)
    print(f"{'concurrency':>11} | " + " | ".join(f"{n:>24}" for n in names) + " | ratio (2nd/1st)")
    for level in levels:
        a, b = (results[n][level]["output_throughput"] for n in names)
        print(f"{level:>11} | {a:>18.1f} tok/s | {b:>18.1f} tok/s | {b / a:.2f}x")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
