"""The engine ceiling for a batch shape: a raw batched llama_decode loop in this process
(benchmarks/tools/ceiling.py), no server. Prefill and decode tok/s at each batch size.

    python -m benchmarks.engine --batch-sizes 1,2,4,8,16,32 --input-len 64 --output-len 64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness.datasets import token_dataset
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import add, parser
from benchmarks.tools.ceiling import Ceiling, CeilingConfig

MAX_BATCH = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.engine", __doc__, "model")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    add(p, "input_len", "output_len", "threads",
        input_len={"help": "prompt tokens per sequence"},
        output_len={"help": "generated tokens per sequence"})
    p.add_argument("--n-batch", type=int, default=256, help="tokens per llama_decode")
    add(p, "n_ctx", "kv_unified", "attention", "reps", "seed", "result_file",
        n_ctx={"default": 0,
               "help": "cells per sequence (default: input + output rounded up to 256)"},
        attention={"help": "attention kernel (default: flash, what the server picks for a "
                           "file without K-quants, such as the default model)"},
        reps={"help": "runs per batch size; the best is kept"})
    args = p.parse_args(argv)
    args.flash_attn = args.attention == "flash"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or any(not 1 <= b <= MAX_BATCH for b in args.batch_sizes):
        p.error(f"--batch-sizes must be in [1, {MAX_BATCH}]")
    if args.input_len < 1 or args.output_len < 1 or not 1 <= args.reps <= 20:
        p.error("--input-len and --output-len must be >= 1, --reps in [1, 20]")
    return args


def table(rows: list[dict]) -> str:
    head = f"{'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'output tok/s':>13} " \
           f"{'step p50 ms':>12} {'step p99 ms':>12}"
    return ruled(head, [f"{r['n_streams']:>5} {r['prefill_tok_s']:>14.1f} "
                        f"{r['decode_tok_s']:>13.1f} {r['output_tok_s']:>13.1f} "
                        f"{r['median_step_ms']:>12.1f} {r['p99_step_ms']:>12.1f}" for r in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n_ctx = args.n_ctx or -(-(args.input_len + args.output_len) // 256) * 256
    config = CeilingConfig(n_threads=args.threads, n_seq_max=max(16, max(args.batch_sizes)),
                           n_ctx_seq=n_ctx, n_batch=args.n_batch, kv_unified=args.kv_unified,
                           flash_attn=args.flash_attn)
    rows = []
    with Ceiling(args.model, config) as ceiling:
        n_vocab = ceiling.model.n_vocab
        ceiling.run(token_dataset(1, 8, n_vocab, args.seed + 99), 4)   # warm up (page in weights)
        for b in args.batch_sizes:
            best = None
            for rep in range(args.reps):
                prompts = token_dataset(b, args.input_len, n_vocab, args.seed + 1000 * rep + b)
                run = ceiling.run(prompts, args.output_len).summary()
                if best is None or run["output_tok_s"] > best["output_tok_s"]:
                    best = run
            rows.append(best)
            print(f"batch {b}: prefill {best['prefill_tok_s']:.1f} tok/s, decode "
                  f"{best['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    result = {"config": {**vars(args), "n_ctx_seq": n_ctx, "n_seq_max": config.n_seq_max},
              "runs": rows}
    finish(f"engine ceiling · {Path(args.model).name} · {args.threads} threads · "
           f"{'unified' if args.kv_unified else 'split'} KV · in {args.input_len} / out "
           f"{args.output_len} tokens per sequence\n" + table(rows), result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
