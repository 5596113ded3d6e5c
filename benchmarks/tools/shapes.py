"""GGUF files in the shapes of the models people run on CPUs, with random weights: measured speed
and memory at those sizes without fetching the real weights.

    python -m benchmarks.tools.shapes                    # every shape of SHAPES
    python -m benchmarks.tools.shapes llama-3.2-1b       # one (make shapes SHAPES=llama-3.2-1b)
    python -m benchmarks.tools.shapes --list

Each file is a `llama` architecture GGUF with the layer count, widths, heads, KV heads, feed-forward
width, head size and RoPE base of the model it is named after, and the tokenizer and chat template
of a small real GGUF (SmolLM2-135M-Instruct by default, so the vocabulary, and with it the
embedding matrix, has SmolLM2's 49,152 tokens, not the real model's). The weights are normal
noise (standard deviation 0.02, the norms 1), written as F16 (F32 for the norms) with the gguf
package, then quantized by llama.cpp's own quantizer (Q4_K_M by default); the F16 file is
deleted. Output: models/shapes/<name>-<TYPE>.gguf, written under a temporary name and renamed,
skipped when it is there already.

The answers of such a model are meaningless and its end-of-text token comes at random, so a
measurement must decode greedily a fixed number of tokens (`ignore_eos`, `max_tokens`); the
time and memory each token costs are those of the real model of that shape (but for the
smaller vocabulary: the output matrix of a real Llama 3.2 1B is 2.6 times this one's).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.tools.quantize import atomic_target, copy_field, quantize

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_DIR = ROOT / "models" / "shapes"
SCALE = 0.02   # standard deviation of the random weights: activations stay of order 1
MiB = 2**20


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, as a `llama` GGUF declares them."""
    name: str
    hidden: int           # embedding_length
    layers: int           # block_count
    heads: int            # attention.head_count
    kv_heads: int         # attention.head_count_kv
    ffn: int              # feed_forward_length
    head_dim: int = 0     # 0: hidden // heads
    rope_theta: float = 500_000.0
    tied: bool = True     # the output matrix is the token embedding
    context: int = 131_072
    norm_eps: float = 1e-5
    real_vocab: int = 0   # the vocabulary of the model the shape is taken from (for the report)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def tensors(self, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every tensor: rows × columns, as llama.cpp names them."""
        h, q, kv = self.hidden, self.heads * self.dim, self.kv_heads * self.dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)),
                    (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                    (b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,)),
                    (b + "ffn_gate.weight", (self.ffn, h)), (b + "ffn_up.weight", (self.ffn, h)),
                    (b + "ffn_down.weight", (h, self.ffn))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (n_vocab, h)))
        return out

    def parameters(self, n_vocab: int) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors(n_vocab))


# The shapes of models people run on CPUs (their config.json). Qwen2.5's Q/K/V biases are left
# out (the file is a `llama` one; they are a few thousand additions per token).
SHAPES = {s.name: s for s in (
    Shape("llama-3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, head_dim=64,
          real_vocab=128_256),
    Shape("llama-3.2-3b", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, head_dim=128,
          real_vocab=128_256),
    Shape("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, head_dim=128,
          tied=False, real_vocab=128_256),
    Shape("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, head_dim=128,
          rope_theta=1_000_000.0, tied=False, context=32_768, norm_eps=1e-6,
          real_vocab=152_064),
)}


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def tensor_values(name: str, shape: tuple[int, ...], rng: np.random.Generator,
                  rows_at_once: int = 4096) -> np.ndarray:
    """A norm: ones (F32, as llama.cpp keeps 1-D tensors); a matrix: normal noise × SCALE (F16),
    drawn a block of rows at a time so that no F32 copy of a large matrix is held."""
    if is_norm(name):
        return np.ones(shape, dtype=np.float32)
    out = np.empty(shape, dtype=np.float16)
    for i in range(0, shape[0], rows_at_once):
        block = rng.standard_normal((min(rows_at_once, shape[0] - i), *shape[1:]),
                                    dtype=np.float32)
        block *= SCALE
        out[i:i + len(block)] = block
    return out


def write_f16(shape: Shape, dst: str | Path, tokenizer_model: str | Path = TOKENIZER_MODEL,
              seed: int = 0) -> int:
    """Write `dst`: a `llama` GGUF of `shape` with random weights (F16, norms F32), the tokenizer
    and chat template of `tokenizer_model`. Tensors are written one at a time. Returns the
    vocabulary size."""
    reader = gguf.GGUFReader(str(tokenizer_model))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{tokenizer_model} has no tokenizer")
    n_vocab = len(tokens.data)
    writer = gguf.GGUFWriter(str(dst), "llama")
    write_metadata(writer, shape, n_vocab)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            copy_field(writer, key, field)
    layout = shape.tensors(n_vocab)
    for name, dims in layout:
        dtype = np.float32 if is_norm(name) else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * dtype().itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, dims) in enumerate(layout):
        writer.write_tensor_data(tensor_values(name, dims, np.random.default_rng([seed, i])))
    writer.close()
    return n_vocab


def write_metadata(writer: gguf.GGUFWriter, shape: Shape, n_vocab: int) -> None:
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.dim)
    writer.add_value_length(shape.dim)
    writer.add_rope_dimension_count(shape.dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_vocab_size(n_vocab)


def output_path(shape: Shape, type_name: str = "Q4_K_M", out_dir: str | Path = OUT_DIR) -> Path:
    return Path(out_dir) / f"{shape.name}-{type_name}.gguf"


def make(shape: Shape, type_name: str = "Q4_K_M", out_dir: str | Path = OUT_DIR,
         tokenizer_model: str | Path = TOKENIZER_MODEL, threads: int = 2,
         seed: int = 0) -> dict:
    """models/shapes/<name>-<type>.gguf for `shape`, unless it is there: the F16 file written,
    quantized by llama.cpp, deleted. Returns what was done (path, seconds, bytes)."""
    dst = output_path(shape, type_name, out_dir)
    if dst.exists():
        return {"path": str(dst), "made": False, "bytes": dst.stat().st_size}
    f16 = atomic_target(dst.with_name(f"{shape.name}-F16.gguf"))
    t0 = time.perf_counter()
    try:
        n_vocab = write_f16(shape, f16, tokenizer_model, seed)
        written = time.perf_counter() - t0
        f16_bytes = f16.stat().st_size
        quantized = quantize(f16, dst, type_name, threads)
    finally:
        f16.unlink(missing_ok=True)
    return {"path": str(dst), "made": True, "bytes": dst.stat().st_size, "f16_bytes": f16_bytes,
            "parameters": shape.parameters(n_vocab), "n_vocab": n_vocab,
            "f16_seconds": written, "quantize_seconds": quantized,
            "seconds": time.perf_counter() - t0}


def describe(shape: Shape, n_vocab: int = 49_152) -> str:
    real = shape.parameters(shape.real_vocab) if shape.real_vocab else None
    return (f"{shape.name:<14} hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads "
            f"({shape.kv_heads} KV) of {shape.dim}, FFN {shape.ffn}, RoPE base "
            f"{shape.rope_theta:g}, {'tied' if shape.tied else 'untied'} output: "
            f"{shape.parameters(n_vocab) / 1e9:.2f} B parameters"
            + (f" ({real / 1e9:.2f} B with its own {shape.real_vocab:,}-token vocabulary)"
               if real else ""))


def _chosen(names: list[str]) -> Iterator[Shape]:
    for name in names:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        yield SHAPES[name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=list(SHAPES), help="shapes (default: all)")
    p.add_argument("--type", default="Q4_K_M", help="llama.cpp file type to quantize to")
    p.add_argument("--out-dir", default=str(OUT_DIR))
    p.add_argument("--tokenizer-model", default=str(TOKENIZER_MODEL),
                   help="GGUF whose tokenizer and chat template are copied")
    p.add_argument("--threads", type=int, default=2, help="quantizer threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = p.parse_args(argv)
    shapes = list(_chosen(args.names))
    if args.list:
        print("\n".join(describe(s) for s in SHAPES.values()))
        return 0
    for shape in shapes:
        print(describe(shape), flush=True)
        r = make(shape, args.type, args.out_dir, args.tokenizer_model, args.threads, args.seed)
        if not r["made"]:
            print(f"  {r['path']}: there already ({r['bytes'] / MiB:.0f} MiB), skipped")
            continue
        print(f"  {r['path']}: {r['bytes'] / MiB:.0f} MiB in {r['seconds']:.0f} s (F16 "
              f"{r['f16_bytes'] / MiB:.0f} MiB written in {r['f16_seconds']:.0f} s, quantized "
              f"in {r['quantize_seconds']:.0f} s, deleted)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
