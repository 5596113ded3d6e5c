"""Does a token computed as a 1-token piece get the numbers it gets inside a longer piece of its
sequence (a verification piece: the last token and k drafted ones)?

For each attention kernel, context length and piece length: a prompt is computed in 16-token
pieces in two sequences; one then computes the next tokens one at a time (1-token pieces),
the other as one piece of that length with logits for every token; then both compute one more
token alone (the KV the piece wrote). Prints the largest logit difference per row.

    python -m benchmarks.tools.piece_classes [--model PATH] [--threads N]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from engine.llama import Context, ContextConfig
from engine.llama_tricks import Attention
from engine.model import Model

KERNELS = {"flash, row-invariant": (True, Attention.ROW_INVARIANT),
           "flash, reference": (True, Attention.REFERENCE),
           "plain": (False, None)}


def compare(ctx: Context, context_len: int, piece: int, seed: int) -> tuple[float, float]:
    """(largest difference over the piece's rows, over the token computed after it)."""
    rng = np.random.default_rng(seed)
    prompt = [int(x) for x in rng.integers(1000, 30000, context_len)]
    nxt = [int(x) for x in rng.integers(1000, 30000, piece + 1)]
    n = len(prompt)
    for seq in (0, 1):
        ctx.seq_rm(seq, -1, -1)
        for s in range(0, n, 16):
            assert ctx.decode([(seq, prompt[s:s + 16], s, False)]) == 0
    alone = []
    for i, tok in enumerate(nxt[:piece]):
        assert ctx.decode([(0, [tok], n + i, True)]) == 0
        alone.append(ctx.logits(0).copy())
    assert ctx.decode([(1, nxt[:piece], n, piece)]) == 0
    inside = [ctx.logits(i).copy() for i in range(piece)]
    after = []
    for seq in (0, 1):
        assert ctx.decode([(seq, [nxt[piece]], n + piece, True)]) == 0
        after.append(ctx.logits(0).copy())
    rows = max(float(np.abs(a - b).max()) for a, b in zip(alone, inside))
    return rows, float(np.abs(after[0] - after[1]).max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="40,300,700")
    p.add_argument("--pieces", default="2,3,4,5,8,9,16")
    args = p.parse_args(argv)
    model = Model(args.model)
    contexts = [int(x) for x in args.contexts.split(",")]
    pieces = [int(x) for x in args.pieces.split(",")]
    print(f"{args.model}, {args.threads} threads: largest |logit difference| between a token "
          "computed alone (1-token pieces) and inside a piece of k tokens; then of the token "
          "after the piece")
    for name, (flash, path) in KERNELS.items():
        ctx = Context(model, ContextConfig(n_ctx=1024 * 2, n_seq_max=2, n_batch=64,
                                           n_threads=args.threads, kv_unified=False,
                                           flash_attn=flash))
        try:
            if path is not None and ctx.attention is not path:
                ctx.use_attention(path)
            for c in contexts:
                cells = []
                for k in pieces:
                    rows, after = compare(ctx, c, k, seed=c * 100 + k)
                    cells.append(f"k={k}: {rows:.3g}/{after:.3g}")
                print(f"{name:22} context {c:4}: " + "  ".join(cells), flush=True)
        finally:
            ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
