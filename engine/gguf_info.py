"""Facts about a GGUF file, read with the gguf package (no weights are loaded)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    return value


def gguf_facts(path: str | Path) -> dict:
    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture") or "unknown"
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    file_type = _field(reader, "general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = str(file_type)
    return {
        "architecture": arch,
        "name": _field(reader, "general.name"),
        "parameters": n_params,
        "quantization": quant,
        "tensor_types": dict(types.most_common()),
        "context_length": _field(reader, f"{arch}.context_length"),
        "file_size": path.stat().st_size,
        "bits_per_weight": round(path.stat().st_size * 8 / n_params, 2) if n_params else None,
        "chat_template": _field(reader, "tokenizer.chat_template") is not None,
    }


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template stored in the file (the one llama.cpp hands the server)."""
    return _field(gguf.GGUFReader(str(path)), "tokenizer.chat_template")
