"""Serving benchmark for an OpenAI-compatible server, modelled on `vllm bench serve`: streamed
requests from a dataset (random, shared-prefix, chat), TTFT, TPOT, ITL, end-to-end latency and
throughput; bounded, and loopback servers only (docs/benchmarks.md, "serve").

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --dataset random \\
        --num-prompts 64 --max-concurrency 16 --input-len 64 --output-len 64 --ignore-eos
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import NotLoopback
from benchmarks.harness.metrics import table, write_result
from benchmarks.harness.options import TARGET, add, parser
from benchmarks.harness.workload import MAX_CONCURRENCY, MAX_PROMPTS, prepare, run_workload


def build_dataset(name: str, n: int, input_len: int, cal: ds.Calibration, seed: int, *,
                  prefix_len: int = 512, num_prefixes: int = 4, turns: int = 3):
    if name == "random":
        return ds.random_dataset(n, input_len, cal, seed)
    if name == "shared-prefix":
        return ds.shared_prefix_dataset(n, input_len, prefix_len, num_prefixes, cal, seed)
    if name == "chat":
        return ds.chat_dataset(n, input_len, turns, cal, seed)
    raise ValueError(f"unknown dataset {name!r}")


# ---- the command --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.serve", __doc__, *TARGET)
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "chat"])
    p.add_argument("--num-prompts", type=int, default=64, help="requests (chat: all turns)")
    p.add_argument("--max-concurrency", type=int, default=16)
    add(p, "request_rate", "input_len", "output_len", "prefix_len", "num_prefixes",
        input_len={"help": "prompt tokens (shared-prefix: the unique question; chat: each user "
                           "turn)"},
        prefix_len={"help": "shared-prefix: system prompt tokens"},
        num_prefixes={"help": "shared-prefix: distinct prefixes"})
    p.add_argument("--turns", type=int, default=3, help="chat: user turns per conversation")
    add(p, "ignore_eos", "temperature", "seed", "warmup", "calibrate")
    p.add_argument("--sweep-concurrency", default=None,
                   help="comma list, e.g. 1,4,16: one run per value, and a PNG plot")
    add(p, "result_file")
    p.add_argument("--plot-file", default=None,
                   help="sweep plot (default: the result file with .png, or serve-sweep.png)")
    add(p, "request_timeout", "time_limit", "disable_tqdm")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if not 1 <= args.max_concurrency <= MAX_CONCURRENCY:
        p.error(f"--max-concurrency must be in [1, {MAX_CONCURRENCY}]")
    return args


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(not 1 <= v <= MAX_CONCURRENCY for v in values):
        raise ValueError(f"bad --sweep-concurrency {text!r}")
    return values


async def run(args: argparse.Namespace) -> dict:
    base, model, cal = await prepare(args)
    sweep = (concurrency_list(args.sweep_concurrency) if args.sweep_concurrency
             else [args.max_concurrency])
    runs = []
    for i, c in enumerate(sweep):
        # fresh prompts for every run: the previous run's prompts are in the prefix cache
        convs = build_dataset(args.dataset, args.num_prompts, args.input_len, cal,
                              args.seed + 1000 * i,
                              prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                              turns=args.turns)
        report, _ = await run_workload(
            base, args.endpoint, model, convs, max_concurrency=c, request_rate=args.request_rate,
            output_len=args.output_len, ignore_eos=args.ignore_eos,
            temperature=args.temperature, seed=args.seed, request_timeout=args.request_timeout,
            time_limit=args.time_limit, progress=not args.disable_tqdm,
            desc=f"{args.dataset} c={c}")
        runs.append(report)
        print(table(report, f"{args.dataset} · concurrency {c}"), flush=True)
    config = dict(vars(args))
    config.update(model=model, base_url=base, request_rate=str(args.request_rate))
    return {"config": config, "calibration": vars(cal), "runs": runs}


def plot_sweep(result: dict, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    c = [r["max_concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(c, [r["output_throughput"] for r in runs], "o-")
    axes[0].set_ylabel("output tok/s")
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        axes[1].plot(c, [r[key] / 1000 for r in runs], "o-", label=label)
    axes[1].set_ylabel("seconds")
    for key, label in (("median_tpot_ms", "TPOT p50"), ("p99_itl_ms", "ITL p99"),
                       ("max_itl_ms", "ITL max")):
        axes[2].plot(c, [r[key] for r in runs], "o-", label=label)
    axes[2].set_ylabel("ms")
    cfg = result["config"]
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(v) for v in c])
        ax.set_xlabel("max concurrency")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"{cfg['model']} · {cfg['dataset']} · in {cfg['input_len']} / out "
                 f"{cfg['output_len']} tokens · {cfg['endpoint']}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_concurrency:
        try:
            concurrency_list(args.sweep_concurrency)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        result = asyncio.run(run(args))
    except (NotLoopback, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.result_file:
        write_result(args.result_file, result)
    if args.sweep_concurrency:
        plot = args.plot_file or (str(Path(args.result_file).with_suffix(".png"))
                                  if args.result_file else "serve-sweep.png")
        print(f"wrote {plot_sweep(result, plot)}")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
