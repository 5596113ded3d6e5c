"""A context's settings: what the server's configuration (or a test) asks for, and what is left
to the model (resolved_for: the attention kernel, and the prompt chunk and step budget by where
the model computes)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from engine.llama import KV_TYPES
from engine.llama_tricks import has_row_invariant_attention
from engine.memory import ContextShape
from scheduler import Preemption

# Prompt chunks and step budgets by where a model computes: on a GPU a step costs about the same
# for 16 tokens as for 256, so prompts go in larger chunks within larger steps (docs/gpu.md).
DEVICE_DEFAULTS = {"cpu": {"prefill_chunk": 16, "max_batch_tokens": 256},
                   "gpu": {"prefill_chunk": 256, "max_batch_tokens": 1024}}


class ModelKind(Protocol):
    """What resolved_for asks of a model: a loaded Model, or a file's facts before loading."""
    on_gpu: bool

    @property
    def has_k_quants(self) -> bool: ...


# draftless speculative decoding (engine/drafting.py, scheduler/speculation.py)
SPECULATIVE = ("ngram", "off")


@dataclass
class EngineConfig:
    n_ctx: int = 2048                 # per sequence: the longest prompt + output
    max_seqs: int = 16
    n_threads: int = 2
    max_batch_tokens: int | None = None   # tokens per step (decodes first, then prompt
                                      # chunks); None: by device (resolved_for)
    wave_batch_tokens: int = 2048     # a wave of prompts in one step (scheduler doc); 0: off
    step_target_ms: float = 500.0     # beside decoding streams, prompt tokens fill a step up
                                      # to this (scheduler doc); 0: one grid cell a prompt
    block_size: int = 8               # KV budget and prefix-cache lookup unit (hits may end
                                      # inside one)
    prefill_chunk: int | None = None  # aligned prompt chunk size (see benchmarks.chunking);
                                      # None: by device (resolved_for)
    prefix_caching: bool = True
    kv_unified: bool = False
    flash_attn: bool | None = None    # None: flash attention unless the model has K-quants
                                      # (resolved_for; docs/prefix-cache.md, "Attention kernels")
    kv_type: str = "f16"              # KV cache f16 or q8_0 (half the memory; needs flash_attn)
    scheduler: str = "fifo"
    preemption: Preemption = Preemption.SWAP
    max_queue: int = 256
    cache_seqs: int = 0               # extra llama.cpp seq ids that hold cached prefixes (with
                                      # split KV each is a stream of n_ctx cells; with none,
                                      # the idle sequences' streams hold them)
    swap_tokens: int | None = None    # tokens of KV a context may keep swapped out in RAM
                                      # (preemption); beyond it preempted sequences are
                                      # recomputed. None: n_ctx (one whole sequence)
    adaptive_threads: bool = True     # fewer threads while other processes use our cores
    thread_share: float = 1.0         # this context's part of the process's threads
    speculative: str = "ngram"        # draftless speculative decoding: "ngram" or "off"
    max_draft: int = 8                # drafted tokens a sequence may verify in one step
    spec_policy: str = "adaptive"     # "adaptive": where the measured costs say drafts pay;
                                      # "always": every draft, whole (tests, measurements)
    embed_tokens: int = 2048          # the longest input of an embedding request: its own
                                      # context's length (capped at n_ctx); it is one ubatch
    probe_dir: str | None = None      # where the speculation probe's answers are kept across
                                      # restarts (engine/speculation.py); None: this process only

    def __post_init__(self):
        self.preemption = Preemption(self.preemption)
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"KV cache type {self.kv_type!r}: one of {', '.join(KV_TYPES)}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative {self.speculative!r}: one of {', '.join(SPECULATIVE)}")
        if self.spec_policy not in ("adaptive", "always"):
            raise ValueError(f"spec_policy {self.spec_policy!r}: adaptive or always")
        if self.max_draft < 1:
            raise ValueError("max_draft must be at least 1")
        if self.kv_type != "f16" and self.flash_attn is False:
            raise ValueError(f"a {self.kv_type} KV cache needs flash attention (llama.cpp "
                             "quantizes V only for its flash-attention kernel)")

    def resolved_for(self, model: ModelKind) -> EngineConfig:
        """The settings left to the model, chosen for it. With flash_attn None (auto): flash
        attention on its row-invariant path (engine/llama_tricks.py, Attention), which is exact
        and at least as fast as plain attention on prompts and decoding alike
        (docs/performance.md).
        Where this llama.cpp lacks that path, flash attention can only be exact on ggml's
        reference path, which turns off the tiled matmul of K-quant weights: then plain
        attention for K-quant models (a q8_0 cache needs flash attention either way). With
        prefill_chunk or max_batch_tokens None: DEVICE_DEFAULTS for where the model computes
        (Model.on_gpu)."""
        device = DEVICE_DEFAULTS["gpu" if model.on_gpu else "cpu"]
        flash_attn = self.flash_attn
        if flash_attn is None:
            flash_attn = (self.kv_type != "f16" or not model.has_k_quants
                          or has_row_invariant_attention())
        return replace(self, flash_attn=flash_attn,
                       prefill_chunk=self.prefill_chunk or device["prefill_chunk"],
                       max_batch_tokens=self.max_batch_tokens or device["max_batch_tokens"])

    @property
    def step_tokens(self) -> int:
        """The most tokens one step (one llama_decode) may take (of a config resolved_for a
        model)."""
        assert self.max_batch_tokens is not None, "a config resolved_for a model"
        return max(self.max_batch_tokens, self.wave_batch_tokens)

    @property
    def embed_ctx(self) -> int:
        """The embedding context's length: the longest input of an embedding request."""
        return max(1, min(self.embed_tokens, self.n_ctx))

    @property
    def max_swapped_tokens(self) -> int:
        return self.n_ctx if self.swap_tokens is None else self.swap_tokens

    @property
    def n_outputs_max(self) -> int:
        """The most logits rows one llama_decode call asks for (of a config resolved_for a
        model): a row per piece, except a prompt whose logprobs are asked (echo), whose pieces
        want every row, one grid cell at most a step; and at least one per seq id (llama.cpp's
        floor); with speculation, a row for each token of a verification piece too.
        llama.cpp sizes its compute and output buffers by it."""
        assert self.prefill_chunk is not None, "a config resolved_for a model"
        rows = self.n_seq_max * self.prefill_chunk
        if self.speculative != "off":
            rows = max(rows, self.n_seq_max * (1 + self.max_draft))
        return max(self.n_seq_max, min(self.step_tokens, rows))

    def memory_shape(self) -> ContextShape:
        """What decides a context's memory (engine/memory.py), of a config resolved_for a
        model."""
        assert self.flash_attn is not None, "a config resolved_for a model"
        return ContextShape(n_ctx=self.n_ctx, max_seqs=self.max_seqs, n_seq_max=self.n_seq_max,
                            kv_unified=self.kv_unified, kv_type=self.kv_type,
                            flash_attn=self.flash_attn, n_ubatch=self.step_tokens,
                            n_outputs_max=self.n_outputs_max,
                            swap_tokens=self.max_swapped_tokens
                            if self.preemption is Preemption.SWAP else 0,
                            speculative=self.speculative != "off", embed_ctx=self.embed_ctx)

    @property
    def n_seq_max(self) -> int:
        return min(256, self.max_seqs + (self.cache_seqs if self.prefix_caching else 0))

    @property
    def total_cells(self) -> int:
        """Split KV: one stream of n_ctx cells per seq id. Unified: one pool shared by all."""
        return self.n_ctx * (self.max_seqs if self.kv_unified else self.n_seq_max)
