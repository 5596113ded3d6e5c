"""Cost of preempting a sequence and bringing it back: swap its KV state to RAM and restore it
(llama_state_seq_get_data / set_data) vs drop it and recompute its tokens (prefill in chunks of
the prefill grid, as the scheduler would).

    python -m benchmarks.preemption [--lengths 128,512,1024] [--reps 3]
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.options import add, parser
from engine.llama import Context, ContextConfig
from engine.model import Model


def prefill(ctx: Context, seq_id: int, tokens: list[int], chunk: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        last = start + len(piece) == len(tokens)
        if ctx.decode([(seq_id, piece, start, last)]) != 0:
            raise RuntimeError("llama_decode failed")
    return time.perf_counter() - t0


def measure(ctx: Context, n: int, chunk: int, rng: random.Random, vocab: int) -> dict:
    tokens = [rng.randrange(256, vocab) for _ in range(n)]
    ctx.seq_rm(-1, 0, -1)
    recompute = prefill(ctx, 0, tokens, chunk)
    t0 = time.perf_counter()
    size = ctx.save_seq(0, key=1)
    ctx.seq_rm(0, 0, -1)
    t1 = time.perf_counter()
    ctx.restore_seq(1, seq_id=1)
    t2 = time.perf_counter()
    assert ctx.seq_pos_range(1) == (0, n - 1)
    ctx.seq_rm(1, 0, -1)
    return {"tokens": n, "recompute_ms": recompute * 1000, "swap_out_ms": (t1 - t0) * 1000,
            "swap_in_ms": (t2 - t1) * 1000, "swap_ms": (t2 - t0) * 1000, "state_bytes": size}


def main(argv: list[str] | None = None) -> int:
    p = parser("benchmarks.preemption", __doc__, "model", "threads")
    p.add_argument("--lengths", default="128,512,1024")
    p.add_argument("--chunk", type=int, default=16, help="prefill grid (PAGEDLLAMA_PREFILL_CHUNK)")
    add(p, "reps", "result_file", reps={"default": 3, "help": "runs per length (median kept)"})
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = Model(args.model)
    ctx = Context(model, ContextConfig(n_ctx=2 * max(lengths) + 256, n_seq_max=2,
                                       n_batch=max(256, args.chunk), n_threads=args.threads,
                                       kv_unified=False))
    rng = random.Random(0)
    rows = []
    for n in lengths:
        reps = [measure(ctx, n, args.chunk, rng, model.n_vocab) for _ in range(args.reps)]
        row = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        row["speedup"] = row["recompute_ms"] / row["swap_ms"]
        rows.append(row)
    print(f"{'tokens':>7} {'recompute ms':>13} {'swap out+in ms':>15} {'state MB':>9} {'swap is':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['recompute_ms']:>13.1f} {r['swap_ms']:>15.2f} "
              f"{r['state_bytes'] / 2**20:>9.1f} {r['speedup']:>8.0f}x faster")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(rows, indent=2))
    ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
