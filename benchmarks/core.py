"""Our server against the engine ceiling: the same random token-id prompts, N streams of M
greedy tokens, through our server and through the raw batched llama_decode loop
(benchmarks/tools/ceiling.py) with the same model, threads and batch shape; server/raw output
tok/s next to the target (docs/benchmarks.md, "engine and core").

    python -m benchmarks.core --streams 1,16 --input-len 64 --output-len 128 --threads 2
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from benchmarks.harness.client import check_loopback, first_model
from benchmarks.harness.datasets import Conversation, token_dataset
from benchmarks.harness.launch import launched, our_server, stop_servers_on_sigterm
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import alternate, run_workload, warmup
from benchmarks.tools.ceiling import Ceiling, CeilingConfig

TARGETS = {1: 0.9, 16: 0.85}   # server/raw output tok/s, by streams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.core", __doc__, "model")
    p.add_argument("--streams", default="1,16", help="comma list of concurrent streams N")
    add(p, "input_len", "output_len", "threads", "n_ctx",
        output_len={"default": 128, "help": "tokens per stream M"},
        n_ctx={"help": "cells per sequence, both sides"})
    p.add_argument("--n-seq-max", type=int, default=16, help="raw loop's sequences")
    add(p, "kv_unified", "attention", "reps", "seed", "base_url",
        kv_unified={"help": "unified KV in the raw loop and the server (default: split)"},
        attention={"help": "attention kernel in the raw loop and the server, set for both "
                           "(default: flash)"},
        base_url={"default": None,
                  "help": "use this running server instead of starting one (same threads!)"})
    add(p, "request_timeout", "time_limit", "result_file", "disable_tqdm",
        time_limit={"help": "per server run"})
    args = p.parse_args(argv)
    args.flash_attn = args.attention == "flash"
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    if not args.streams or any(not 1 <= s <= 256 for s in args.streams):
        p.error("--streams values must be in [1, 256]")
    if not 1 <= args.reps <= 20:
        p.error("--reps must be in [1, 20]")
    return args


def server_run(base: str, model: str, prompts: list[list[int]], args) -> dict:
    convs = [Conversation([p]) for p in prompts]
    report, _ = asyncio.run(run_workload(
        base, "/v1/completions", model, convs, max_concurrency=len(prompts),
        output_len=args.output_len, ignore_eos=True, temperature=0.0, seed=args.seed,
        request_timeout=args.request_timeout, time_limit=args.time_limit,
        progress=not args.disable_tqdm, desc=f"server N={len(prompts)}"))
    return report


def sequences(args) -> int:
    """Sequences the raw loop runs at once, and our server's MAX_SEQS: the same for both."""
    return max(args.n_seq_max, max(args.streams))


def measure(base: str, args) -> dict:
    model_name = first_model(base)
    config = CeilingConfig(n_threads=args.threads, n_ctx_seq=args.n_ctx,
                           n_seq_max=sequences(args),
                           kv_unified=args.kv_unified, flash_attn=args.flash_attn)
    rows = []
    with Ceiling(args.model, config) as ceiling:
        n_vocab = ceiling.model.n_vocab
        ceiling.run(token_dataset(1, 8, n_vocab, args.seed + 99), 4)          # warm up both
        asyncio.run(warmup(base, "/v1/completions", model_name, 1, args.seed))
        for n in args.streams:
            server_reps, raw_reps = [], []
            for rep in range(args.reps):
                prompts = token_dataset(n, args.input_len, n_vocab, args.seed + 1000 * rep + n)
                for side in alternate(("raw", "server"), rep):
                    if side == "raw":
                        raw_reps.append(ceiling.run(prompts, args.output_len).summary())
                    else:
                        server_reps.append(server_run(base, model_name, prompts, args))
            rows.append(row(n, server_reps, raw_reps, args))
            print(f"N={n}: server {rows[-1]['server_output_tok_s']:.1f} tok/s, raw "
                  f"{rows[-1]['raw_output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {"rows": rows}


def row(n: int, server_reps: list[dict], raw_reps: list[dict], args) -> dict:
    med = statistics.median
    server_tps = med(r["output_throughput"] for r in server_reps)
    raw_tps = med(r["output_tok_s"] for r in raw_reps)
    return {
        "streams": n, "input_len": args.input_len, "output_len": args.output_len,
        "server_output_tok_s": server_tps, "raw_output_tok_s": raw_tps,
        "raw_decode_tok_s": med(r["decode_tok_s"] for r in raw_reps),
        "raw_prefill_s": med(r["prefill_s"] for r in raw_reps),
        "server_median_ttft_ms": med(r["median_ttft_ms"] for r in server_reps),
        "server_median_tpot_ms": med(r["median_tpot_ms"] for r in server_reps),
        "ratio": server_tps / raw_tps if raw_tps else 0.0, "target": TARGETS.get(n),
        "server_completed": sum(r["completed"] for r in server_reps),
        "server_failed": sum(r["failed"] for r in server_reps),
        "server_output_tokens": sum(r["total_output_tokens"] for r in server_reps),
        "raw_output_tokens": sum(r["output_tokens"] for r in raw_reps),
        "server_runs": server_reps, "raw_runs": raw_reps,
    }


def table(rows: list[dict]) -> str:
    head = (f"{'streams':>7} {'server tok/s':>12} {'raw tok/s':>10} {'server/raw':>10} "
            f"{'target':>7} {'met':>4} {'raw decode tok/s':>16} {'server TTFT p50 ms':>18}")
    return ruled(head, [table_row(r) for r in rows])


def table_row(r: dict) -> str:
    target = r["target"]
    met = "-" if target is None else ("yes" if r["ratio"] >= target else "no")
    return (f"{r['streams']:>7} {r['server_output_tok_s']:>12.1f} "
            f"{r['raw_output_tok_s']:>10.1f} {r['ratio']:>10.2f} "
            f"{f'≥ {target:.2f}' if target else '-':>7} {met:>4} "
            f"{r['raw_decode_tok_s']:>16.1f} {r['server_median_ttft_ms']:>18.0f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    if args.base_url:
        result = measure(check_loopback(args.base_url), args)
    else:
        env = {"PAGEDLLAMA_KV_UNIFIED": "1" if args.kv_unified else "0",
               "PAGEDLLAMA_FLASH_ATTN": "1" if args.flash_attn else "0",
               "PAGEDLLAMA_MAX_SEQS": str(sequences(args))}
        with launched(our_server(args.model, args.threads, args.n_ctx, env)) as base:
            result = measure(base, args)
    result["config"] = vars(args)
    finish(f"server vs raw llama_decode loop · {Path(args.model).name} · {args.threads} threads "
           f"· {'unified' if args.kv_unified else 'split'} KV · in {args.input_len} / out "
           f"{args.output_len} tokens per stream · {args.reps} rep(s), median\n"
           + table(result["rows"]), result, args.result_file)
    failed = sum(r["server_failed"] for r in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
