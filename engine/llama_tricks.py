"""What the engine reaches in llama.cpp beyond the C API of llama.h, in one place.

llama.h has no getter for a context's CPU backend, no abort callback that Python could afford
after every graph node, and llama-cpp-python no public handle on the libraries it loaded. Each
piece here rests on a fact outside those APIs, says which, and fails safe where the fact does
not hold: it finds nothing (and the caller refuses what needed it, with a clear error) or takes
the slower public way. Nothing here reads memory that is not mapped readable.

Where this project's patches to llama.cpp (scripts/patches/*.patch, built into the wheel by
scripts/build_llama_cpp_python.sh) export a function for what is asked, it is used, and the
library without them is the fallback:
- ggml_backend_cpu_set_fa_row_invariant: the row-invariant switch (flash attention, and
  repacked weights where the second patch is in);
- ggml_cpu_has_row_invariant_repack(): whether the second patch is in.
- ggml_cpu_has_row_invariant_tiled(): whether the third patch is in.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import os
import threading
from enum import StrEnum
from pathlib import Path

import llama_cpp as C

log = logging.getLogger("pagedllama.llama_cpp")


# ---- the libraries llama-cpp-python loaded ----------------------------------------------------
def library_dir() -> Path:
    """The folder llama-cpp-python loaded libllama from (its own lib folder, or the one its
    LLAMA_CPP_LIB_PATH named).

    Relies on: llama-cpp-python keeps the `ctypes.CDLL` of libllama as `llama_cpp.llama_cpp._lib`
    (private), whose `_name` is the path it was opened with. Fails safe: without it, the
    package's own `lib` folder, where llama-cpp-python loads from by default; a library found
    there that is not the one loaded has other CPU backends, so `cpu_backend_of` finds none and
    the context refuses the exact paths with a clear error."""
    name = getattr(getattr(C.llama_cpp, "_lib", None), "_name", None)
    if isinstance(name, str) and os.path.isabs(name):
        return Path(name).parent
    return Path(C.__file__).parent / "lib"


@functools.cache
def ggml_cpu() -> ctypes.CDLL:
    """llama-cpp-python's libggml-cpu, opened once.

    Relies on: the CPU backend lives in `libggml-cpu.so` beside libllama (how llama.cpp builds
    its backends as libraries), and dlopen of a file already loaded hands back the same library,
    so its functions act on the backends llama.cpp made. Fails safe: OSError where the file is
    not there (the caller's error names the settings that need it)."""
    lib = ctypes.CDLL(str(library_dir() / "libggml-cpu.so"))
    lib.ggml_backend_is_cpu.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_is_cpu.restype = ctypes.c_bool
    lib.ggml_backend_cpu_set_use_ref.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    lib.ggml_backend_cpu_set_use_ref.restype = None
    if hasattr(lib, "ggml_backend_cpu_set_fa_row_invariant"):   # the build's patches
        lib.ggml_backend_cpu_set_fa_row_invariant.argtypes = [ctypes.c_void_p, ctypes.c_bool]
        lib.ggml_backend_cpu_set_fa_row_invariant.restype = None
    for getter in ("ggml_cpu_has_row_invariant_repack", "ggml_cpu_has_row_invariant_tiled"):
        if hasattr(lib, getter):
            getattr(lib, getter).argtypes = []
            getattr(lib, getter).restype = ctypes.c_bool
    return lib


def has_row_invariant_attention() -> bool:
    """Was this llama.cpp built with the row-invariant flash-attention patch
    (scripts/patches/ggml-cpu-fa-row-invariant.patch, applied by `make setup`)?

    The patch exports its switch and no getter: the switch's symbol is the sign. Fails safe:
    an unpatched library answers False, and flash attention takes ggml's reference path."""
    return hasattr(ggml_cpu(), "ggml_backend_cpu_set_fa_row_invariant")


def has_row_invariant_repack() -> bool:
    """Was it also built with the row-invariant repacked matmul
    (scripts/patches/ggml-cpu-repack-row-invariant.patch): under the same switch (named for
    flash attention, where it came first), weights in llama.cpp's repacked layouts are
    multiplied row by row, one kernel whatever the batch?

    Asks the patch's own getter, ggml_cpu_has_row_invariant_repack(). Fails safe: a library
    without it answers False, and repacked weights are left to ggml's kernels."""
    lib = ggml_cpu()
    return (has_row_invariant_attention() and hasattr(lib, "ggml_cpu_has_row_invariant_repack")
            and bool(lib.ggml_cpu_has_row_invariant_repack()))


def has_row_invariant_tiled() -> bool:
    """And with the row-invariant K-quant matmul
    (scripts/patches/ggml-cpu-tiled-row-invariant.patch): under the same switch, K-quant
    weights in the plain layouts take ggml's tiled matmul for every batch, below 8 rows
    through kernels that round as its tiles do, where ggml's own rule changes kernels at 8
    rows and with them a row's numbers (from 1B-sized models on, most matrices are K-quants
    of a width the tiles take)?

    Asks the patch's own getter, ggml_cpu_has_row_invariant_tiled(). Fails safe: a library
    without it answers False, and the context leaves the switch as flash attention and
    repacking need it (K-quant answers then depend on the batch from 8 rows up, as in
    ggml)."""
    lib = ggml_cpu()
    return (has_row_invariant_attention() and hasattr(lib, "ggml_cpu_has_row_invariant_tiled")
            and bool(lib.ggml_cpu_has_row_invariant_tiled()))


# ---- a context's CPU backend ------------------------------------------------------------------
_claimed_backends: set[int] = set()   # the CPU backends of this process's live Contexts


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


def cpu_backend_of(ctx_ptr, scan_bytes: int = 8192) -> int | None:
    """The address of a llama.cpp context's CPU backend (its `backend_cpu`), or None.

    Relies on: the context object holds a pointer to its CPU backend within its first
    `scan_bytes`, 8-byte aligned (llama.h has no getter for a context's backends). This reads
    the object's words and returns the one that is a CPU backend: a pointer to readable memory
    whose first field (the backend's guid pointer) points to readable memory, that
    ggml_backend_is_cpu accepts, and that no other live Context has claimed (the scan may run
    past the object's end). Fails safe: only memory mapped readable (/proc/self/maps) is read,
    so a layout this does not expect finds nothing (None) rather than crashing."""
    lib = ggml_cpu()
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


def release_backend(backend: int | None) -> None:
    """A closed context's backend: another context may find it again."""
    if backend is not None:
        _claimed_backends.discard(backend)


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
    K-quant models). Returns the backend's address (claimed for this context until
    release_backend) and the path, or None if the backend was not found."""
    backend = cpu_backend_of(ctx_ptr)
    if backend is None:
        return None
    _claimed_backends.add(backend)
    path = Attention.ROW_INVARIANT if has_row_invariant_attention() else Attention.REFERENCE
    set_attention(backend, path)
    return backend, path


def set_attention(backend: int, path: Attention) -> None:
    """The backend's switches (ggml-cpu.h's use_ref, and the patch's row-invariant one)."""
    lib = ggml_cpu()
    lib.ggml_backend_cpu_set_use_ref(backend, path is Attention.REFERENCE)
    if has_row_invariant_attention():
        lib.ggml_backend_cpu_set_fa_row_invariant(backend, path is Attention.ROW_INVARIANT)


# ---- logits without a ctypes pointer ----------------------------------------------------------
def _logits_getter():
    """llama_get_logits_ith returning the address as an int.

    llama-cpp-python's binding returns a ctypes pointer, and turning that into an array costs
    more than the call. Relies on: its module keeps libllama's CDLL as `llama_cpp.llama_cpp._lib`
    (private). Fails safe: without it, the public binding's pointer, cast to its address."""
    lib = getattr(C.llama_cpp, "_lib", None)
    fn = getattr(lib, "llama_get_logits_ith", None)
    if fn is not None:
        return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
            ctypes.cast(fn, ctypes.c_void_p).value or 0)
    return lambda ctx, i: ctypes.cast(C.llama_get_logits_ith(ctx, i), ctypes.c_void_p).value


logits_address = _logits_getter()   # (context, batch position) -> address of its logits or 0


# ---- a decode that another thread can stop ----------------------------------------------------
def _strlen_callback():
    """The abort callback of a stoppable decode. llama.cpp's CPU backend calls
    `bool callback(void *data)` on its first thread after every graph node of a decode, and
    stops the computation when it answers true. A Python callback would take the GIL hundreds
    of times a step, each time waiting for the event loop's thread; libc's `strlen`, called on
    a flag that is a C string ("" to go on, "x" to stop), answers without Python.

    Relies on: `strlen`'s size_t result comes back in the register a bool result is read from,
    and a bool is read from its low byte (0 or 1 here), on the ABIs llama.cpp runs on (x86-64
    System V, AArch64). Fails safe: None where libc cannot be found; decodes then run to their
    end, and Context.can_stop says so."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return None
    return C.ggml_abort_callback(address) if address else None


_STOP_CALLBACK = _strlen_callback()
_NO_CALLBACK = C.ggml_abort_callback()   # NULL: no abort callback
CAN_STOP = _STOP_CALLBACK is not None
_decoding = threading.local()   # .stop: the StopFlag of the stoppable decode on this thread


class StopFlag:
    """A stoppable decode's flag, a C string read by the abort callback: "" to go on, "x" to
    stop. Any thread may set it; the decode's own thread clears it."""

    def __init__(self) -> None:
        self._flag = ctypes.create_string_buffer(2)

    def request(self) -> None:
        self._flag[0] = b"x"

    def clear(self) -> None:
        self._flag[0] = b"\0"

    @property
    def requested(self) -> bool:
        return self._flag[0] != b"\0"

    def decode(self, ctx_ptr, batch) -> int:
        """llama_decode, stopped after the graph node that is computing when `request` is
        called (at its first node if it was called before). Needs CAN_STOP."""
        C.llama_set_abort_callback(ctx_ptr, _STOP_CALLBACK, ctypes.addressof(self._flag))
        _decoding.stop = self
        try:
            return C.llama_decode(ctx_ptr, batch)
        finally:
            _decoding.stop = None
            C.llama_set_abort_callback(ctx_ptr, _NO_CALLBACK, None)


def stopped_here() -> bool:
    """Whether this thread is in a stoppable decode that was asked to stop."""
    stop = getattr(_decoding, "stop", None)
    return stop is not None and stop.requested


GGML_LOG_LEVEL_ERROR = 4


def log_level(level: int, stopped: bool) -> int:
    """The logging level of a llama.cpp message: DEBUG unless it is an error; an error at DEBUG
    too when its decode was asked to stop, since stopping is what makes llama.cpp log one
    ("failed to compute graph", "failed to decode"). A stoppable decode that fails on its own
    logs its errors as errors."""
    return logging.ERROR if level == GGML_LOG_LEVEL_ERROR and not stopped else logging.DEBUG


@C.llama_log_callback
def log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's own messages through logging (llama_log_set). llama.cpp logs a decode's
    errors on the thread that called llama_decode, where `stopped_here` reads its flag."""
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:
        log.log(log_level(level, stopped_here()), message)
