"""A GGUF model loaded in llama.cpp (weights, vocabulary, chat template), shared by every context
of it, and what is process-wide in llama.cpp: its start (logging routed), its version, whether
it has a GPU backend, and what of it decides the numbers (build_identity)."""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import llama_cpp as C
import numpy as np

from engine import token_memo
from engine.gguf_info import k_quant_file_type
from engine.llama_tricks import library_dir, log_callback
from engine.token_memo import SegmentTokenizer, split_tokens
from kvcache.snapshots import file_digest

_backend_lock = threading.Lock()
_backend_ready = False


def llama_cpp_version() -> str:
    """The version of llama-cpp-python (and so of the llama.cpp it vendors) in this process."""
    return C.__version__


def init_backend() -> None:
    """Start llama.cpp once a process, its messages through logging (llama_tricks.log_callback)."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            C.llama_log_set(log_callback, ctypes.c_void_p(0))
            C.llama_backend_init()
            _backend_ready = True


def gpu_offload_supported() -> bool:
    """Does this llama.cpp build have a GPU backend (GGML_CUDA, ...)? With one, a Model puts all
    its layers there unless told otherwise: llama.cpp's default n_gpu_layers is -1, all."""
    init_backend()
    return bool(C.llama_supports_gpu_offload())


@functools.cache
def build_identity() -> dict:
    """What of this llama.cpp decides its numbers: the version, the CPU features its kernels
    use, and the content of its libraries (a rebuild with other flags computes other sums)."""
    libs = sorted(p for p in library_dir().glob("lib*.so*") if p.is_file())
    return {"version": llama_cpp_version(),
            "system": C.llama_print_system_info().decode(errors="replace").strip(),
            "libraries": {p.name: file_digest(p) for p in libs}}


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
