"""multipart/form-data (RFC 7578), as file uploads send it, read from a body the edge has
already read whole (server/http/edge.py bounds its size). Its own small parser, so that uploads
need no extra dependency: byte searches for the boundary, and each part's Content-Disposition
(`name`, `filename`) and Content-Type."""
from __future__ import annotations

import re
from dataclasses import dataclass

_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


class MultipartError(ValueError):
    pass


@dataclass
class Part:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None


def header_params(value: str) -> tuple[str, dict[str, str]]:
    """A header's main value and its parameters (`form-data; name="file"` → ("form-data",
    {"name": "file"})); quoted values unquoted."""
    main, _, rest = value.partition(";")
    params = {}
    for key, raw in _PARAM.findall(";" + rest):
        raw = raw.strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[key.lower()] = raw
    return main.strip().lower(), params


def parse(content_type: str, body: bytes) -> dict[str, Part]:
    """The parts of a multipart/form-data body by name (the first of a repeated name)."""
    kind, params = header_params(content_type or "")
    if kind != "multipart/form-data":
        raise MultipartError("the body must be multipart/form-data (a file upload)")
    boundary = params.get("boundary", "")
    if not 0 < len(boundary) <= 200:
        raise MultipartError("the multipart/form-data body has no boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    start = body.find(delimiter)
    if start < 0:
        raise MultipartError("the multipart body has no part")
    pos, parts = start + len(delimiter), {}
    while True:
        if body.startswith(b"--", pos):   # the closing delimiter
            return parts
        if not body.startswith(b"\r\n", pos):
            raise MultipartError("malformed multipart body (a boundary line)")
        head_end = body.find(b"\r\n\r\n", pos)
        if head_end < 0:
            raise MultipartError("malformed multipart body (a part's headers)")
        headers = _headers(body[pos + 2:head_end]) if head_end > pos else {}
        data_start = head_end + 4
        end = body.find(b"\r\n" + delimiter, data_start)
        if end < 0:
            raise MultipartError("the multipart body ends before its closing boundary")
        disposition, fields = header_params(headers.get("content-disposition", ""))
        if disposition != "form-data" or "name" not in fields:
            raise MultipartError("a multipart part has no Content-Disposition: form-data name")
        filename = fields.get("filename")
        parts.setdefault(fields["name"], Part(fields["name"], body[data_start:end], filename,
                                              headers.get("content-type")))
        pos = end + 2 + len(delimiter)


def _headers(raw: bytes) -> dict[str, str]:
    out = {}
    for line in raw.decode("utf-8", "replace").split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            raise MultipartError("malformed multipart part header")
        out[name.strip().lower()] = value.strip()
    return out
