"""What a GPU build of llama.cpp changes, measured in one process (scripts/gpu_check.sh probe).

    python -m benchmarks.tools.gpu_probe [MODEL]

Loads the model twice, all layers offloaded and none, and prints:
- whether llama.cpp offers GPU offload, and the load time of each;
- the greedy answers of a few prompts on the GPU and on the CPU, and whether they agree;
- batch invariance on each device: the largest logit difference between a sequence decoded
  alone and the same sequence decoded beside 15 others (the same tokens, the same positions),
  and whether its greedy token changes;
- decode speed on the GPU: one llama_decode of 1, 16 and 64 one-token sequences.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from engine.llama import Context, ContextConfig
from engine.model import Model, gpu_offload_supported, llama_cpp_version

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot",
           "List three prime numbers:"]


def greedy(ctx: Context, tokens: list[int], n: int) -> list[int]:
    ctx.seq_rm(0)
    out: list[int] = []
    ctx.decode([(0, tokens, 0, 1)])
    pos, row = len(tokens), len(tokens) - 1
    for _ in range(n):
        t = int(np.argmax(ctx.logits(row)))
        row = 0
        out.append(t)
        ctx.decode([(0, [t], pos, 1)])
        pos += 1
    return out


def invariance(ctx: Context, model: Model, others: int = 15) -> tuple[float, bool]:
    """Max |logit difference| of sequence 0's last row, alone vs beside `others` sequences."""
    toks = model.tokenize("A long shared story about a lighthouse keeper and the sea. " * 4)
    for s in range(others + 1):
        ctx.seq_rm(s)
    ctx.decode([(0, toks, 0, 1)])
    alone = ctx.logits(len(toks) - 1).copy()
    ctx.seq_rm(0)
    pieces = [(s, toks, 0, 1) for s in range(others + 1)]
    ctx.decode(pieces)
    beside = ctx.logits(len(toks) - 1).copy()
    for s in range(others + 1):
        ctx.seq_rm(s)
    return float(np.max(np.abs(alone - beside))), int(np.argmax(alone)) == int(np.argmax(beside))


def step_ms(ctx: Context, model: Model, n_seqs: int, reps: int = 20) -> float:
    toks = model.tokenize("Hello there, how are you today?")
    for s in range(n_seqs):
        ctx.seq_rm(s)
        ctx.decode([(s, toks, 0, 1)])
    pos = len(toks)
    times = []
    for r in range(reps):
        t = time.perf_counter()
        ctx.decode([(s, [42], pos + r, 1) for s in range(n_seqs)])
        ctx.logits(n_seqs - 1)   # llama_get_logits_ith waits for the result
        times.append(time.perf_counter() - t)
    for s in range(n_seqs):
        ctx.seq_rm(s)
    return 1000 * float(np.median(times[3:]))


def main(path: str = "models/SmolLM2-135M-Instruct.Q4_1.gguf") -> None:
    print("llama-cpp-python", llama_cpp_version(), "| GPU offload offered:",
          gpu_offload_supported())
    answers = {}
    for name, layers in (("gpu", -1), ("cpu", 0)):
        t = time.perf_counter()
        model = Model(path, n_gpu_layers=layers)
        print(f"{name}: model loaded in {time.perf_counter() - t:.2f} s")
        ctx = Context(model, ContextConfig(n_ctx=4096, n_seq_max=64, n_batch=1024, n_threads=4))
        answers[name] = [greedy(ctx, model.tokenize(p), 24) for p in PROMPTS]
        diff, same = invariance(ctx, model)
        print(f"{name}: alone vs beside 15 others: max |dlogit| {diff:.3g}, "
              f"greedy token {'same' if same else 'CHANGED'}")
        if name == "gpu":
            for n in (1, 16, 64):
                print(f"gpu: one llama_decode of {n:2d} one-token sequences: "
                      f"{step_ms(ctx, model, n):.2f} ms")
        ctx.close()
        model.close()
    for p, g, c in zip(PROMPTS, answers["gpu"], answers["cpu"]):
        first = next((i for i, (a, b) in enumerate(zip(g, c)) if a != b), None)
        print(f"greedy {p!r}: GPU and CPU {'agree' if first is None else f'part at token {first}'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
