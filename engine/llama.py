"""Thin wrappers over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

Model: a loaded GGUF (weights, vocabulary, chat template), shared by every context of it.
Context: one llama.cpp context with n_seq_max sequences, a reusable batch filled with numpy,
llama_decode, logits and the memory (KV) operations, the block manager's typed ops among them.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import llama_cpp as C
import numpy as np

from engine import token_memo
from engine.gguf_info import k_quant_file_type
from engine.token_memo import SegmentTokenizer, split_tokens
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
from kvcache.snapshots import file_digest

log = logging.getLogger("pagedllama.llama_cpp")
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_backend_lock = threading.Lock()
_backend_ready = False


def llama_cpp_version() -> str:
    """The version of llama-cpp-python (and so of the llama.cpp it vendors) in this process."""
    return C.__version__


_stoppable = threading.local()   # .on: this thread is in a stoppable decode (Context.decode)


@C.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp's own messages go through logging; quiet (DEBUG) unless they are errors, and
    # those of a stoppable decode are what stopping it logs ("failed to compute graph").
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:
        error = level == 4 and not getattr(_stoppable, "on", False)
        log.log(logging.ERROR if error else logging.DEBUG, message)


def _stop_callback():
    """The abort callback of a stoppable decode (Context.decode). llama.cpp's CPU backend calls
    `bool callback(void *data)` on its first thread after every graph node of a decode, and
    stops the computation when it answers true. A Python callback would take the GIL hundreds
    of times a step, each time waiting for the event loop's thread; libc's `strlen`, called on
    a flag that is a C string ("" to go on, "x" to stop), answers without Python. Its result
    comes back in the register a bool is read from (its low byte: 0 or 1) on the ABIs llama.cpp
    runs on. None where libc cannot be found: decodes then always run to their end."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return None
    return C.ggml_abort_callback(address) if address else None


_STOP_CALLBACK = _stop_callback()
_NO_CALLBACK = C.ggml_abort_callback()   # NULL: no abort callback


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            C.llama_log_set(_log_callback, ctypes.c_void_p(0))
            C.llama_backend_init()
            _backend_ready = True


def gpu_offload_supported() -> bool:
    """Does this llama.cpp build have a GPU backend (GGML_CUDA, ...)? With one, a Model puts all
    its layers there unless told otherwise: llama.cpp's default n_gpu_layers is -1, all."""
    init_backend()
    return bool(C.llama_supports_gpu_offload())


def _readable_spans() -> tuple[list[int], list[int]]:
    """Starts and ends of this process's readable memory mappings, sorted."""
    starts, ends = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split(maxsplit=2)[:2]
            if perms.startswith("r"):
                lo, hi = span.split("-")
                starts.append(int(lo, 16))
                ends.append(int(hi, 16))
    return starts, ends


def _lib_dir() -> str:
    """The folder llama-cpp-python loaded libllama from (its own lib folder, or the one its
    LLAMA_CPP_LIB_PATH named)."""
    return os.path.dirname(C.llama_cpp._lib._name)


@functools.cache
def _ggml_cpu() -> ctypes.CDLL:
    """llama-cpp-python's libggml-cpu (the library llama.cpp already loaded: same file, same
    handle), from where llama-cpp-python loads its libraries; opened once."""
    lib = ctypes.CDLL(os.path.join(_lib_dir(), "libggml-cpu.so"))
    lib.ggml_backend_is_cpu.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_is_cpu.restype = ctypes.c_bool
    lib.ggml_backend_cpu_set_use_ref.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    lib.ggml_backend_cpu_set_use_ref.restype = None
    if hasattr(lib, "ggml_backend_cpu_set_fa_row_invariant"):   # the build's patches (below)
        lib.ggml_backend_cpu_set_fa_row_invariant.argtypes = [ctypes.c_void_p, ctypes.c_bool]
        lib.ggml_backend_cpu_set_fa_row_invariant.restype = None
    for probe in ("ggml_cpu_has_row_invariant_repack", "ggml_cpu_has_row_invariant_tiled"):
        if hasattr(lib, probe):
            getattr(lib, probe).argtypes = []
            getattr(lib, probe).restype = ctypes.c_bool
    return lib


@functools.cache
def build_identity() -> dict:
    """What of this llama.cpp decides its numbers: the version, the CPU features its kernels
    use, and the content of its libraries (a rebuild with other flags computes other sums)."""
    libs = sorted(p for p in Path(_lib_dir()).glob("lib*.so*") if p.is_file())
    return {"version": llama_cpp_version(),
            "system": C.llama_print_system_info().decode(errors="replace").strip(),
            "libraries": {p.name: file_digest(p) for p in libs}}


def has_row_invariant_attention() -> bool:
    """Was this llama.cpp built with the row-invariant flash-attention patch
    (scripts/patches/ggml-cpu-fa-row-invariant.patch, applied by `make setup`)?"""
    return hasattr(_ggml_cpu(), "ggml_backend_cpu_set_fa_row_invariant")


def has_row_invariant_repack() -> bool:
    """Was it also built with the row-invariant repacked matmul
    (scripts/patches/ggml-cpu-repack-row-invariant.patch): under the same switch (named for
    flash attention, where it came first), weights in llama.cpp's repacked layouts are
    multiplied row by row, one kernel whatever the batch?"""
    lib = _ggml_cpu()
    return (has_row_invariant_attention() and hasattr(lib, "ggml_cpu_has_row_invariant_repack")
            and bool(lib.ggml_cpu_has_row_invariant_repack()))


def has_row_invariant_tiled() -> bool:
    """And with the row-invariant K-quant matmul
    (scripts/patches/ggml-cpu-tiled-row-invariant.patch): under the same switch, K-quant
    weights in the plain layouts take ggml's tiled matmul for every batch, below 8 rows
    through kernels that round as its tiles do, where ggml's own rule changes kernels at 8
    rows and with them a row's numbers (from 1B-sized models on, most matrices are K-quants
    of a width the tiles take)?"""
    lib = _ggml_cpu()
    return (has_row_invariant_attention() and hasattr(lib, "ggml_cpu_has_row_invariant_tiled")
            and bool(lib.ggml_cpu_has_row_invariant_tiled()))


_claimed_backends: set[int] = set()   # the CPU backends of this process's live Contexts


def cpu_backend_of(ctx_ptr, scan_bytes: int = 8192) -> int | None:
    """The address of a llama.cpp context's CPU backend (its `backend_cpu`), or None.

    llama.h has no getter for a context's backends, so this reads the context object's words
    and returns the one that is a CPU backend: a pointer to readable memory whose first field
    (the backend's guid pointer) points to readable memory, and that ggml_backend_is_cpu
    accepts, and that no other live Context has claimed (the scan may run past the object's
    end). Only readable memory is read, so a layout this does not expect finds nothing rather
    than crashing."""
    lib = _ggml_cpu()
    starts, ends = _readable_spans()

    def readable(addr: int, n: int) -> bool:
        i = bisect.bisect_right(starts, addr) - 1
        return i >= 0 and addr + n <= ends[i]

    base = ctypes.cast(ctx_ptr, ctypes.c_void_p).value
    if base is None:
        return None
    for offset in range(0, scan_bytes, 8):
        if not readable(base + offset, 8):
            return None
        word = ctypes.c_uint64.from_address(base + offset).value
        if word % 8 or not readable(word, 64):
            continue
        guid = ctypes.c_uint64.from_address(word).value
        if (guid and readable(guid, 16) and lib.ggml_backend_is_cpu(word)
                and word not in _claimed_backends):
            return word
    return None


class Attention(StrEnum):
    """How a context's CPU backend computes flash attention (docs/prefix-cache.md, "Attention
    kernels"). ggml's default picks a kernel by the batch: a lone query row over 512 or more KV
    cells has its KV split between the threads, 64 or more rows of one sequence go through a
    tiled kernel, fewer row by row; each gives other numbers, so answers would depend on what
    else runs, on the thread count and on how a prompt is cut. Both exact paths compute every
    query row the same way whatever the batch."""
    ROW_INVARIANT = "row-invariant"   # the tiled kernel for every batch (the build's patch)
    REFERENCE = "reference"           # ggml's reference path: row by row (slow prompts)
    GGML_DEFAULT = "ggml-default"     # by the batch: not exact (tests show why)


def use_exact_attention(ctx_ptr) -> tuple[int, Attention] | None:
    """Put a context's CPU backend on an exact flash-attention path: the row-invariant one
    where this llama.cpp has the patch, else ggml's reference path, which also turns off op
    fusion and the tiled matmul for K-quant weights (the same logits, much slower batches for
    K-quant models). Returns the backend's address (claimed for this context) and the path,
    or None if the backend was not found."""
    backend = cpu_backend_of(ctx_ptr)
    if backend is None:
        return None
    _claimed_backends.add(backend)
    if has_row_invariant_attention():
        set_attention(backend, Attention.ROW_INVARIANT)
        return backend, Attention.ROW_INVARIANT
    set_attention(backend, Attention.REFERENCE)
    return backend, Attention.REFERENCE


def set_attention(backend: int, path: Attention) -> None:
    lib = _ggml_cpu()
    lib.ggml_backend_cpu_set_use_ref(backend, path is Attention.REFERENCE)
    if has_row_invariant_attention():
        lib.ggml_backend_cpu_set_fa_row_invariant(backend, path is Attention.ROW_INVARIANT)


class Model:
    """A GGUF model loaded once: tokenizer, detokenizer pieces and chat template."""

    def __init__(self, path: str | Path, n_gpu_layers: int | None = None, repack: bool = False):
        """`repack`: let llama.cpp copy weights into its repacked CPU layouts (Q4_0, Q4_K,
        IQ4_NL, ... on this CPU), whose one-row kernel decodes faster and whose prompts are
        slower than the plain layouts' tiled kernel. ggml's own rule takes a 4-row kernel from
        4 rows of input up, so a sequence's logits would depend on how many others decode
        beside it; this build's patch keeps the one-row kernel for every row under the
        row-invariant switch (has_row_invariant_repack), which the context turns on
        (docs/prefix-cache.md, "Weight layouts")."""
        init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        params = C.llama_model_default_params()
        params.use_extra_bufts = self.repack = repack
        if n_gpu_layers is not None:   # only meaningful with a GPU build (-1: all layers)
            params.n_gpu_layers = n_gpu_layers
        self.on_gpu = gpu_offload_supported() and n_gpu_layers != 0   # some layers or all
        self.ptr = C.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.vocab = C.llama_model_get_vocab(self.ptr)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = C.llama_model_n_ctx_train(self.ptr)
        self.n_swa = C.llama_model_n_swa(self.ptr)   # a sliding window's width (0: none)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.bos_id, self.eos_id = C.llama_vocab_bos(self.vocab), C.llama_vocab_eos(self.vocab)
        self.eog_ids = frozenset(t for t in range(self.n_vocab)
                                 if C.llama_vocab_is_eog(self.vocab, t))
        self.file_type = self._meta("general.file_type")
        self._pieces: dict[int, bytes] = {}
        self._segments: SegmentTokenizer | None = None   # built at the first long text
        template = C.llama_model_chat_template(self.ptr, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    @property
    def has_k_quants(self) -> bool:
        """Is this a K-quant or IQ file (Q4_K_M, Q6_K, IQ4_XS, ...; unknown counts as yes)? ggml
        multiplies such weights with its tiled matmul from 8 rows of input, a kernel that the
        reference path (Attention.REFERENCE) turns off, so batches of such a model are
        much slower with flash attention (docs/prefix-cache.md, "Attention kernels")."""
        return k_quant_file_type(self.file_type)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """llama.cpp's tokens of `text`; a long one with special tokens parsed goes through the
        remembered segments of engine/token_memo.py (the same tokens)."""
        if parse_special and len(text) >= token_memo.MIN_CHARS:
            return self._segmenter().tokenize(text, add_special)
        return self._tokenize(text, add_special, parse_special)

    def _segmenter(self) -> SegmentTokenizer:
        if self._segments is None:
            splits: frozenset[str] = frozenset()
            if (C.llama_vocab_type(self.vocab) in (C.LLAMA_VOCAB_TYPE_SPM, C.LLAMA_VOCAB_TYPE_BPE)
                    and not C.llama_vocab_get_add_eos(self.vocab)):
                splits = split_tokens(self._special_tokens())
            self._segments = SegmentTokenizer(lambda t, bos: self._tokenize(t, bos, True), splits)
        return self._segments

    def _special_tokens(self) -> list[tuple[str, bool, bool]]:
        """(text, is control, strips whitespace) of each token llama.cpp's tokenizer looks for
        in a text before tokenizing the rest (control, user-defined and unknown tokens)."""
        special = C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_USER_DEFINED | \
            C.LLAMA_TOKEN_ATTR_UNKNOWN
        strips = C.LLAMA_TOKEN_ATTR_LSTRIP | C.LLAMA_TOKEN_ATTR_RSTRIP
        out = []
        for t in range(self.n_vocab):
            attr = C.llama_vocab_get_attr(self.vocab, t)
            if attr & special:
                text = (C.llama_vocab_get_text(self.vocab, t) or b"").decode("utf-8", "replace")
                out.append((text, bool(attr & C.LLAMA_TOKEN_ATTR_CONTROL), bool(attr & strips)))
        return out

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (C.llama_token * -n)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token (control tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = C.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def token_text(self, token: int) -> str:
        """A token as text with special tokens shown (for templates: bos/eos strings)."""
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self.vocab, token, buf, 256, 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", errors="replace")

    def token_bytes(self, token: int, buf=None) -> bytes:
        """A token's text as bytes, special tokens shown."""
        buf = ctypes.create_string_buffer(1024) if buf is None else buf
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
        return buf.raw[:max(n, 0)]

    def byte_weights(self) -> np.ndarray | None:
        """For each byte value b, 1 / (length of the longest token text that holds b), or 0 if no
        token holds it. Every token covers at most its own text's length of input, so a text's
        byte weights sum to a lower bound on its token count (server/service/prompts.py): computed
        once, it lets a prompt that cannot fit be rejected without tokenizing it. None where
        that does not hold: vocabularies that normalise input (WPM, UGM, ...) or special tokens
        that strip the whitespace beside them."""
        strip = C.LLAMA_TOKEN_ATTR_LSTRIP | C.LLAMA_TOKEN_ATTR_RSTRIP
        if C.llama_vocab_type(self.vocab) not in (C.LLAMA_VOCAB_TYPE_BPE, C.LLAMA_VOCAB_TYPE_SPM):
            return None
        buf = ctypes.create_string_buffer(1024)
        pieces = []
        for token in range(self.n_vocab):
            if C.llama_vocab_get_attr(self.vocab, token) & strip:
                return None
            pieces.append(self.token_bytes(token, buf))
        data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        lengths = np.repeat([len(p) for p in pieces], [len(p) for p in pieces])
        reach = np.zeros(256, dtype=np.int64)
        np.maximum.at(reach, data, lengths)
        return np.divide(1.0, reach, out=np.zeros(256), where=reach > 0)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """The tokens' text; with `special`, control tokens as their text (`<|im_start|>`)."""
        pieces = (self.token_bytes(t) for t in tokens) if special else map(self.piece, tokens)
        return b"".join(pieces).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None


# llama_get_logits_ith returning the address as an int (llama-cpp-python's binding returns a
# ctypes pointer, and turning that into an array costs more than the call)
_get_logits_ith = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
    ctypes.cast(C.llama_cpp._lib.llama_get_logits_ith, ctypes.c_void_p).value or 0)


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
        self._stop = ctypes.create_string_buffer(2)   # a stoppable decode's flag (request_stop)

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
        if not stoppable or _STOP_CALLBACK is None:
            return C.llama_decode(self.ptr, self.batch)
        C.llama_set_abort_callback(self.ptr, _STOP_CALLBACK, ctypes.addressof(self._stop))
        _stoppable.on = True
        try:
            return C.llama_decode(self.ptr, self.batch)
        finally:
            _stoppable.on = False
            C.llama_set_abort_callback(self.ptr, _NO_CALLBACK, None)

    @property
    def can_stop(self) -> bool:
        """Whether a stoppable decode stops when asked: on the CPU, where libc was found."""
        return _STOP_CALLBACK is not None and not self.model.on_gpu

    def request_stop(self) -> None:
        """Stop the stoppable decode running now, or the next one (any thread may call it)."""
        self._stop[0] = b"x"

    def clear_stop(self) -> None:
        self._stop[0] = b"\0"

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
        addr = _get_logits_ith(self.ptr, i)
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
            _claimed_backends.discard(self.cpu_backend)
            C.llama_batch_free(self.batch)
            C.llama_free(self.ptr)
            self.ptr = None
