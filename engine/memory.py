"""What a model takes in memory, from its GGUF header and its settings, before loading it.

The parts, as llama.cpp allocates them on the CPU:

- weights: the tensors' bytes in the file (mapped from it, resident once read);
- KV cache: cells x layers x (K + V width) x the cache type's bytes. With split KV every seq id
  (running sequences, plus `cache_seqs` kept for cached prefixes) has a stream of `n_ctx` cells,
  padded to 256; a unified cache is one pool of `n_ctx x max_seqs`. Sliding-window layers
  (Gemma 2/3, Cohere 2, ...) keep `min(stream, window + ubatch)` cells, padded to 256. llama.cpp
  clears the whole cache when it creates it, so all of it is resident at once;
- compute and output buffers: llama.cpp sizes its compute buffer for the largest batch
  (`step_tokens` tokens, of which up to `n_outputs_max` want logits) and keeps the logits of a
  batch's outputs in an output buffer;
- swapped sequence states: a preempted sequence's KV saved to RAM, at most `swap_tokens` tokens
  of it per context (the scheduler recomputes beyond that);
- the embedding context of `/v1/embeddings`, created on its first use: its own cache of
  `embed_ctx` cells (the longest embedding input, capped at `n_ctx`) for one sequence and a
  compute buffer for a batch of that many tokens;
- the Python side of a loaded model: token pieces, the token bound, the chat template; with
  speculative decoding, each context's shared n-gram table (engine/drafting.py, 12 MiB).

The figures are upper bounds of what becomes resident, checked against the process's memory
by tests/test_models_on_demand.py and `python -m benchmarks.models`; the compute-buffer terms
were fitted to llama.cpp's own figures for SmolLM2 and Gemma 3 (docs/models-on-demand.md). A
file whose architecture this module does not know is estimated as if every layer attended to
the whole context, which over-counts sliding-window and recurrent models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.drafting import SharedTable
from engine.gguf_info import GGUFHeader, read_header

MiB = 1024 * 1024

# bytes per value of a KV cache type (q8_0: blocks of 32 values in 34 bytes)
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}

# Sliding-window layers by architecture, as llama.cpp (src/models/*.cpp) marks them when the
# file does not say: (pattern, dense_first). With dense_first a layer il is windowed unless
# il % pattern == 0; otherwise unless il % pattern == pattern - 1.
SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False),
                "gemma3n": (5, False), "cohere2": (4, False), "cohere2moe": (4, True),
                "llama4": (4, False), "gpt-oss": (2, False), "exaone4": (4, False),
                "olmo2": (4, False), "afmoe": (4, False), "smallthinker": (4, True),
                "plamo3": (8, False)}

PAD = 256   # llama.cpp pads a stream's cells (and a sliding window's) to this

# Python-side cost of a loaded model: a fixed part and a part per vocabulary entry (token
# pieces, the eog set, the token bound's scan), measured with both model files.
PYTHON_FIXED = 24 * MiB
PYTHON_PER_TOKEN = 320


def _pad(n: int, to: int = PAD) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs from a GGUF header."""
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: list[int]           # per layer
    k_width: list[int]          # per layer: n_head_kv x key length (llama.cpp's n_embd_k_gqa)
    v_width: list[int]
    swa_layers: list[bool]      # per layer: attends to a sliding window only
    n_swa: int                  # the window (0: none)
    weight_bytes: int

    @classmethod
    def of(cls, header: GGUFHeader) -> ModelShape:
        meta = header.metadata
        arch = meta.get("general.architecture") or "unknown"

        def get(key: str, default=None):
            value = meta.get(f"{arch}.{key}")
            return default if value is None else value

        n_layer = int(get("block_count", 0))
        n_embd = int(get("embedding_length", 0))

        def per_layer(value, default: int) -> list[int]:
            if value is None:
                value = default
            if isinstance(value, list):
                return [int(v) for v in value[:n_layer]] + [int(value[-1])] * (
                    n_layer - len(value)) if value else [default] * n_layer
            return [int(value)] * n_layer

        n_head = per_layer(get("attention.head_count"), 1)
        n_head_kv = per_layer(get("attention.head_count_kv"), 0)
        n_head_kv = [kv or h for kv, h in zip(n_head_kv, n_head)]
        head_dim = n_embd // max(1, n_head[0]) if n_embd else 0
        key_len = int(get("attention.key_length", head_dim))
        value_len = int(get("attention.value_length", key_len))
        n_ff = get("feed_forward_length", 4 * n_embd)
        n_ff = max(n_ff) if isinstance(n_ff, list) else int(n_ff)
        n_swa = int(get("attention.sliding_window", 0) or 0)
        swa = [False] * n_layer
        if n_swa:
            pattern = get("attention.sliding_window_pattern")
            if isinstance(pattern, list):
                swa = [bool(v) for v in pattern[:n_layer]] + [False] * (n_layer - len(pattern))
            else:
                n, dense_first = ((int(pattern), False) if pattern is not None
                                  else SWA_PATTERNS.get(arch, (None, False)))
                if n is not None:
                    swa = [n == 0 or (il % n != 0 if dense_first else il % n < n - 1)
                           for il in range(n_layer)]
        n_vocab = int(get("vocab_size", 0)) or _vocab_rows(header, n_embd)
        return cls(arch, n_layer, n_embd, n_ff, n_vocab, n_head,
                   [h * key_len for h in n_head_kv], [h * value_len for h in n_head_kv],
                   swa, n_swa if any(swa) else 0, sum(t.n_bytes for t in header.tensors))

    def kv_cell_bytes(self, kv_type: str, window: bool | None = None) -> float:
        """Bytes of one cell over the layers (window: only the sliding-window layers (True),
        only the others (False), or all (None))."""
        per_value = KV_TYPE_BYTES[kv_type]
        return sum((k + v) * per_value for k, v, s in zip(self.k_width, self.v_width,
                                                          self.swa_layers)
                   if window is None or s == window)


def _vocab_rows(header: GGUFHeader, n_embd: int) -> int:
    """The vocabulary's size from the token-embedding tensor, where the header has no count."""
    for t in header.tensors:
        if t.name == "token_embd.weight" and n_embd:
            return t.n_elements // n_embd
    return 0


@dataclass(frozen=True)
class ContextShape:
    """The settings of one llama.cpp context that decide its memory (engine.EngineConfig)."""
    n_ctx: int            # per sequence
    max_seqs: int
    n_seq_max: int        # seq ids (max_seqs + cache_seqs with prefix caching)
    kv_unified: bool
    kv_type: str
    flash_attn: bool
    n_ubatch: int         # tokens of the largest batch (step_tokens)
    n_outputs_max: int    # logits rows of the largest batch
    swap_tokens: int      # tokens of KV a context may hold swapped out in RAM
    speculative: bool = False   # drafts: a shared n-gram table per context
    embed_ctx: int = 0          # the embedding context's length (0: n_ctx)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, by part (module doc). `total` is what loading the model takes; `embedding` is
    taken on top, when /v1/embeddings first uses the model."""
    weights: int
    kv: int
    compute: int
    swap: int
    python: int
    embedding: int
    parts: dict = field(default_factory=dict, compare=False)   # detail for reports

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.swap + self.python

    def as_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "kv": self.kv,
                "compute": self.compute, "swap": self.swap, "python": self.python,
                "embedding": self.embedding, **self.parts}


def kv_bytes(shape: ModelShape, ctx: ContextShape) -> int:
    """The KV cache llama.cpp allocates for a context (module doc)."""
    if ctx.kv_unified:
        cells, streams = _pad(ctx.n_ctx * ctx.max_seqs), 1
        window_cells = _pad(min(cells, shape.n_swa * ctx.n_seq_max + ctx.n_ubatch))
    else:
        cells, streams = _pad(ctx.n_ctx), ctx.n_seq_max
        window_cells = _pad(min(cells, shape.n_swa + ctx.n_ubatch))
    full = shape.kv_cell_bytes(ctx.kv_type, window=False) * cells
    windowed = shape.kv_cell_bytes(ctx.kv_type, window=True) * window_cells
    return int(streams * (full + windowed))


def compute_bytes(shape: ModelShape, ctx: ContextShape, kv_cells: int) -> int:
    """llama.cpp's compute buffer for the largest batch, and its output buffer (logits of
    the outputs of a batch, at least one row per seq id). The terms: the logits of the
    outputs, the batch's activations (hidden state and feed-forward widths), and the attention
    mask; plain attention also holds the scores of every head over the cells a batch sees."""
    u, f32 = ctx.n_ubatch, 4
    logits = f32 * shape.n_vocab * ctx.n_outputs_max
    activations = f32 * u * (6 * shape.n_embd + 3 * shape.n_ff + shape.n_embd)
    mask = 2 * u * kv_cells
    scores = 0 if ctx.flash_attn else f32 * u * kv_cells * max(shape.n_head)
    output = f32 * shape.n_vocab * max(ctx.n_outputs_max, ctx.n_seq_max)
    return int(logits + activations + mask + scores + output + 8 * MiB)


def estimate(shape: ModelShape, ctx: ContextShape, contexts: int = 1) -> MemoryEstimate:
    """The memory a model takes with `contexts` contexts of these settings (module doc)."""
    kv = kv_bytes(shape, ctx)
    kv_cells = _pad(ctx.n_ctx) if not ctx.kv_unified else _pad(ctx.n_ctx * ctx.max_seqs)
    compute = compute_bytes(shape, ctx, kv_cells)
    swap = int(ctx.swap_tokens * shape.kv_cell_bytes(ctx.kv_type))
    table = SharedTable.bytes_for() if ctx.speculative else 0
    python = PYTHON_FIXED + PYTHON_PER_TOKEN * shape.n_vocab + table * contexts
    n_embed = ctx.embed_ctx or ctx.n_ctx
    embed_ctx = ContextShape(n_ctx=n_embed, max_seqs=1, n_seq_max=1, kv_unified=True,
                             kv_type="f16", flash_attn=False, n_ubatch=n_embed,
                             n_outputs_max=n_embed, swap_tokens=0)
    embedding = (kv_bytes(shape, embed_ctx)
                 + compute_bytes(shape, embed_ctx, _pad(n_embed)))
    return MemoryEstimate(shape.weight_bytes, kv * contexts, compute * contexts,
                          swap * contexts, python, embedding,
                          parts={"kv_per_context": kv, "draft_table": table, "kv_cell_bytes":
                                 round(shape.kv_cell_bytes(ctx.kv_type), 1)})


def read_shape(path: str | Path) -> ModelShape:
    return ModelShape.of(read_header(path))
