"""Measuring llama.cpp itself, for the experiments: timed prefill and decode, generation with and
without the KV cache, next-token logits at every position, thread settings, and a fresh-process
probe of load time and memory.

Note on threads: llama.cpp computes a ubatch of one token with `n_threads` and any larger ubatch
with `n_threads_batch` (llama_context::graph_compute), so decoding 8 sequences at once runs on
`n_threads_batch`, like prefill.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp as C
import numpy as np

from engine.llama import Context, ContextConfig
from engine.model import Model


def make_context(model: Model, n_ctx: int, n_batch: int, n_seq_max: int = 1,
                 n_threads: int = 2, n_threads_batch: int | None = None) -> Context:
    ctx = Context(model, ContextConfig(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch,
                                       n_threads=n_threads))
    set_threads(ctx, n_threads, n_threads if n_threads_batch is None else n_threads_batch)
    return ctx


def set_threads(ctx: Context, n_threads: int, n_threads_batch: int) -> None:
    C.llama_set_n_threads(ctx.ptr, n_threads, n_threads_batch)


def clear(ctx: Context) -> None:
    C.llama_memory_clear(ctx.mem, True)


def _decode(ctx: Context, pieces: list[tuple[int, list[int], int, bool]]) -> None:
    status = ctx.decode(pieces)
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def time_prefill(ctx: Context, tokens: list[int], n_seqs: int = 1) -> float:
    """Seconds for ONE llama_decode that prefills `tokens` into each of sequences 0..n_seqs-1,
    starting from an empty KV cache. The context's n_batch must hold n_seqs * len(tokens)."""
    clear(ctx)
    pieces = [(s, tokens, 0, True) for s in range(n_seqs)]
    t0 = time.perf_counter()
    _decode(ctx, pieces)
    return time.perf_counter() - t0


def time_decode(ctx: Context, prompt: list[int], n_seqs: int, n_steps: int,
                max_seconds: float | None = None) -> tuple[float, int]:
    """Prefill `prompt` into n_seqs sequences (not timed), then time up to n_steps greedy decode
    steps, each one llama_decode of one token per sequence; stop early once max_seconds have
    passed (at least one step runs). Returns (seconds, steps run)."""
    clear(ctx)
    _decode(ctx, [(s, prompt, 0, True) for s in range(n_seqs)])
    last = [len(prompt) * (s + 1) - 1 for s in range(n_seqs)]
    next_tokens = [int(np.argmax(ctx.logits(i))) for i in last]
    pos = len(prompt)
    t0 = time.perf_counter()
    step = 0
    for step in range(1, n_steps + 1):  # noqa: B007 (the steps run are returned)
        _decode(ctx, [(s, [next_tokens[s]], pos, True) for s in range(n_seqs)])
        next_tokens = [int(np.argmax(ctx.logits(s))) for s in range(n_seqs)]
        pos += 1
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    return time.perf_counter() - t0, step


def generate_timed(ctx: Context, prompt: list[int], n_tokens: int, kv_cache: bool = True,
                   on_token: Callable[[], None] | None = None,
                   start: list[int] = ()) -> tuple[list[int], list[float]]:
    """Greedy generation of exactly n_tokens (end-of-generation tokens are not special here),
    with the seconds each token took. Step 0 prefills the prompt. With the KV cache each later
    step evaluates one new token; without it every step clears the sequence and re-evaluates
    the whole context (prompt + tokens so far) in one llama_decode.
    `start`: tokens generated earlier, to continue a run (with the KV cache they are prefilled
    first, untimed). Returns the new tokens and their seconds."""
    clear(ctx)
    out: list[int] = list(start)
    if kv_cache and out:
        _decode(ctx, [(0, prompt + out[:-1], 0, False)])
    seconds: list[float] = []
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        if not out or not kv_cache:
            ctx.seq_rm(0)
            context = prompt + out
            _decode(ctx, [(0, context, 0, True)])
            token = int(np.argmax(ctx.logits(len(context) - 1)))
        else:
            _decode(ctx, [(0, [out[-1]], len(prompt) + len(out) - 1, True)])
            token = int(np.argmax(ctx.logits(0)))
        seconds.append(time.perf_counter() - t0)
        out.append(token)
        if on_token is not None:
            on_token()
    return out[len(start):], seconds


def position_logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    """Logits after every token of `tokens` (shape: len(tokens) x n_vocab, float32), from one
    llama_decode of the whole sequence into seq 0 of an emptied context."""
    n = len(tokens)
    if n > ctx.config.n_batch:
        raise ValueError(f"{n} tokens do not fit n_batch={ctx.config.n_batch}")
    clear(ctx)
    batch = C.llama_batch_init(n, 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        batch.n_tokens = n
        status = C.llama_decode(ctx.ptr, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        ptr = C.llama_get_logits(ctx.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n, ctx.model.n_vocab)).copy()
    finally:
        C.llama_batch_free(batch)


# ---- load time and memory, measured in a fresh process ----------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def probe_load(path: str | Path, n_threads: int = 2, prompt: str = "The capital of France is",
               n_tokens: int = 8) -> dict:
    """Load a model in THIS process and report load seconds, resident memory (MiB) after
    loading, after a context and after generating (weights are mmapped, so pages count once
    they are touched), the peak, and the generated text. Meant to run in a fresh process."""
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    rss0 = _status_kib("VmRSS")
    t0 = time.perf_counter()
    model = Model(path)
    load_s = time.perf_counter() - t0
    rss_load = _status_kib("VmRSS")
    prompt_tokens = model.tokenize(prompt)
    ctx = make_context(model, n_ctx=256, n_batch=64, n_threads=n_threads)
    rss_ctx = _status_kib("VmRSS")
    out, _ = generate_timed(ctx, prompt_tokens, n_tokens)
    result = {
        "load_s": load_s,
        "rss_start_mib": mib(rss0),
        "rss_loaded_mib": mib(rss_load),
        "rss_context_mib": mib(rss_ctx),
        "rss_generated_mib": mib(_status_kib("VmRSS")),
        "rss_peak_mib": mib(_status_kib("VmHWM")),
        "rss_anon_mib": mib(_status_kib("RssAnon")),
        "rss_file_mib": mib(_status_kib("RssFile")),
        "generated_tokens": out,
        "generated_text": model.detokenize(out),
    }
    ctx.close()
    model.close()
    return result


def probe_load_subprocess(path: str | Path, n_threads: int = 2, timeout: float = 300) -> dict:
    """probe_load() in a fresh Python process, so earlier models don't pollute RSS or caches."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tools.bench", "probe-load", str(path), str(n_threads)],
                          capture_output=True, text=True, cwd=root, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"probe of {path} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "probe-load":
        print(json.dumps(probe_load(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)))
    else:
        sys.exit("usage: python -m benchmarks.tools.bench probe-load MODEL.gguf [N_THREADS]")
