"""Facts about a GGUF file: its metadata and tensor table, read from the file's header alone
(no weights are loaded).

The gguf package's GGUFReader maps every field and every element of every array into numpy
objects: 4-5 s for SmolLM2's header (a 49,152-token vocabulary), 17-18 s for Gemma 3's
(262,144 tokens). The server reads these facts once at start-up, so it reads the header itself:
scalars, strings and short numeric arrays are decoded, other arrays are stepped over, tensors
give their name, type and element count. Layout: github.com/ggml-org/ggml docs/gguf.md
(versions 2 and 3)."""
from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf

# value type -> struct format of a scalar (types 8 STRING and 9 ARRAY are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
SMALL_ARRAY = 4096   # numeric arrays up to this length are read (per-layer head counts, ...)
_U64 = struct.Struct("<Q")


@dataclass
class TensorInfo:
    name: str
    type_name: str       # ggml's name of its element type: "Q4_1", "F32", ...
    n_elements: int
    n_dims: int
    n_bytes: int         # of its data in the file


@dataclass
class GGUFHeader:
    metadata: dict       # key -> value; numeric arrays of up to SMALL_ARRAY values as lists,
                         # other arrays are left out (None), except their presence
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the file's end")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += self.scalar("<Q")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS and count <= SMALL_ARRAY:   # per-layer values: read
                fmt = _SCALARS[etype]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)
                self.pos += count * struct.calcsize(fmt)
                return list(values)
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            elif etype == _STRING:   # a vocabulary: one length and its bytes per token
                pos, buf, length = self.pos, self.buf, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(etype)
            return None
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.skip_string()
        else:
            self.value(vtype)


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and the tensor table of a GGUF file (versions 2 and 3)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf, \
            memoryview(buf) as view:
        if bytes(view[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        try:
            return _parse(_Cursor(view))
        except struct.error as exc:
            raise ValueError(f"{path}: the GGUF header ends early ({exc})") from None
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def _parse(cur: _Cursor) -> GGUFHeader:
    """The header after its magic: version, counts, metadata, tensor table."""
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):   # (a big-endian file reads as 0x03000000)
        raise ValueError(f"GGUF version {version} (only 2 and 3 are read)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        ttype = cur.scalar("<I")
        cur.pos += 8   # the data's offset
        n = 1
        for d in dims:
            n *= d
        kind = gguf.GGMLQuantizationType(ttype)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        tensors.append(TensorInfo(name, kind.name, n, n_dims, n * size // block))
    return GGUFHeader(metadata, tensors)


def declared_file_type(metadata: dict) -> str | None:
    """The type the file says it is (general.file_type: "Q4_1", "Q4_K_M", ...), whatever its
    tensors hold; the number itself when gguf does not know it."""
    file_type = metadata.get("general.file_type")
    if file_type is None:
        return None
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(file_type)


def k_quant_file_type(file_type: int | str | None) -> bool:
    """Is a file of this general.file_type a K-quant or IQ file (Q4_K_M, Q6_K, IQ4_XS, ...;
    unknown counts as yes)? (engine.Model.has_k_quants)"""
    if file_type is None:
        return True
    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except ValueError:
        return True
    return "_K" in name or "IQ" in name


def gguf_facts(path: str | Path, header: GGUFHeader | None = None) -> dict:
    path = Path(path)
    header = header or read_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture") or "unknown"
    n_params = sum(t.n_elements for t in header.tensors)
    types = Counter(t.type_name for t in header.tensors)
    return {
        "architecture": arch,
        "name": meta.get("general.name"),
        "parameters": n_params,
        "quantization": declared_file_type(meta),
        "tensor_types": dict(types.most_common()),
        "context_length": meta.get(f"{arch}.context_length"),
        "file_size": path.stat().st_size,
        "bits_per_weight": round(path.stat().st_size * 8 / n_params, 2) if n_params else None,
        "chat_template": meta.get("tokenizer.chat_template") is not None,
    }


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template stored in the file (the one llama.cpp hands the server)."""
    return read_header(path).metadata.get("tokenizer.chat_template")
