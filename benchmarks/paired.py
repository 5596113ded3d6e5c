"""Two servers side by side, interleaved: both up at once, short slices of the same closed-loop
workload alternating A B, B A, ... with the same prompts within a pair; the A/B throughput and
time-to-first-token ratios of each pair and their medians, for machines whose speed drifts
under load (docs/benchmarks.md, "paired"). Workloads: `chat` (short random chat prompts),
`long-prompt` (fresh ~1,500-token prompts, one token out: the prompt's speed) and `rag`
(~1,500-token prompts, ~150 tokens out); --input-len, --output-len and --concurrency override
a workload's sizes.

    python -m benchmarks.paired                       # ours vs llama-server, 4 concurrent
    python -m benchmarks.paired --workload long-prompt --input-len 4000
    python -m benchmarks.paired --a ours --a-env PAGEDLLAMA_FLASH_ATTN=0 --b ours
    python -m benchmarks.paired --a http://127.0.0.1:8000 --b http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from contextlib import ExitStack

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model
from benchmarks.harness.launch import env_items, label, start_server
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import alternate, run_workload

# a workload's sizes: (input tokens, output tokens, concurrency, requests a slice)
WORKLOADS = {"chat": (64, 64, 4, 12), "long-prompt": (1500, 1, 1, 3), "rag": (1500, 150, 1, 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.paired", __doc__, "a", "b", "a_env", "b_env", "model", "threads",
               "parallel", "concurrency", "n_ctx", concurrency=None,
               n_ctx={"default": None, "help": "context per sequence of both servers "
                                               "(default: 2048, or what the workload needs)"})
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    p.add_argument("--slice", type=int, default=None, help="requests in one slice")
    p.add_argument("--pairs", type=int, default=6)
    add(p, "input_len", "output_len", "seed", "temperature", input_len={"default": None},
        output_len={"default": None})
    p.add_argument("--sampling", action="append", default=[], metavar="FIELD=VALUE",
                   help="a sampling field both servers get in every request, e.g. top_p=0.95, "
                        "top_k=40, min_p=0.05 (repeat for more)")
    add(p, "result_file")
    args = p.parse_args(argv)
    input_len, output_len, concurrency, slice_ = WORKLOADS[args.workload]
    args.input_len = args.input_len or input_len
    args.output_len = args.output_len or output_len
    args.concurrency = args.concurrency or concurrency
    args.slice = args.slice or slice_
    needed = -(-(args.input_len + args.output_len + 256) // 256) * 256
    args.n_ctx = args.n_ctx or max(2048, needed)
    return args


SAMPLING_FIELDS = {"top_p": float, "top_k": int, "min_p": float, "seed": int,
                   "presence_penalty": float, "frequency_penalty": float,
                   "repetition_penalty": float}


def parse_sampling(items: list[str]) -> dict:
    """--sampling FIELD=VALUE items as request fields, typed; an unknown field is an error."""
    fields = {}
    for name, value in env_items(items).items():
        if name not in SAMPLING_FIELDS:
            raise SystemExit(f"--sampling: FIELD one of {', '.join(SAMPLING_FIELDS)}, "
                             f"not {name!r}")
        try:
            fields[name] = SAMPLING_FIELDS[name](value)
        except ValueError:
            raise SystemExit(f"--sampling {name}={value}: not a "
                             f"{SAMPLING_FIELDS[name].__name__}") from None
    return fields


def slice_order(pairs: int) -> list[tuple[str, str]]:
    """A B, B A, A B, ...: each server goes first in half of the pairs."""
    return [alternate(("A", "B"), i) for i in range(pairs)]


async def run(bases: dict[str, str], models: dict[str, str], args, sampling: dict) -> dict:
    cal = ds.Calibration()
    slices: dict[str, list[dict]] = {"A": [], "B": []}
    for who in ("A", "B"):   # warm-up, not recorded
        warm = ds.random_dataset(args.concurrency, args.input_len, cal, args.seed, kind="warm")
        await run_workload(bases[who], CHAT, models[who], warm,
                           max_concurrency=args.concurrency, output_len=8, ignore_eos=True,
                           progress=False)
    for i, order in enumerate(slice_order(args.pairs)):
        convs = ds.random_dataset(args.slice, args.input_len, cal, args.seed + i)
        for who in order:
            report, _ = await run_workload(bases[who], CHAT, models[who], convs,
                                           max_concurrency=args.concurrency,
                                           output_len=args.output_len, ignore_eos=True,
                                           temperature=args.temperature,
                                           extra_body=sampling,
                                           progress=False)
            slices[who].append(report)
            print(f"pair {i + 1} {who}: {report['output_throughput']:.1f} tok/s"
                  + (f", {report['failed']} failed" if report["failed"] else ""),
                  file=sys.stderr, flush=True)
    return summarize(slices)


def summarize(slices: dict[str, list[dict]]) -> dict:
    def med(who: str, key: str) -> float:
        return statistics.median(r[key] for r in slices[who])

    out = {who: {"tok_s": [r["output_throughput"] for r in slices[who]],
                 "ttft_ms": [r["median_ttft_ms"] for r in slices[who]],
                 "output_tokens": [r["total_output_tokens"] for r in slices[who]],
                 "median_tok_s": med(who, "output_throughput"),
                 "median_prompt_tok_s": statistics.median(prompt_speed(r) for r in slices[who]),
                 "median_ttft_ms": med(who, "median_ttft_ms"),
                 "median_tpot_ms": med(who, "median_tpot_ms"),
                 "p99_itl_ms": med(who, "p99_itl_ms"),
                 "failed": sum(r["failed"] for r in slices[who])} for who in ("A", "B")}
    ratios = [a / b for a, b in zip(out["A"]["tok_s"], out["B"]["tok_s"]) if b > 0]
    out["ratios"] = ratios
    out["median_ratio"] = statistics.median(ratios) if ratios else None
    ttft = [a / b for a, b in zip(out["A"]["ttft_ms"], out["B"]["ttft_ms"]) if b > 0]
    out["ttft_ratios"] = ttft
    out["median_ttft_ratio"] = statistics.median(ttft) if ttft else None
    return out


def prompt_speed(report: dict) -> float:
    """Prompt tokens a second until the first token, per request (from the mean TTFT)."""
    done, ttft_s = report["completed"], report["mean_ttft_ms"] / 1000
    return report["total_input_tokens"] / (done * ttft_s) if done and ttft_s else 0.0


def table(result: dict, names: dict[str, str], args) -> str:
    w = max(34, *(len(n) + 1 for n in names.values()))   # whole names: settings included
    lines = [f"paired slices · {args.workload} · {args.pairs} pairs of {args.slice} requests · "
             f"{args.concurrency} concurrent · in ~{args.input_len} / out {args.output_len} "
             "tokens (chat) · "
             + ("greedy" if args.temperature == 0 and not args.sampling
                else " ".join([f"temperature={args.temperature:g}", *args.sampling])),
             f"{'':4}{'server':{w}}{'tok/s':>8}{'TTFT p50':>10}{'prompt tok/s':>13}"
             f"{'TPOT p50':>10}{'ITL p99':>9}"]
    for who in ("A", "B"):
        r = result[who]
        lines.append(f"{who:4}{names[who]:{w}}{r['median_tok_s']:8.1f}"
                     f"{r['median_ttft_ms']:8.0f}ms{r['median_prompt_tok_s']:13.1f}"
                     f"{r['median_tpot_ms']:8.1f}ms{r['p99_itl_ms']:7.0f}ms"
                     + (f"  {r['failed']} failed" if r["failed"] else ""))
    for key, what in (("ratios", "A/B tok/s"), ("ttft_ratios", "A/B TTFT")):
        per_pair = " ".join(f"{x:.2f}" for x in result[key])
        median = result["median_" + key.removesuffix("s")]
        lines.append(f"{what} per pair: {per_pair or 'none'}; median "
                     + (f"{median:.3f}x" if median is not None else "n/a"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = parse_sampling(args.sampling)   # a bad field fails before any server starts
    names = {"A": label(args.a, args.a_env), "B": label(args.b, args.b_env)}
    with ExitStack() as stack:
        bases = {"A": start_server(stack, args.a, args.a_env, args),
                 "B": start_server(stack, args.b, args.b_env, args)}
        models = {who: first_model(url) for who, url in bases.items()}
        result = asyncio.run(run(bases, models, args, sampling))
    finish(table(result, names, args), {"benchmark": "paired", "args": vars(args),
                                        "servers": names, **result}, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
