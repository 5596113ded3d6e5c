"""The engine ceiling: a bare batched llama_decode loop, no scheduler, no server.

N sequences, each with its own prompt, are prefilled (prompts packed into llama_decode calls of
up to n_batch tokens, each prompt in one piece when it fits) and then decoded together: one
llama_decode per step with one token per sequence, greedy (argmax of the logits), no stop on
end-of-generation. It is what a server built on these kernels can at best approach for the same
batch shape. benchmarks/engine.py and benchmarks/core.py drive it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.llama import Context, ContextConfig
from engine.model import Model


@dataclass
class CeilingConfig:
    n_threads: int = 2
    n_seq_max: int = 16
    n_ctx_seq: int = 2048          # cells per sequence (the server's PAGEDLLAMA_N_CTX)
    n_batch: int = 256             # tokens per llama_decode (the server's max batch tokens)
    kv_unified: bool = False       # split KV, as the server's default
    flash_attn: bool = True        # on, as the server's default for files without K-quants


@dataclass
class CeilingRun:
    n_streams: int
    prompt_tokens: int             # all sequences together
    output_tokens: int             # all sequences together (the first comes from prefill)
    prefill_s: float
    decode_s: float
    decode_steps: int
    step_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode steps only: tokens after the first, per second of decode."""
        n = self.n_streams * self.decode_steps
        return n / self.decode_s if self.decode_s else 0.0

    @property
    def output_tok_s(self) -> float:
        """All output tokens over prefill + decode: comparable to a server's output tok/s."""
        total = self.prefill_s + self.decode_s
        return self.output_tokens / total if total else 0.0

    def summary(self) -> dict:
        steps = np.asarray(self.step_s or [0.0]) * 1000
        return {"n_streams": self.n_streams, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "decode_steps": self.decode_steps,
                "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s,
                "output_tok_s": self.output_tok_s, "median_step_ms": float(np.median(steps)),
                "p99_step_ms": float(np.percentile(steps, 99))}


class Ceiling:
    """One model and one context, reused across runs (memory is cleared between runs)."""

    def __init__(self, model_path: str | Path, config: CeilingConfig | None = None):
        self.config = config or CeilingConfig()
        c = self.config
        self.model = Model(model_path)
        self.context = Context(self.model, ContextConfig(
            n_ctx=c.n_ctx_seq * c.n_seq_max, n_seq_max=c.n_seq_max, n_batch=c.n_batch,
            n_threads=c.n_threads, kv_unified=c.kv_unified, flash_attn=c.flash_attn))

    def close(self) -> None:
        self.context.close()
        self.model.close()

    def __enter__(self) -> Ceiling:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def clear(self) -> None:
        for s in range(self.config.n_seq_max):
            self.context.seq_rm(s, 0, -1)

    def run(self, prompts: list[list[int]], max_tokens: int) -> CeilingRun:
        """Prefill every prompt, then decode until each sequence has max_tokens output tokens."""
        n = len(prompts)
        if not 1 <= n <= self.config.n_seq_max:
            raise ValueError(f"{n} sequences: the context has {self.config.n_seq_max}")
        if max(len(p) for p in prompts) + max_tokens > self.context.n_ctx_seq:
            raise ValueError("prompt + max_tokens exceeds the cells per sequence")
        self.clear()
        outputs: list[list[int]] = [[] for _ in range(n)]
        t0 = time.perf_counter()
        for batch in self._prefill_batches(prompts):
            self._decode(batch)
            self._sample(batch, outputs)
        prefill_s = time.perf_counter() - t0
        steps: list[float] = []
        pos = [len(p) for p in prompts]
        for _ in range(max_tokens - 1):
            ts = time.perf_counter()
            batch = [(i, [outputs[i][-1]], pos[i], True) for i in range(n)]
            self._decode(batch)
            self._sample(batch, outputs)
            for i in range(n):
                pos[i] += 1
            steps.append(time.perf_counter() - ts)
        decode_s = time.perf_counter() - t0 - prefill_s
        self.clear()
        return CeilingRun(n, sum(map(len, prompts)), n * max_tokens, prefill_s, decode_s,
                          max_tokens - 1, steps, outputs)

    def _prefill_batches(self, prompts: list[list[int]]):
        """Pieces packed into batches of at most n_batch tokens; a prompt is split only where
        it does not fit the room left."""
        cap = self.config.n_batch
        batch, room = [], cap
        for seq, prompt in enumerate(prompts):
            start = 0
            while start < len(prompt):
                take = min(room, len(prompt) - start)
                end = start + take
                batch.append((seq, prompt[start:end], start, end == len(prompt)))
                room -= take
                start = end
                if room == 0:
                    yield batch
                    batch, room = [], cap
        if batch:
            yield batch

    def _decode(self, batch) -> None:
        status = self.context.decode(batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _sample(self, batch, outputs: list[list[int]]) -> None:
        offset = 0
        for seq, tokens, _, want in batch:
            offset += len(tokens)
            if want:
                outputs[seq].append(int(np.argmax(self.context.logits(offset - 1))))
