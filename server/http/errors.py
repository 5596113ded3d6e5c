"""Errors in the shape of the API a route serves, with the right status: OpenAI's
`{"error": {"message", "type", "param", "code"}}` everywhere, except on Anthropic's routes
(/v1/messages…), where an error is `{"type": "error", "error": {"type", "message"}}` with
Anthropic's status for its type, and on Ollama's (/api/…), where it is `{"error": "..."}`.
The shape is chosen from the request's path, so an error raised anywhere (a route, the
service, the edge, a validation error, an unknown route) comes out in the shape its client
reads."""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError, error_body, printable  # defined without HTTP

log = logging.getLogger("pagedllama.server")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape (its schema in the OpenAPI document)."""
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error on Anthropic's routes, in its shape (its schema in the OpenAPI document)."""
    type: str = "error"
    error: AnthropicErrorDetail


class OllamaErrorResponse(BaseModel):
    """An error on Ollama's routes (/api/...), in its shape."""
    error: str


def is_ollama(path: str) -> bool:
    """Whether a path is one of Ollama's routes (errors as `{"error": "..."}`)."""
    return path.startswith("/api/")


def ollama_error(message: str, param: str | None = None) -> dict:
    """Ollama's body for one of our errors: the message (naming the field at fault)."""
    message = printable(message)
    if param and param not in message:
        message = f"{printable(param)}: {message}"
    return {"error": message}


def is_anthropic(path: str) -> bool:
    """Whether a path is one of Anthropic's routes (errors in its shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# our status -> Anthropic's status and error type. A server that cannot take work now (draining:
# our 503) answers 529 overloaded_error, Anthropic's status for an API that is temporarily
# overloaded; the limit on requests in flight stays a 429 rate_limit_error (with Retry-After).
_ANTHROPIC = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
              403: (403, "permission_error"), 404: (404, "not_found_error"),
              413: (413, "request_too_large"), 429: (429, "rate_limit_error"),
              500: (500, "api_error"), 503: (529, "overloaded_error")}


def anthropic_error(status: int, message: str, param: str | None = None) -> tuple[int, dict]:
    """Anthropic's status and body for one of our errors. Another 4xx is an
    invalid_request_error with its own status (as Anthropic uses it); another 5xx an api_error.
    The field at fault is named in the message (Anthropic's shape has no `param`)."""
    status, kind = _ANTHROPIC.get(status) or (
        (status, "invalid_request_error") if status < 500 else (status, "api_error"))
    message = printable(message)
    if param and param not in message:
        message = f"{printable(param)}: {message}"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None, path: str = "") -> JSONResponse:
    if is_anthropic(path):
        status, body = anthropic_error(status, message, param)
        return JSONResponse(body, status_code=status, headers=headers)
    if is_ollama(path):
        return JSONResponse(ollama_error(message, param), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, code, param), status_code=status,
                        headers=headers)


def _describe(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of the first validation error."""
    return describe_errors(exc.errors())


def describe_errors(errors) -> tuple[str, str | None, str]:
    """(message, param, code) of the first of a body's validation errors (pydantic's
    `errors()`, or FastAPI's, whose locations start with "body"): what the 400 says."""
    if not errors:
        return "invalid request", None, "invalid_json"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None, "invalid_json"
    if first.get("type") == "invalid_unicode":
        return first["msg"], first["ctx"]["where"], "invalid_unicode"
    # pydantic names the member of a union it tried ("stop.str", "prompt.list[int].0"): not a
    # field of the request, so left out of the name
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_member(p)]
    if "field" in first.get("ctx", {}):   # a model's own check naming one of its fields
        loc.append(first["ctx"]["field"])
    where = ".".join(loc)
    code = "invalid_value" if where else "invalid_json"
    if first.get("type") == "missing":
        if not where:
            return "the request body is missing (a JSON object is expected)", None, code
        return f"missing required field '{where}'", where, code
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if where and not message.startswith(f"{where}: "):   # a check's message may name it already
        message = f"{where}: {message}"
    return message, where or None, code


def _union_member(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list")
                                      or "[" in part)


# what FastAPI says when it cannot read the body as JSON at all (not UTF-8, nested too deep)
_UNPARSABLE = "There was an error parsing the body"


_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _allowed_methods(request: Request, said: str | None) -> str | None:
    """A 405's Allow header: every method the OpenAPI document gives the request's path (a path
    may have a route per method, GET and POST /v1/files, and Starlette names one route's);
    Starlette's own for a path the document leaves out."""
    for template, item in request.app.openapi().get("paths", {}).items():
        pattern = "".join("[^/]+" if part.startswith("{") else re.escape(part)
                          for part in re.split(r"(\{[^/}]+\})", template))
        if re.fullmatch(pattern, request.url.path):
            return ", ".join(sorted(m.upper() for m in item if m in _METHODS))
    return said


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers,
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, code = _describe(exc)
        return error_response(400, message, code, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == _UNPARSABLE:
            return error_response(400, "request body is not valid JSON (UTF-8 text, nested "
                                  "within the parser's depth limit)", "invalid_json",
                                  path=request.url.path)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            allow = _allowed_methods(request, (headers or {}).get("Allow"))
            headers = {**(headers or {}), **({"Allow": allow} if allow else {})}
        return error_response(exc.status_code, str(exc.detail), None, None, headers,
                              request.url.path)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError):
        return error_response(400, "request body is not valid JSON", "invalid_json",
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error",
                              path=request.url.path)
