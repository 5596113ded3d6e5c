"""What a verification piece costs against decoding one token: the ceiling of speculative
decoding on this machine and model.

One sequence, a prompt of --depth tokens; then, many times over, one llama_decode of a piece of
k tokens with logits for each (the last token and k - 1 drafted ones), removed again after. The
median time of each k, per token, and k times a 1-token call over a k-token call: how much
faster a step would be if all k - 1 drafted tokens were accepted, before the step's Python.

    python -m benchmarks.tools.piece_cost [--model PATH] [--threads N] [--depth 400]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from engine.llama import Context, ContextConfig
from engine.model import Model

PIECES = (1, 2, 3, 4, 5, 7, 9, 13, 17)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.piece_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depth", type=int, default=400, help="prompt tokens before the pieces")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    model = Model(args.model)
    ctx = Context(model, ContextConfig(n_ctx=args.depth + 64, n_seq_max=1,
                                       n_batch=512, n_threads=args.threads,
                                       flash_attn=True, n_outputs_max=max(PIECES)))
    rng = np.random.default_rng(1)
    vocab = model.n_vocab
    prompt = [int(t) for t in rng.integers(vocab // 8, vocab // 2, args.depth)]
    for s in range(0, len(prompt), 256):
        assert ctx.decode([(0, prompt[s:s + 256], s, False)]) == 0
    times = {}
    for k in PIECES:
        runs = []
        for _ in range(args.repeats):
            piece = [int(t) for t in rng.integers(vocab // 8, vocab // 2, k)]
            t0 = time.perf_counter()
            assert ctx.decode([(0, piece, args.depth, k)]) == 0
            runs.append(time.perf_counter() - t0)
            ctx.seq_rm(0, args.depth, -1)
        times[k] = statistics.median(runs)
    print(f"{model.path.name}, {args.threads} threads, pieces {args.depth} tokens deep")
    print(" k   ms/call  ms/token  k x 1-token call / k-token call")
    for k, t in times.items():
        print(f"{k:2d}  {t * 1e3:8.2f}  {t * 1e3 / k:8.2f}  {k * times[1] / t:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
