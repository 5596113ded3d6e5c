"""What each attention path costs, in this process: a long prompt computed in pieces of a given
size, and decode steps of S sequences at a given context, for plain attention and for flash
attention on each of ggml's paths (row-invariant, the reference path, ggml's default by the
batch). The paths are taken in turns, so that the machine's drift spreads over all of them.

    python -m benchmarks.attention --prompt-len 1500 --pieces 16,256 --decode 1:100,16:1000
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import add, parser
from engine.llama import Context, ContextConfig
from engine.llama_tricks import Attention, has_row_invariant_attention
from engine.model import Model

PATHS = ["plain", Attention.ROW_INVARIANT.value, Attention.REFERENCE.value,
         Attention.GGML_DEFAULT.value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.attention", __doc__, "model", "threads")
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument("--prompt-len", type=int, default=1500, help="tokens of the prompt")
    p.add_argument("--pieces", default="16,256",
                   help="piece sizes the prompt is computed in (tokens per llama_decode)")
    p.add_argument("--decode", default="1:100,16:100,1:1500,8:1500",
                   help="decode shapes SEQUENCES:CONTEXT, each timed over --steps steps")
    p.add_argument("--steps", type=int, default=16, help="decode steps a shape is timed over")
    add(p, "rounds", "seed", "result_file", rounds={"default": 2})
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    if any(x not in PATHS for x in args.paths):
        p.error(f"--paths: of {', '.join(PATHS)}")
    if Attention.ROW_INVARIANT.value in args.paths and not has_row_invariant_attention():
        p.error("this llama.cpp has no row-invariant attention (build it with make setup)")
    args.pieces = [int(x) for x in args.pieces.split(",") if x]
    args.decode = [tuple(int(v) for v in x.split(":")) for x in args.decode.split(",") if x]
    return args


class Bench:
    """One context per path (plain needs a context without flash attention)."""

    def __init__(self, model: Model, args: argparse.Namespace):
        self.args = args
        seqs = max([s for s, _ in args.decode] + [1])
        cells = max([args.prompt_len] + [c for _, c in args.decode]) + args.steps + 16
        self.n_batch = max(args.pieces + [seqs])
        self.contexts: dict[str, Context] = {}
        for path in args.paths:
            ctx = Context(model, ContextConfig(
                n_ctx=cells * seqs, n_seq_max=seqs, n_batch=self.n_batch,
                n_threads=args.threads, kv_unified=False, flash_attn=path != "plain"))
            if path != "plain":
                ctx.use_attention(Attention(path))
            self.contexts[path] = ctx
        rng = random.Random(args.seed)
        self.tokens = [rng.randrange(1000, model.n_vocab - 1000) for _ in range(cells)]

    def close(self) -> None:
        for ctx in self.contexts.values():
            ctx.close()

    def prompt(self, path: str, piece: int) -> float:
        """Seconds to compute the prompt in pieces of `piece` tokens (the last one shorter)."""
        ctx, n = self.contexts[path], self.args.prompt_len
        ctx.seq_rm(0, -1, -1)
        t0 = time.perf_counter()
        for s in range(0, n, piece):
            chunk = self.tokens[s:min(n, s + piece)]
            assert ctx.decode([(0, chunk, s, s + len(chunk) >= n)]) == 0
        return time.perf_counter() - t0

    def decode(self, path: str, seqs: int, context: int) -> float:
        """Milliseconds a decode step of `seqs` sequences at `context` tokens takes (median)."""
        ctx = self.contexts[path]
        for s in range(seqs):
            ctx.seq_rm(s, -1, -1)
            for p in range(0, context, self.n_batch):
                chunk = self.tokens[p:min(context, p + self.n_batch)]
                assert ctx.decode([(s, chunk, p, False)]) == 0
        times = []
        for step in range(self.args.steps):
            pieces = [(s, [self.tokens[context + step]], context + step, True)
                      for s in range(seqs)]
            t0 = time.perf_counter()
            assert ctx.decode(pieces) == 0
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)


def table(rows: list[dict], paths: list[str]) -> str:
    head = f"{'measure':<26}" + "".join(f"{p:>15}" for p in paths)
    lines = []
    for r in rows:
        unit = r["unit"]
        cells = "".join(f"{r['values'][p]:>15.1f}" for p in paths)
        lines.append(f"{r['name'] + ' (' + unit + ')':<26}{cells}")
    return ruled(head, lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Model(args.model)
    bench = Bench(model, args)
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            order = args.paths if r % 2 == 0 else args.paths[::-1]
            for path in order:
                for piece in args.pieces:
                    s = bench.prompt(path, piece)
                    samples.setdefault((f"prompt, {piece}-token pieces", path), []).append(
                        args.prompt_len / s)
                for seqs, context in args.decode:
                    samples.setdefault((f"decode {seqs} x ctx {context}", path), []).append(
                        bench.decode(path, seqs, context))
                print(f"round {r + 1}: {path} done", file=sys.stderr, flush=True)
    finally:
        bench.close()
        model.close()
    names = list(dict.fromkeys(name for name, _ in samples))
    rows = [{"name": name, "unit": "tok/s" if name.startswith("prompt") else "ms/step",
             "values": {p: statistics.median(samples[(name, p)]) for p in args.paths},
             "samples": {p: samples[(name, p)] for p in args.paths}} for name in names]
    result = {"config": {k: v for k, v in vars(args).items() if k != "decode"},
              "decode": args.decode, "rows": rows}
    finish(f"attention paths · {Path(args.model).name} · {args.threads} threads · prompt "
           f"{args.prompt_len} tokens · median of {args.rounds} rounds\n"
           + table(rows, args.paths), result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
