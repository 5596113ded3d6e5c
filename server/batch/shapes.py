"""The Batch API's shapes, as OpenAI's: the file and batch objects (from the store's rows), the
body of `POST /v1/batches`, the input file's request lines (checked when a batch is validated),
and the output and error files' lines.

An input line: `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}`. An
output line: `{"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`, with the route's answer as `body` (status 200: the output file) or the
route's error body (`{"error": {…}}`, its status: the error file); a line that never got an
answer (the batch expired or was cancelled first) has `"response": null` and `"error": {"code",
"message"}` (`batch_expired`, `batch_cancelled`).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.openai.bodies import Body

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_REPORTED_ERRORS = 100        # a failed batch's errors list at most this many
MAX_CUSTOM_ID = 512


# ---- objects ---------------------------------------------------------------------------------
def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


def batch_object(row: dict) -> dict:
    errors = json.loads(row["errors"]) if row.get("errors") else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"], "created_at": row["created_at"],
        "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"],
        "failed_at": row["failed_at"], "expired_at": row["expired_at"],
        "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"],
                           "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row.get("metadata") else None,
        "model": row.get("model"),
        "usage": {"input_tokens": row["input_tokens"],
                  "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                  "output_tokens": row["output_tokens"],
                  "output_tokens_details": {"reasoning_tokens": row["reasoning_tokens"]},
                  "total_tokens": row["input_tokens"] + row["output_tokens"]},
    }


def page(objects: list[dict], has_more: bool) -> dict:
    """A list answer with OpenAI's cursor fields (`after` = `last_id` for the next page)."""
    return {"object": "list", "data": objects,
            "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}


# ---- POST /v1/batches -----------------------------------------------------------------------
class CreateBatch(Body):
    """The body of POST /v1/batches. Unknown fields are kept so that the route refuses them by
    name."""
    model_config = ConfigDict(extra="allow")
    EXTRAS: ClassVar[dict[str, dict]] = {}

    input_file_id: str = Field(..., min_length=1)
    endpoint: Literal[ENDPOINTS]   # type: ignore[valid-type]
    completion_window: str = Field(..., description="\"24h\" (OpenAI's only value); this "
                                   "server also takes other durations (\"1h\", \"30m\")")
    metadata: dict[str, str] | None = Field(None, description="up to 16 pairs; keys of at most "
                                            "64 characters, values of at most 512")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 pairs")
            if any(len(k) > 64 for k in value):
                raise ValueError("keys have at most 64 characters")
            if any(len(v) > 512 for v in value.values()):
                raise ValueError("values have at most 512 characters")
        return value


# ---- OpenAPI documentation of the answers -----------------------------------------------------
class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class BatchObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                    "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    model: str | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---- the input file ---------------------------------------------------------------------------
def count_lines(text: str) -> int:
    """Request lines in a JSONL text (blank lines are not requests)."""
    return sum(1 for line in text.split("\n") if line.strip())


def _error(line: int | None, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "line": line, "message": message, "param": param}


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_input(content: bytes, endpoint: str, max_lines: int) -> tuple[
        list[tuple[int, str, str]], str | None, list[dict]]:
    """A batch's input file, checked line by line as OpenAI validates one: (its request lines
    as (line number, custom_id, the line), the model the first one names, and the errors: a
    line that is not a JSON object, lacks `custom_id`, `method` or `body`, repeats a
    `custom_id`, or names another `url` than the batch's endpoint). Any error fails the batch.
    The body of each line is checked later, when it runs, as its route checks a request."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], None, [_error(None, "invalid_file", f"the input file is not UTF-8 text "
                                 f"(byte {exc.start})")]
    lines: list[tuple[int, str, str]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    model = None
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        error = _check_line(number, raw, endpoint, seen)
        if error is not None:
            errors.append(error)
            continue
        request = json.loads(raw)
        if model is None and isinstance(request["body"].get("model"), str):
            model = request["body"]["model"]
        lines.append((number, request["custom_id"], raw))
    total = len(lines) + len(errors)
    if total == 0:
        errors.append(_error(None, "empty_file", "the input file has no request lines"))
    elif total > max_lines:
        errors.insert(0, _error(None, "too_many_lines", f"the input file has {total} request "
                                f"lines; a batch may have at most {max_lines} "
                                "(PAGEDLLAMA_BATCH_MAX_LINES)"))
    if len(errors) > MAX_REPORTED_ERRORS:
        more = len(errors) - MAX_REPORTED_ERRORS + 1
        errors = errors[:MAX_REPORTED_ERRORS - 1] + [_error(
            None, "too_many_errors", f"{more} more lines have errors")]
    return lines, model, errors


def _check_line(number: int, raw: str, endpoint: str, seen: set[str]) -> dict | None:
    try:
        request = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        return _error(number, "invalid_json", f"line {number} is not JSON: {exc}")
    if not isinstance(request, dict):
        return _error(number, "invalid_json", f"line {number} is not a JSON object")
    for key in ("custom_id", "method", "url", "body"):
        if key not in request:
            return _error(number, "missing_required_parameter",
                          f"line {number} has no '{key}'", key)
    unknown = sorted(set(request) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _error(number, "unsupported_parameter", f"line {number} has an unknown key "
                      f"'{unknown[0]}' (a line has custom_id, method, url and body)", unknown[0])
    cid = request["custom_id"]
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID or _has_surrogate(cid):
        return _error(number, "invalid_value", f"line {number}: custom_id must be a string of "
                      f"1 to {MAX_CUSTOM_ID} characters", "custom_id")
    if cid in seen:
        return _error(number, "duplicate_custom_id", f"line {number}: custom_id {cid!r} is "
                      "used by an earlier line; each must be unique", "custom_id")
    seen.add(cid)
    if request["method"] != "POST":
        return _error(number, "invalid_value", f"line {number}: method must be \"POST\"",
                      "method")
    if request["url"] != endpoint:
        return _error(number, "mismatched_endpoint", f"line {number}: url {request['url']!r} "
                      f"is not the batch's endpoint {endpoint!r}", "url")
    if not isinstance(request["body"], dict):
        return _error(number, "invalid_value", f"line {number}: body must be a JSON object",
                      "body")
    return None


# ---- the output and error files' lines ----------------------------------------------------------
def _dumps(obj: dict) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(obj, separators=(",", ":")) if _has_surrogate(text) else text


def answered_line(custom_id: str, status: int, body: dict) -> str:
    """The output line of a request its route answered (200: the output file; any other status,
    with the route's error body: the error file)."""
    return _dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                   "response": {"status_code": status,
                                "request_id": "req_" + secrets.token_hex(12), "body": body},
                   "error": None})


def unanswered_line(custom_id: str, code: str, message: str) -> str:
    """The error-file line of a request that never ran to an answer."""
    return _dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                   "response": None, "error": {"code": code, "message": message}})


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def usage_of(body: dict) -> tuple[int, int, int, int]:
    """(input, cached, output, reasoning) tokens of a route's answer: chat and completions'
    `prompt_tokens`…, the Responses API's `input_tokens`…, embeddings' `prompt_tokens`."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0, 0

    def detail(name: str, key: str) -> int:
        d = usage.get(name)
        return _int(d.get(key)) if isinstance(d, dict) else 0

    if "input_tokens" in usage:
        return (_int(usage.get("input_tokens")), detail("input_tokens_details", "cached_tokens"),
                _int(usage.get("output_tokens")),
                detail("output_tokens_details", "reasoning_tokens"))
    return (_int(usage.get("prompt_tokens")), detail("prompt_tokens_details", "cached_tokens"),
            _int(usage.get("completion_tokens")),
            detail("completion_tokens_details", "reasoning_tokens"))


def line_model(request: str) -> str | None:
    """The model a stored input line's body names (for the runner's gate), if any."""
    try:
        body = json.loads(request).get("body")
    except (json.JSONDecodeError, RecursionError, AttributeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def line_body(request: str) -> dict:
    return json.loads(request)["body"]


