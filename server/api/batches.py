"""OpenAI's Files and Batch APIs: `/v1/files` (upload a JSONL file, purpose "batch"; read, list,
delete; its content) and `/v1/batches` (create, read, list, cancel). The runner
(server/batch/runner.py) runs each batch line through `answer_line`: the line's body validated
as its route validates a request (the same body type, the same 400), then the route's own code,
not streamed, at background priority, for the line's own client (server/batch/runner.py:
LineClient). The store is server/batch/store.py; the shapes server/batch/shapes.py."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi import Request as HTTPRequest
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from server.api import completions, embeddings, responses
from server.batch import shapes
from server.batch.runner import BATCH_PRIORITY, BatchRunner
from server.batch.store import StorageError
from server.durations import parse_keep_alive
from server.http import multipart
from server.http.errors import APIError, ErrorResponse, describe_errors
from server.http.openapi import ERROR_RESPONSES
from server.openai.bodies import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.openai.fields import unsupported
from server.openai.responses_body import ResponsesRequest
from server.service.client import Client
from server.service.service import Service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
MAX_WINDOW_S = 30 * 24 * 3600
MAX_FILENAME = 255

STORE_ERRORS = {
    503: {"model": ErrorResponse, "description": "The batch store cannot be opened now (another "
          "server process uses the state dir, or an I/O error); or the server is draining"},
    507: {"model": ErrorResponse, "description": "The disk holding the batch store is full "
          "(storage_full)"}}
NOT_FOUND = {404: {"model": ErrorResponse, "description": "No such file or batch"}}
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "additionalProperties": False,
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "a JSONL file of request lines, UTF-8, at most "
                                "PAGEDLLAMA_BATCH_MAX_FILE_BYTES and "
                                "PAGEDLLAMA_BATCH_MAX_LINES lines"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
CONTENT = {200: {"description": "The file's bytes", "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


# ---- a batch line ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LineRoute:
    body: type[BaseModel]
    answer: Callable[[Service, Any, Client], Awaitable[dict]]


async def _chat(svc: Service, body: ChatCompletionRequest, client: Client) -> dict:
    return await completions.answer(*await completions.start_chat(svc, body, client))


async def _completion(svc: Service, body: CompletionRequest, client: Client) -> dict:
    return await completions.answer(*await completions.start_completion(svc, body, client))


async def _response(svc: Service, body: ResponsesRequest, client: Client) -> dict:
    gen, state, _ = await responses.start_response(svc, body, client)
    return await responses.answer(gen, state)


LINE_ROUTES = {"/v1/chat/completions": LineRoute(ChatCompletionRequest, _chat),
               "/v1/completions": LineRoute(CompletionRequest, _completion),
               "/v1/embeddings": LineRoute(embeddings.EmbeddingRequest, embeddings.embed),
               "/v1/responses": LineRoute(ResponsesRequest, _response)}
assert set(LINE_ROUTES) == set(shapes.ENDPOINTS)


async def answer_line(svc: Service, endpoint: str, raw: dict, client: Client) -> dict:
    """One batch line's answer, as its route would give it not streamed (an APIError with the
    route's status and error body otherwise), for the line's client. The line runs at the
    lowest priority; `stream: true` is refused (a batch line's answer is one JSON body)."""
    route = LINE_ROUTES[endpoint]
    try:
        body = route.body.model_validate(raw)
    except ValidationError as exc:   # as FastAPI's validation of the route's body
        message, param, code = describe_errors(exc.errors())
        raise APIError(400, message, code, param) from None
    if getattr(body, "stream", False):
        raise unsupported("stream", "is not supported in a batch line: its answer is one JSON "
                          "body (leave stream out, or false)")
    if isinstance(body, SamplingFields):
        body.priority = BATCH_PRIORITY
    return jsonable_encoder(await route.answer(svc, body, client))


# ---- the routes --------------------------------------------------------------------------------
def _runner(http: HTTPRequest) -> BatchRunner:
    return http.app.state.batches


async def _stored(work: Awaitable):
    """A store call's result; its failure as the API's error (507 for a full disk)."""
    try:
        return await work
    except StorageError as exc:
        if exc.code == "storage_full":
            raise APIError(507, exc.message, "storage_full") from exc
        raise APIError(503, exc.message, "batch_store_unavailable",
                       headers={"Retry-After": "5"}) from exc


def _found(row, missing, key: str):
    """The stored row, or the 404 `missing(key)` makes."""
    if row is None:
        raise missing(key)
    return row


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such file: {file_id!r}", "file_not_found", "file_id")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"No such batch: {batch_id!r}", "batch_not_found", "batch_id")


def _read_upload(content_type: str, body: bytes, max_bytes: int,
                 max_lines: int) -> tuple[multipart.Part, int]:
    """The uploaded file (a part named `file`, purpose "batch") and its request lines; a 400
    (413 for a file over the limit) for anything else. On a worker thread: the file may be
    large."""
    try:
        parts = multipart.parse(content_type, body)
    except multipart.MultipartError as exc:
        raise APIError(400, str(exc), "invalid_request") from None
    for name in parts:
        if name not in ("file", "purpose"):
            raise unsupported(name, "is not supported (an upload has `file` and `purpose`; "
                              "files are kept until deleted)")
    if "purpose" not in parts:
        raise APIError(400, "missing required field 'purpose'", "invalid_value", "purpose")
    if "file" not in parts or parts["file"].filename is None:
        raise APIError(400, "missing required field 'file' (a file part, with a filename)",
                       "invalid_value", "file")
    purpose = parts["purpose"].data.decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise APIError(400, f"purpose {purpose[:40]!r} is not supported: this server keeps files "
                       "for the Batch API (purpose \"batch\")", "unsupported_parameter",
                       "purpose")
    file = parts["file"]
    if len(file.data) > max_bytes:
        raise APIError(413, f"The file has {len(file.data)} bytes; a batch file may have at "
                       f"most {max_bytes} (PAGEDLLAMA_BATCH_MAX_FILE_BYTES)",
                       "request_too_large", "file")
    try:
        text = file.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The file is not UTF-8 text (byte {exc.start}): a batch file is "
                       "JSONL", "invalid_file", "file") from None
    lines = shapes.count_lines(text)
    if lines == 0:
        raise APIError(400, "The file has no request lines", "invalid_file", "file")
    if lines > max_lines:
        raise APIError(400, f"The file has {lines} request lines; a batch may have at most "
                       f"{max_lines} (PAGEDLLAMA_BATCH_MAX_LINES)", "too_many_lines", "file")
    return file, lines


@router.post("/files", openapi_extra=UPLOAD_BODY,
             responses={200: {"model": shapes.FileObject}, **STORE_ERRORS})
async def upload_file(http: HTTPRequest):
    """Upload a JSONL file of request lines (multipart/form-data: `file`, `purpose`
    "batch"), kept until it is deleted."""
    limits = http.app.state.settings.batch
    body = await http.body()
    file, lines = await asyncio.to_thread(_read_upload, http.headers.get("content-type", ""),
                                          body, limits.max_file_bytes, limits.max_lines)
    name = (file.filename or "upload.jsonl")[:MAX_FILENAME] or "upload.jsonl"
    row = await _stored(_runner(http).upload("batch", name, file.data, lines))
    return shapes.file_object(row)


@router.get("/files", responses={200: {"model": shapes.FileList}, **STORE_ERRORS})
async def list_files(http: HTTPRequest, purpose: str | None = None,
                     limit: int = Query(10_000, ge=1, le=10_000), after: str | None = None,
                     order: Literal["asc", "desc"] = "desc"):
    """Files, newest first (`order: asc`: oldest first); `after` a file id (the last of the
    previous page)."""
    rows, more = await _stored(_runner(http).files(purpose, after, limit, order))
    return shapes.page([shapes.file_object(r) for r in rows], more)


@router.get("/files/{file_id}", responses={200: {"model": shapes.FileObject}, **NOT_FOUND,
                                           **STORE_ERRORS})
async def get_file(file_id: str, http: HTTPRequest):
    return shapes.file_object(_found(await _stored(_runner(http).file(file_id)),
                                     _no_file, file_id))


@router.get("/files/{file_id}/content", response_class=Response,
            responses={**CONTENT, **NOT_FOUND, **STORE_ERRORS})
async def file_content(file_id: str, http: HTTPRequest):
    """The file's bytes (a batch's output or error file: one JSON line per request)."""
    content = await _stored(_runner(http).file_content(file_id))
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/files/{file_id}", responses={200: {"model": shapes.FileDeleted}, **NOT_FOUND,
                                              **STORE_ERRORS})
async def delete_file(file_id: str, http: HTTPRequest):
    if not await _stored(_runner(http).delete_file(file_id)):
        raise _no_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/batches", responses={200: {"model": shapes.BatchObject}, **NOT_FOUND,
                                    **STORE_ERRORS})
async def create_batch(body: shapes.CreateBatch, http: HTTPRequest):
    """A batch of the input file's request lines, run at background priority."""
    for name in body.model_extra or {}:
        raise unsupported(name, "is not supported (output files are kept until deleted)"
                          if name == "output_expires_after" else "is not supported")
    try:
        window_s = parse_keep_alive(body.completion_window, "completion_window")
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value", "completion_window") from None
    if not 1 <= window_s <= MAX_WINDOW_S:
        raise APIError(400, "completion_window must be between 1 second and 30 days (\"24h\")",
                       "invalid_value", "completion_window")
    row = await _stored(_runner(http).create(body.endpoint, body.input_file_id,
                                             body.completion_window, window_s, body.metadata))
    return shapes.batch_object(row)


@router.get("/batches", responses={200: {"model": shapes.BatchList}, **STORE_ERRORS})
async def list_batches(http: HTTPRequest, after: str | None = None,
                       limit: int = Query(20, ge=1, le=100)):
    """Batches, newest first; `after` a batch id (the last of the previous page)."""
    rows, more = await _stored(_runner(http).batches(after, limit))
    return shapes.page([shapes.batch_object(r) for r in rows], more)


@router.get("/batches/{batch_id}", responses={200: {"model": shapes.BatchObject}, **NOT_FOUND,
                                              **STORE_ERRORS})
async def get_batch(batch_id: str, http: HTTPRequest):
    return shapes.batch_object(_found(await _stored(_runner(http).batch(batch_id)),
                                      _no_batch, batch_id))


@router.post("/batches/{batch_id}/cancel", responses={
    200: {"model": shapes.BatchObject}, **NOT_FOUND, **STORE_ERRORS,
    409: {"model": ErrorResponse, "description": "The batch has ended (batch_not_cancellable)"}})
async def cancel_batch(batch_id: str, http: HTTPRequest):
    """Cancel a batch: it ends `cancelled`, its output file holding the lines it finished."""
    row = await _stored(_runner(http).cancel(batch_id))
    if row is None:
        raise _no_batch(batch_id)
    return shapes.batch_object(row)
