"""The OpenAPI schema says what the server really does: errors are 400s in the shape of the
route's API (never FastAPI's 422), streamed answers are text/event-stream, and the key schemes
(bearer, x-api-key) are declared where a key is required."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.http.edge import OBSERVABILITY, is_api
from server.http.errors import AnthropicErrorResponse, ErrorResponse, OllamaErrorResponse


def sse(event: dict, data: str) -> dict:
    """text/event-stream content: the schema of one event, as OpenAPI 3.1 readers (and 3.2's
    `itemSchema`) take it: its `event` (`message` when the line is absent) and its `data`."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["event", "data"],
        "properties": {"event": event, "data": {"type": "string", "description": data},
                       "id": {"type": "string"}, "retry": {"type": "integer"}},
        "description": "One server-sent event"}}}


ERRORS = {
    400: "Invalid request: malformed JSON, a wrong type (numbers and booleans are strict), an "
         "out-of-range value, a lone surrogate in a string, a field this server does not "
         "implement or know, or a prompt that cannot fit",
    401: "Missing or wrong API key (when PAGEDLLAMA_API_KEY is set)",
    404: "Unknown model",
    408: "The request body did not arrive in time",
    413: "Request body over PAGEDLLAMA_MAX_BODY_BYTES",
    429: "Too many requests in flight; see Retry-After",
    500: "The engine failed (engine_error), or the model could not be loaded "
         "(model_load_failed)",
    503: "The server is draining (SIGTERM), or the model cannot be loaded now "
         "(model_capacity_exceeded, model_loading); see Retry-After",
}
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": text}
                   for status, text in ERRORS.items()}
ANTHROPIC_ERRORS = {(529 if s == 503 else s): text for s, text in ERRORS.items()}
ANTHROPIC_ERROR_RESPONSES = {status: {"model": AnthropicErrorResponse, "description": text}
                             for status, text in ANTHROPIC_ERRORS.items()}
OLLAMA_ERROR_RESPONSES = {status: {"model": OllamaErrorResponse, "description": text}
                          for status, text in ERRORS.items()}
NDJSON_STREAMED = {200: {
    "description": "Streamed (the default, `stream` absent or true): NDJSON, one object a line, "
                   "the last with `done: true`, `done_reason` and the statistics (or an "
                   "`{\"error\": ...}` line); with `stream: false` one JSON object",
    "content": {"application/x-ndjson": {"schema": {"type": "object"}},
                "application/json": {"schema": {"type": "object"}}}}}
MESSAGES_STREAMED = {200: {
    "description": "A message, or with `stream: true` an SSE stream of Anthropic's events "
                   "(`message_start` … `message_stop`, or a final `error`)",
    "content": sse({"enum": ["message_start", "content_block_start", "content_block_delta",
                             "content_block_stop", "message_delta", "message_stop", "ping",
                             "error"]}, "the event as JSON (its `type` is the event's name)")}}
STREAMED = {200: {
    "description": "JSON, or with `stream: true` an SSE stream of `data: {chunk}` lines ending "
                   "with `data: [DONE]`",
    "content": sse({"const": "message"}, "a chunk as JSON (an error: `{\"error\": …}`), or "
                   "`[DONE]` last")}}
RESPONSES_STREAMED = {200: {
    "description": "A response object, or with `stream: true` an SSE stream of typed events "
                   "(`response.created` … `response.completed`, or a final `error`)",
    "content": sse({"type": "string", "pattern": "^(response\\.[a-z_.]+|error)$"},
                   "the event as JSON (its `type` is the event's name)")}}
STREAM_ONLY = {200: {
    "description": "An SSE stream: `token` events, then `done` (or `error`)",
    "content": sse({"enum": ["token", "done", "error"]}, "the event as JSON")}}
# the model routes: unloading waits for its requests (202), a pinned model stays (409)
OBJECT = {"application/json": {"schema": {"type": "object"}}}
UNLOAD = {202: {"description": "The model (its state: unloading) unloads once its requests "
                               "have finished", "content": OBJECT},
          409: {"model": ErrorResponse, "description": "The model is pinned (model_pinned)"}}
# /health and /stats answer 503 while the server loads (and /health while it drains)
NOT_READY = {503: {"description": "Loading, or draining (/health: its `status` says which)",
                   "content": OBJECT}}


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _schema(app)
        return app.openapi_schema
    app.openapi = openapi


def _schema(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    settings = getattr(app.state, "settings", None)
    key = getattr(settings, "api_key", None)
    protect = key and settings.edge.protect_metrics
    for path, item in schema["paths"].items():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
            if not key or not (is_api(path) or (protect and path in OBSERVABILITY)):
                op.pop("security", None)
            elif "security" not in op:
                op["security"] = [{"HTTPBearer": []}, {"APIKeyHeader": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if not key:
        components.pop("securitySchemes", None)
    else:
        schemes = components.setdefault("securitySchemes", {})
        schemes["HTTPBearer"] = {"type": "http", "scheme": "bearer"}
        schemes["APIKeyHeader"] = {"type": "apiKey", "in": "header", "name": "x-api-key"}
    return schema
