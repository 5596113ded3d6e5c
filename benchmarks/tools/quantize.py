"""Building a quantization ladder: an F16 GGUF dequantized from a quantized one (with the gguf
package), llama.cpp's own quantizer (llama_model_quantize) on it, and what each file holds."""
from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from pathlib import Path

import gguf
import llama_cpp as C
import numpy as np

from engine.gguf_info import declared_file_type, read_header
from engine.model import init_backend

_INTERNAL_PREFIX = "GGUF."
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16)


def file_type_id(name: str) -> int:
    """llama.cpp's LLAMA_FTYPE_* value for a type name such as "Q4_K_M" or "F16"."""
    for prefix in ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"):
        value = getattr(C, prefix + name.upper(), None)
        if value is not None:
            return int(value)
    raise ValueError(f"unknown llama.cpp file type {name!r}")


def atomic_target(dst: Path) -> Path:
    """A temporary name beside `dst` (its folder made), renamed to `dst` once written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst.with_name(f".{dst.name}.{os.getpid()}.tmp")


def dequantize_to_f16(src: str | Path, dst: str | Path) -> float:
    """Write `dst`: the tensors of `src` dequantized to F16 (F32 tensors, 1-D ones included,
    stay F32) and every metadata field copied, general.file_type set to MOSTLY_F16.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    tmp = atomic_target(dst)
    writer = gguf.GGUFWriter(str(tmp), arch)   # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith(_INTERNAL_PREFIX) or key in ("general.architecture", "general.file_type"):
            continue
        copy_field(writer, key, field)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, _as_float(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return time.perf_counter() - t0


def copy_field(writer: gguf.GGUFWriter, key: str, field) -> None:
    """One metadata field of a GGUFReader written as it is (arrays with their element type)."""
    vtype = gguf.GGUFValueType(field.types[0])
    sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)


def _as_float(tensor) -> np.ndarray:
    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32)
    values = gguf.quants.dequantize(tensor.data, kind) if kind not in _FLOAT_TYPES \
        else np.asarray(tensor.data, dtype=np.float32)
    return values.astype(np.float32 if len(tensor.shape) == 1 else np.float16)


def quantize(src: str | Path, dst: str | Path, type_name: str, n_threads: int = 2) -> float:
    """llama.cpp's quantizer: `src` (F16/F32 GGUF) to `dst` of type `type_name`.
    Returns the seconds it took. Types that need an importance matrix (most IQ*) fail."""
    init_backend()   # routes llama.cpp's per-tensor messages to logging
    tmp = atomic_target(Path(dst))
    params = C.llama_model_quantize_default_params()
    params.ftype = file_type_id(type_name)
    params.nthread = n_threads
    t0 = time.perf_counter()
    status = C.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize to {type_name} failed ({status})")
    tmp.replace(dst)
    return seconds


def tensor_mix(path: str | Path) -> dict:
    """What a GGUF really holds: tensor types (count and share of weights), the type of the
    token embedding, bits per weight over all tensors and over the 2-D (matrix) tensors."""
    header = read_header(path)
    count: Counter[str] = Counter()
    weights: Counter[str] = Counter()
    bytes_all = elems_all = bytes_2d = elems_2d = 0
    embedding = None
    for t in header.tensors:
        kind = t.type_name
        count[kind] += 1
        weights[kind] += t.n_elements
        bytes_all += t.n_bytes
        elems_all += t.n_elements
        if t.n_dims >= 2:
            bytes_2d += t.n_bytes
            elems_2d += t.n_elements
        if t.name == "token_embd.weight":
            embedding = kind
    return {
        "declared_type": declared_file_type(header.metadata),
        "tensor_types": dict(count.most_common()),
        "weight_share": {k: round(v / elems_all, 4) for k, v in weights.most_common()},
        "token_embd_type": embedding,
        "parameters": elems_all,
        "bpw_all": bytes_all * 8 / elems_all,
        "bpw_matrices": bytes_2d * 8 / elems_2d if elems_2d else None,
        "file_bytes": Path(path).stat().st_size,
    }
