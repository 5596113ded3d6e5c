"""Embeddings of a loaded model in a context of their own (llama.cpp `embeddings=True`).

Pooling is the GGUF's (`<arch>.pooling_type`) when it names one, else mean over the input's
tokens (a chat model such as SmolLM2 names none). Vectors are L2-normalized. One input is decoded
at a time, whole, in one ubatch (pooling needs every token of a sequence in one piece), so an
input may be at most n_ctx tokens. The context is created on first use and is used by one thread
at a time (a lock): callers run `embed` in a thread pool, never on the event loop.
"""
from __future__ import annotations

import threading

import llama_cpp as C
import numpy as np

from engine.model import Model

_POOLING = {C.LLAMA_POOLING_TYPE_MEAN: "mean", C.LLAMA_POOLING_TYPE_CLS: "cls",
            C.LLAMA_POOLING_TYPE_LAST: "last"}


class Embedder:
    def __init__(self, model: Model, n_ctx: int = 2048, n_threads: int = 2):
        self.model, self.n_ctx, self.n_threads = model, n_ctx, n_threads
        self.n_embd = C.llama_model_n_embd(model.ptr)
        self._lock = threading.Lock()
        self._ctx = None
        self._batch = None
        self.pooling = ""

    def _open(self) -> None:
        ctx = self._new_context(C.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if C.llama_pooling_type(ctx) not in _POOLING:   # the GGUF names none (or rank): mean
            C.llama_free(ctx)
            ctx = self._new_context(C.LLAMA_POOLING_TYPE_MEAN)
        self.pooling = _POOLING[C.llama_pooling_type(ctx)]
        self._ctx, self._batch = ctx, C.llama_batch_init(self.n_ctx, 0, 1)

    def _new_context(self, pooling: int):
        params = C.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.n_threads
        params.embeddings = True
        params.pooling_type = pooling
        params.no_perf = True
        ctx = C.llama_init_from_model(self.model.ptr, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create an embedding context")
        return ctx

    def embed(self, tokens: list[int]) -> np.ndarray:
        """The normalized embedding (float32, n_embd) of one input of 1..n_ctx tokens."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"an input must have 1 to {self.n_ctx} tokens, not {len(tokens)}")
        with self._lock:
            if self._ctx is None:
                self._open()
            return self._embed(tokens)

    def _embed(self, tokens: list[int]) -> np.ndarray:
        C.llama_memory_clear(C.llama_get_memory(self._ctx), True)
        b, n = self._batch, len(tokens)
        assert b is not None, "opened"
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, True
            b.seq_id[i][0] = 0
        b.n_tokens = n
        status = C.llama_decode(self._ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for an embedding")
        ptr = C.llama_get_embeddings_seq(self._ctx, 0)
        vec = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                C.llama_batch_free(self._batch)
                C.llama_free(self._ctx)
                self._ctx = None
