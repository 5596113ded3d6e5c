"""One llama.cpp context (through llama-cpp-python's ctypes bindings): n_seq_max sequences, a
reusable batch filled with numpy, llama_decode (stoppable from another thread), logits, and the
memory (KV) operations, the block manager's typed ops among them. What it reaches beyond llama.h
(its CPU backend's switches, the abort callback, a faster logits getter) is in
engine/llama_tricks.py."""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import llama_cpp as C
import numpy as np

from engine import llama_tricks
from engine.llama_tricks import (
    Attention,
    StopFlag,
    has_row_invariant_attention,
    has_row_invariant_repack,
    has_row_invariant_tiled,
    logits_address,
    release_backend,
    set_attention,
    use_exact_attention,
)
from engine.model import Model
from kvcache import (
    CopyOp,
    DropSavedOp,
    KVOp,
    LoadOp,
    RemoveOp,
    RestoreOp,
    SaveOp,
    SnapshotOp,
    Space,
)

log = logging.getLogger("pagedllama.llama_cpp")


@functools.cache
def _warn_reference_path() -> None:
    log.warning("this llama.cpp was built without the row-invariant flash-attention patch: "
                "flash attention runs on ggml's reference path, exact but slow on long prompts "
                "(build llama.cpp with `make setup`, or set PAGEDLLAMA_FLASH_ATTN=0)")


def state_covers(pos_range: tuple[int, int], n_tokens: int, window_only: bool) -> bool:
    """Whether a sequence whose cells span positions `pos_range` holds the KV of `n_tokens`
    tokens from position 0: a state saved for tokens it does not hold would restore too few
    cells, and the next decode would fail. On a model with sliding-window layers llama.cpp keeps
    only the window before the last position, so there the first position may be later.

    Such a model's states are kept only up to the window's width (Context.apply): past it, the
    window's cells are restored into other cells of its cache than the cold computation had
    used (it reuses the cells of positions that left the window), and attention, which sums
    over cells in their order, gives other bits (measured on Gemma 3: top logprobs off by up to
    0.12 after a 620-token restore, bitwise equal within its 512-token window)."""
    p0, p1 = pos_range
    return p1 == n_tokens - 1 and (p0 == 0 or window_only and p0 > 0)


@dataclass
class ContextConfig:
    n_ctx: int = 8192
    n_seq_max: int = 64
    n_batch: int = 256          # tokens per llama_decode; also n_ubatch, so a batch is never split
    n_threads: int = 2
    kv_unified: bool = True
    flash_attn: bool = False
    kv_type: str = "f16"        # KV cache element type: f16 or q8_0 (q8_0 needs flash_attn)
    n_outputs_max: int = 0      # most logits rows of one decode (0: n_batch); llama.cpp sizes
                                # its compute and output buffers by it


# ggml type ids (ggml.h) of the KV cache types offered
KV_TYPES = {"f16": 1, "q8_0": 8}


class Context:
    """One llama.cpp context: batch building, decode, logits and KV memory operations."""

    def __init__(self, model: Model, config: ContextConfig):
        self.model, self.config = model, config
        params = C.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = params.n_ubatch = config.n_batch
        params.n_seq_max = config.n_seq_max
        params.n_threads = params.n_threads_batch = config.n_threads
        params.kv_unified = config.kv_unified
        params.flash_attn_type = 1 if config.flash_attn else 0
        params.type_k = params.type_v = KV_TYPES[config.kv_type]
        # llama.cpp keeps a logits row per seq id at least (an assertion otherwise)
        params.n_outputs_max = (max(config.n_outputs_max, config.n_seq_max)
                                if config.n_outputs_max else 0)
        params.no_perf = True
        # A model kept on the CPU stays there: without this a GPU build still copies the weights
        # of large batches' matrix products to the GPU (llama.cpp's op offload), whose kernels
        # make a sequence's logits depend on the batch (docs/gpu.md)
        params.op_offload = model.on_gpu
        self.ptr = C.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not create a context ({config})")
        self.cpu_backend: int | None = None
        self.attention: Attention | None = None   # the flash-attention path, when it is on
        # the backend's row-invariant switch: flash attention's and repacked weights' exact
        # path, and the K-quant matmul's where this build has it (every CPU context then)
        required = config.flash_attn or (model.repack and has_row_invariant_repack())
        if required or (has_row_invariant_tiled() and not model.on_gpu):
            try:
                found = use_exact_attention(self.ptr)
                if found is None:
                    raise LookupError("not found in the context")
            except Exception as exc:   # also: the library or /proc/self/maps could not be read
                if required:
                    C.llama_free(self.ptr)
                    raise RuntimeError(
                        f"this llama.cpp's CPU backend could not be put on its exact path ({exc}); "
                        "turn flash attention and repacking off (PAGEDLLAMA_FLASH_ATTN=0, "
                        "PAGEDLLAMA_REPACK_WEIGHTS=0)") from exc
                log.warning("the CPU backend's row-invariant switch could not be turned on (%s): "
                            "K-quant weights round otherwise from 8 rows of input up", exc)
                found = None
            if found is not None:
                self.cpu_backend, path = found
                if config.flash_attn:
                    self.attention = path
                    if path is Attention.REFERENCE:
                        _warn_reference_path()
        self.n_ctx = C.llama_n_ctx(self.ptr)
        self.n_ctx_seq = C.llama_n_ctx_seq(self.ptr)
        self.mem = C.llama_get_memory(self.ptr)
        self.batch = C.llama_batch_init(config.n_batch, 0, 1)
        n = config.n_batch
        # numpy views over the batch arrays: filling a batch is a few vectorised copies
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n,))
        self._n_seq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(n,))
        self._seq_ptrs = [self.batch.seq_id[i] for i in range(n)]
        self._n_seq[:] = 1
        self._saved: dict[int, bytes] = {}
        self.tiers: Space | None = None   # the prefix cache's tiers (SnapshotOp, LoadOp)
        self._copying: set[int] = set()   # streams with a copy pending (_settle)
        self.copied = False   # whether the last decode ran stream copies before its pieces
        self._views: dict[int, np.ndarray] = {}   # logits views by address (see logits)
        self._stop = StopFlag()   # a stoppable decode's flag (request_stop)

    # ---- batch and decode ---------------------------------------------------------------------
    def decode(self, pieces: list[tuple[int, list[int], int, int]],
               stoppable: bool = False) -> int:
        """One llama_decode over pieces of (seq id, tokens, first position, how many of the last
        tokens want logits: 0, 1 (True) or all of them). Returns llama_decode's status (0 ok,
        1 no KV slot, 2 stopped, <0 error). A `stoppable` decode on the CPU stops after the
        graph node that is computing when `request_stop` is called, or at its first node if
        that was called since the last `clear_stop`; llama.cpp then removes what the stopped
        micro-batch put in the KV cache (earlier micro-batches of the call stay: the caller
        removes the pieces' positions itself)."""
        n = outputs = 0
        for seq_id, tokens, pos0, want_logits in pieces:
            k = len(tokens)
            outputs += int(want_logits)
            self._tokens[n:n + k] = tokens
            self._pos[n:n + k] = np.arange(pos0, pos0 + k)
            self._logits[n:n + k] = 0
            if want_logits:
                self._logits[n + k - int(want_logits):n + k] = 1
            for i in range(n, n + k):
                self._seq_ptrs[i][0] = seq_id
            n += k
        self.batch.n_tokens = n
        # llama_decode runs the pending stream copies first: this call's time is not the pieces'
        self.copied = bool(self._copying)
        self._copying.clear()
        if self.config.n_outputs_max and outputs > max(self.config.n_outputs_max,
                                                       self.config.n_seq_max):
            # llama.cpp would abort the process (an assertion in its output buffer)
            raise RuntimeError(f"a batch with {outputs} outputs, more than the context's "
                               f"{self.config.n_outputs_max}")
        if not stoppable or not llama_tricks.CAN_STOP:
            return C.llama_decode(self.ptr, self.batch)
        return self._stop.decode(self.ptr, self.batch)

    @property
    def can_stop(self) -> bool:
        """Whether a stoppable decode stops when asked: on the CPU, where libc was found."""
        return llama_tricks.CAN_STOP and not self.model.on_gpu

    def request_stop(self) -> None:
        """Stop the stoppable decode running now, or the next one (any thread may call it)."""
        self._stop.request()

    def clear_stop(self) -> None:
        self._stop.clear()

    def pieces_match_decoding(self, seq: int = 0,
                              lengths: tuple[int, ...] = (2, 3, 5, 9)) -> bool:
        """Whether a sequence's tokens computed inside one piece of k tokens (a verification
        piece of speculative decoding: its last token and k - 1 drafted ones, logits for each)
        get bitwise the logits and the KV they get computed one at a time, as decoding does.
        A free sequence computes a prompt and the next k tokens one by one, then the same prompt
        and the k tokens as one piece; each time one token more after them (it reads the KV
        they wrote). The sequence is empty after. Measured (docs/scheduling.md, "Speculative
        decoding"): true with flash attention on this build's exact paths; false with plain
        attention, whose Q·K and attention-weight products for 2 or more query rows of a
        sequence go through llamafile's tinyBLAS tiles and for 1 through ggml's vec_dot, other
        sums. The lengths cover tile edges and the 8-row threshold of ggml's tiled K-quant
        matmul."""
        rng = np.random.default_rng(20261127)
        n_vocab = self.model.n_vocab
        prompt = [int(t) for t in rng.integers(n_vocab // 8, n_vocab // 2, 24)]
        n = len(prompt)

        def run(k: int, nxt: list[int], as_piece: bool) -> list[np.ndarray] | None:
            self.seq_rm(seq, -1, -1)
            if self.decode([(seq, prompt, 0, False)]) != 0:
                return None
            out = []
            if as_piece:
                if self.decode([(seq, nxt[:k], n, k)]) != 0:
                    return None
                out = [self.logits(i).copy() for i in range(k)]
            else:
                for i in range(k):
                    if self.decode([(seq, [nxt[i]], n + i, True)]) != 0:
                        return None
                    out.append(self.logits(0).copy())
            if self.decode([(seq, [nxt[k]], n + k, True)]) != 0:
                return None
            return out + [self.logits(0).copy()]

        try:
            for k in lengths:
                nxt = [int(t) for t in rng.integers(n_vocab // 8, n_vocab // 2, k + 1)]
                alone, inside = run(k, nxt, False), run(k, nxt, True)
                if alone is None or inside is None or not all(
                        np.array_equal(a, b) for a, b in zip(alone, inside)):
                    return False
            return True
        finally:
            self.seq_rm(seq, -1, -1)

    def set_threads(self, n_threads: int) -> None:
        """Threads for the next decodes (single-token and batch alike)."""
        C.llama_set_n_threads(self.ptr, n_threads, n_threads)

    def logits(self, i: int) -> np.ndarray:
        """Logits of batch position i (a view, valid until the next decode). llama.cpp keeps
        its output rows in one buffer that it reallocates only to grow, so the views are kept
        by address: making one costs ~20 us, a step at one stream ~8 ms."""
        addr = logits_address(self.ptr, i)
        if not addr:
            raise ValueError(f"no logits at batch position {i}")
        view = self._views.get(addr)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[addr] = np.frombuffer(
                (ctypes.c_float * self.model.n_vocab).from_address(addr), dtype=np.float32)
        return view

    # ---- memory (KV) operations --------------------------------------------------------------
    def apply(self, ops: Iterable[KVOp]) -> list[int]:
        """The block manager's KV ops (kvcache/blocks.py), in order: the only place they reach
        llama.cpp. Returns the seq ids of the LoadOps whose state could not be read (a snapshot
        file gone or damaged since it was found): their sequences are to be planned again
        (Scheduler.reopen)."""
        unread = []
        for op in ops:
            if isinstance(op, CopyOp):
                if self.config.kv_unified:
                    self.seq_cp(op.src, op.dst, op.p0, op.p1)
                else:   # split streams copy whole: take all of src, then cut to the range
                    self.seq_cp(op.src, op.dst, -1, -1)
                    self.seq_rm(op.dst, op.p1, -1)
                    self._copying |= {op.src, op.dst}
            elif isinstance(op, RemoveOp):
                self.seq_rm(op.seq, op.p0, op.p1)
            elif isinstance(op, SaveOp):
                self._settle(op.seq)
                self.save_seq(op.seq, op.key)
            elif isinstance(op, RestoreOp):
                self._settle(op.seq)
                self.restore_seq(op.key, op.seq)
            elif isinstance(op, DropSavedOp):
                self.drop_saved(op.key)
            elif isinstance(op, SnapshotOp):
                self._snapshot(op)
            elif isinstance(op, LoadOp) and not self._load(op):
                unread.append(op.seq)
        return unread

    def _snapshot(self, op: SnapshotOp) -> None:
        """Save a sequence's state to the tiers, if its cells hold exactly op.tokens."""
        if self.tiers is None:
            return
        t0 = time.perf_counter()
        if self.tiers.whole_only and len(op.tokens) > self.model.n_swa:
            return    # past a sliding window a restore is not exact (window_only)
        self._settle(op.seq)
        span = self.seq_pos_range(op.seq)
        if not state_covers(span, len(op.tokens), self.tiers.whole_only):
            log.warning("not saving the state of seq %d: its cells (positions %d-%d) do not "
                        "hold the %d tokens it was to be kept for", op.seq, *span,
                        len(op.tokens))
            return
        data = self.state_bytes(op.seq)
        t1 = time.perf_counter()
        self.tiers.put(op.tokens, data)
        log.debug("saved the state of %d tokens (%.1f MiB) in %.3f s, kept in %.3f s",
                  len(op.tokens), len(data) / 2**20, t1 - t0, time.perf_counter() - t1)

    def _load(self, op: LoadOp) -> bool:
        """Load a snapshot's state into a sequence (read now unless the op holds it: Space.load)
        and cut it to op.n_tokens. False when the state could not be read."""
        assert self.tiers is not None, "a load is planned only with tiers"
        restore = self.tiers.load(op)
        if restore is None:
            return False
        t0 = time.perf_counter()
        self._settle(op.seq)
        self.load_state(op.seq, restore.data)
        self.seq_rm(op.seq, op.n_tokens, -1)
        self.tiers.restored(restore.tier, time.perf_counter() - t0)
        return True

    def _settle(self, seq_id: int) -> None:
        """Before a sequence's state is read or written directly: with split KV, llama.cpp
        copies a stream's data (seq_cp between streams) only at the next decode, so a stream
        copied from or to in the ops since then would be read before its copy arrives, or
        overwritten before it leaves. A one-token decode after the sequence's last position
        runs the pending copies first; the token is removed again."""
        if seq_id not in self._copying:
            return
        pos = self.seq_pos_range(seq_id)[1] + 1
        if self.decode([(seq_id, [self.model.bos_id], pos, False)]) != 0:
            raise RuntimeError(f"llama_decode could not settle the stream copies of {seq_id}")
        self.seq_rm(seq_id, pos, -1)

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        return C.llama_memory_seq_rm(self.mem, seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """(pos_min, pos_max) of a sequence's cells; (-1, -1) when it has none."""
        return (C.llama_memory_seq_pos_min(self.mem, seq_id),
                C.llama_memory_seq_pos_max(self.mem, seq_id))

    def save_seq(self, seq_id: int, key: int) -> int:
        """Copy a sequence's KV state to RAM; returns its size in bytes."""
        size = C.llama_state_seq_get_size(self.ptr, seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = C.llama_state_seq_get_data(self.ptr, buf, size, seq_id)
        self._saved[key] = ctypes.string_at(buf, written)   # one memcpy (no int list)
        return written

    def restore_seq(self, key: int, seq_id: int) -> None:
        self.load_state(seq_id, self._saved.pop(key))

    def state_bytes(self, seq_id: int) -> bytearray:
        """A sequence's KV state (llama_state_seq_get_data), copied once."""
        size = C.llama_state_seq_get_size(self.ptr, seq_id)
        buf = bytearray(size)
        written = C.llama_state_seq_get_data(
            self.ptr, (ctypes.c_uint8 * size).from_buffer(buf), size, seq_id)
        del buf[written:]
        return buf

    def load_state(self, seq_id: int, data: bytes | bytearray) -> None:
        """Load a state saved by save_seq or state_bytes into seq_id (its cells are replaced)."""
        n = len(data)
        buf = ((ctypes.c_uint8 * n).from_buffer(data) if isinstance(data, bytearray)
               else ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8)))
        if C.llama_state_seq_set_data(self.ptr, buf, n, seq_id) == 0:
            raise RuntimeError(f"llama_state_seq_set_data failed for seq {seq_id}")

    def drop_saved(self, key: int) -> None:
        self._saved.pop(key, None)

    def use_attention(self, path: Attention) -> None:
        """Another flash-attention path for the next decodes (tests and measurements: what the
        exact paths are for, and what they cost)."""
        assert self.cpu_backend is not None, "a context with flash attention"
        if path is Attention.ROW_INVARIANT and not has_row_invariant_attention():
            raise RuntimeError("this llama.cpp was built without the row-invariant patch")
        set_attention(self.cpu_backend, path)
        self.attention = path

    def close(self) -> None:
        if self.ptr:
            release_backend(self.cpu_backend)
            C.llama_batch_free(self.batch)
            C.llama_free(self.ptr)
            self.ptr = None
