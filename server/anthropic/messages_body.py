"""The bodies of POST /v1/messages and /v1/messages/count_tokens, and which of their fields we
serve, ignore on purpose, or refuse (the server never fails open, as on the OpenAI routes:
server/openai/fields.py).

Numbers and booleans are strict and every string must be valid Unicode (`Body`). The content
blocks of `messages` and `system`, `tools`, `tool_choice` and `thinking` are checked where they
are converted (convert.py), each error naming the field (`messages.1.content.0.type`).
"""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from server.http.errors import APIError
from server.openai.bodies import (
    INT32_MAX,
    JSON_INT_MAX,
    Body,
    Bool,
    Float,
    Int,
    KeepAlive,
    StopList,
    nullable,
)
from server.openai.fields import check_types

# Accepted and ignored: they label or route a request, or mark what to cache (our prefix cache
# takes every prompt by itself), and never change its tokens (of these types: a 400 otherwise).
# (`metadata.user_id` also names the session that keeps a replica: server/api/anthropic.py.)
LABELS: dict[str, Any] = {"metadata": dict[str, Any], "cache_control": dict[str, Any],
                          "service_tier": str, "inference_geo": str, "user_profile_id": str,
                          "workspace_id": str}
HARMLESS = frozenset(LABELS)

# output_config.effort: how much a model may think; a hint that asks nothing of a model that
# does not think, and that no thinking template here takes a budget from.
EFFORTS = ("low", "medium", "high", "xhigh", "max")

# Anthropic's fields we know and do not implement: any value that asks for something is a 400.
UNSUPPORTED = {
    "container": "no code-execution containers run here",
    "mcp_servers": "this server does not connect to MCP servers; give their tools in 'tools'",
    "diagnostics": "no prompt-cache diagnostics are produced here",
    "output_format": "structured output is not part of this API here (use the OpenAI routes' "
                     "response_format)",
}

_UNKNOWN = ("is not a field this server knows; it is refused rather than ignored, because "
            "ignoring it could silently change the answer")


_EDITS = ("clear_thinking_20251015", "clear_tool_uses_20250919")


class MessagesFields(Body):
    # unknown fields are kept (model_extra) so that check_fields can refuse them by name; the
    # OpenAPI schema declares the labels, and says what context_management, output_config and
    # speed take (server/openai/bodies.py Body)
    model_config = ConfigDict(extra="allow")
    EXTRAS = nullable(LABELS, "a label: accepted and ignored")
    NULL_IS_DEFAULT = ("stream",)
    SCHEMA = {
        "context_management": {
            "anyOf": [{"type": "object", "additionalProperties": False, "properties": {
                "edits": {"type": ["array", "null"], "items": {
                    "type": "object", "required": ["type"],
                    "properties": {"type": {"enum": list(_EDITS)}}}}}}, {"type": "null"}],
            "description": "context editing (server/anthropic/context.py)"},
        "output_config": {
            "anyOf": [{"type": "object", "additionalProperties": {"type": "null"},
                       "properties": {"effort": {"enum": [*EFFORTS, None]},
                                      "format": {"type": "null"}}}, {"type": "null"}],
            "description": "effort: a hint; format: not supported here"},
        "speed": {"enum": ["standard", None], "description": "one speed here"}}

    model: str
    messages: list[Any] = Field(..., min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    speed: str | None = None
    context_management: Any = None     # server/anthropic/context.py
    output_config: dict[str, Any] | None = None
    keep_alive: KeepAlive = None   # this server's extension (Ollama's field)


class MessagesRequest(MessagesFields):
    """POST /v1/messages. Besides Anthropic's fields, a few of this server's own (as on the
    OpenAI routes): `ignore_eos`, `seed`, `priority`, `timeout`, `min_p`."""
    max_tokens: Int = Field(..., ge=0, le=INT32_MAX)
    stop_sequences: StopList | None = None
    temperature: Float | None = Field(None, ge=0.0, le=1.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0, le=INT32_MAX)
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    # this server's extensions
    ignore_eos: Bool = False
    seed: Int | None = None
    priority: Int = Field(0, ge=-JSON_INT_MAX, le=JSON_INT_MAX)
    timeout: Float | None = Field(None, gt=0.0)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)


class CountTokensRequest(MessagesFields):
    """POST /v1/messages/count_tokens: what makes the prompt, no sampling."""


def check_fields(body: MessagesFields) -> None:
    """A 400 for the first extra field that asks for something we do not do, or a label of the
    wrong type."""
    check_types(body.model_extra or {}, LABELS)
    for name, value in (body.model_extra or {}).items():
        if name in HARMLESS or _asks_nothing(value):
            continue
        if name in UNSUPPORTED:
            raise unsupported(name, UNSUPPORTED[name])
        raise unsupported(name, _UNKNOWN)
    if body.speed not in (None, "standard"):
        raise unsupported("speed", "one speed here: 'standard'")
    _check_output_config(body.output_config or {})


def _check_output_config(config: dict[str, Any]) -> None:
    for key, value in config.items():
        if key == "effort":
            if value is not None and value not in EFFORTS:
                raise invalid("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
        elif key == "format" and value is not None:
            raise unsupported("output_config.format", "structured output is not part of this "
                              "API here (use the OpenAI routes' response_format)")
        elif value is not None:
            raise unsupported(f"output_config.{key}", _UNKNOWN)


def _asks_nothing(value: Any) -> bool:
    """null, an empty list or object, or an object of nulls: the same as leaving it out."""
    return value in (None, [], {}) or (isinstance(value, dict)
                                       and all(v is None for v in value.values()))


def unsupported(field: str, why: str) -> APIError:
    return APIError(400, f"'{field}' {why}" if why == _UNKNOWN else
                    f"'{field}' is not supported: {why}", "unsupported_parameter", field)


def invalid(field: str, why: str) -> APIError:
    return APIError(400, f"{field}: {why}", "invalid_value", field)
