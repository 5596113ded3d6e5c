"""OpenAI's Responses API, stateless: its request body, the checks of what it asks for, and its
`input` items as chat messages.

`input` (a string, or a list of items: messages, `function_call`s, `custom_tool_call`s, their
outputs, and `reasoning` items) and `instructions` become chat messages (developer messages
become system ones; calls and their outputs become assistant `tool_calls` and `tool` messages; a
reasoning item, the reasoning of the assistant turn it starts). `text.format` (`json_object`,
`json_schema`) constrains the output with the grammar chat's `response_format` uses; `tools` and
`tool_choice` work as in chat, in the Responses shapes (server/openai/tool_fields.py: functions,
namespaces, custom tools; hosted tools are left out of the prompt and named), and each call
comes back as a `function_call` item (with its `namespace`) or a `custom_tool_call` item. A call
whose arguments break its tool's schema stays text, as one whose JSON does not parse does.

Accepted as hints or labels: `client_metadata`, `prompt_cache_key` (it also keeps a session on
the replica holding its cache), `reasoning` (effort and summary: a model that does not think
has none, a thinking model thinks as its template says), `text.verbosity`. `include:
["reasoning.encrypted_content"]` is honoured: a reasoning item then carries its text sealed
under the server's key (server/openai/sealing.py), which a later request's reasoning item
hands back to be opened. Nothing is stored: `store: true`, `previous_response_id`, `background`,
and `include` values asking for output not produced here are 400s.

Its answer's output items and stream events: server/openai/responses_format.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, Field

from server.chat.tool_calls import ToolUse
from server.http.errors import APIError
from server.openai import sealing
from server.openai.bodies import INT32_MAX, Bool, Int, SamplingFields, nullable, or_null
from server.openai.fields import check_keys, check_stream_options, check_types
from server.openai.structured import text_format_grammar
from server.openai.tool_fields import model_name, responses_tools

_TEXT_PARTS = {"input_text", "output_text", "text"}
_CHAT_ONLY = ("response_format", "json_schema", "grammar")
# Accepted and ignored: they label or route a request (of these types: a 400 otherwise).
_LABELS: dict[str, Any] = {"user": str, "service_tier": str, "safety_identifier": str,
                           "prompt_cache_retention": str, "client_metadata": dict[str, Any]}
_HARMLESS = frozenset(_LABELS)
_CHECKED = frozenset({"include", "reasoning", "truncation"})   # _check_extras


class ResponsesRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")   # unknown fields are refused by name, not ignored
    # the OpenAPI schema (server/openai/bodies.py Body): the extra fields accepted, as
    # reject_unsupported and _check_extras take them; the fields refused whatever their value
    # left out, and those taken at one value only
    EXTRAS = {
        **nullable(_LABELS, "a label: accepted and ignored"),
        "include": or_null({"type": "array", "items": {"enum": ["reasoning.encrypted_content"]}},
                           "extra output: only reasoning items' sealed text"),
        "reasoning": or_null({"type": "object", "additionalProperties": False,
                              "properties": dict.fromkeys(("effort", "summary", "generate_summary"),
                                                          {"type": ["string", "null"]})},
                             "a hint: a model that does not think has none"),
        "truncation": {"enum": ["auto", "disabled", None], "description": "an input too long "
                       "for the context is a 400 either way"}}
    SCHEMA = {
        **dict.fromkeys(_CHAT_ONLY),
        "n": {"enum": [1, None], "description": "one output per response"},
        "store": {"enum": [False, None], "description": "stateless: no response is kept"},
        "background": {"enum": [False, None]},
        "previous_response_id": {"enum": [None, ""], "description": "stateless: send the "
                                 "history in 'input'"},
        "stream_options": or_null({"type": "object", "additionalProperties": False,
                                     "properties": {
                                         "include_usage": {"type": "boolean"},
                                         "continuous_usage_stats": {"enum": [False]},
                                         "include_obfuscation": {"enum": [False, None]}}},
                                    "the usage comes once, in response.completed")}

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    store: Bool | None = None
    previous_response_id: str | None = None
    background: Bool | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None            # server/openai/tool_fields.py checks each one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None      # a session's key: the replica holding its cache

    @property
    def format(self) -> Any:
        """`text.format` as sent (None when absent)."""
        return (self.text or {}).get("format")

    @property
    def seals_reasoning(self) -> bool:
        """Whether reasoning items carry their text sealed (`encrypted_content`)."""
        return SEALED_REASONING in ((self.model_extra or {}).get("include") or [])


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not supported: {why}", "unsupported_parameter", param)


def reject_unsupported(body: ResponsesRequest) -> None:
    check_types(body.model_extra or {}, _LABELS)
    for name, value in (body.model_extra or {}).items():
        if value not in (None, [], {}) and name not in _HARMLESS | _CHECKED:
            raise _unsupported(name, "this server does not implement it, and ignoring it could "
                               "change the answer")
    for name in _CHAT_ONLY:   # SamplingFields' chat-only fields
        if getattr(body, name, None) is not None:
            raise _unsupported(name, "on /v1/responses, structured output is 'text.format'")
    if body.n != 1:
        raise _unsupported("n", "one output per response")
    if body.store:
        raise _unsupported("store", "this server is stateless and keeps no responses")
    if body.previous_response_id:
        raise _unsupported("previous_response_id", "this server is stateless; send the history "
                           "in 'input'")
    if body.background:
        raise _unsupported("background", "responses are computed while the request is open")
    _check_extras(body.model_extra or {}, body.text or {})
    check_stream_options(body)
    if body.stream_options and body.stream_options.continuous_usage_stats:
        raise _unsupported("stream_options.continuous_usage_stats",
                           "a response's usage comes once, in response.completed")


SEALED_REASONING = "reasoning.encrypted_content"
_INCLUDABLE = frozenset({SEALED_REASONING})
_VERBOSITY = (None, "low", "medium", "high")


def _check_extras(extra: dict, text: dict) -> None:
    """The Responses fields that ask for extra output or give hints: `include` (only
    "reasoning.encrypted_content" is produced here; logprobs, sources, ... are refused),
    `reasoning` (an effort or a summary: hints, accepted), `text.verbosity` (a hint), and
    `truncation`: "auto" would drop the start of an input too long for the context, which is
    refused anyway (context_length_exceeded), so both values behave alike on everything we
    accept."""
    include = extra.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise APIError(400, "include must be a list of strings", "invalid_value", "include")
        unknown = [v for v in include if v not in _INCLUDABLE]
        if unknown:
            raise _unsupported("include", f"no such extra output ({unknown[0]!r}) is produced "
                               f"here; only {SEALED_REASONING!r} is")
    reasoning = extra.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise APIError(400, "reasoning must be an object", "invalid_value", "reasoning")
        check_keys(reasoning, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
        for key, value in reasoning.items():
            if value is not None and not isinstance(value, str):
                raise APIError(400, f"reasoning.{key} must be a string", "invalid_value",
                               f"reasoning.{key}")
    if extra.get("truncation") not in (None, "auto", "disabled"):
        raise APIError(400, "truncation must be 'auto' or 'disabled'", "invalid_value",
                       "truncation")
    check_keys(text, frozenset({"format", "verbosity"}), "text")
    if text.get("verbosity") not in _VERBOSITY:
        raise APIError(400, "text.verbosity must be 'low', 'medium' or 'high'", "invalid_value",
                       "text.verbosity")


@dataclass
class Constraints:
    """What a request asks of its answer: its tools, the grammar its text.format or tool_choice
    implies, and the types of the hosted tools left out (the response header
    x-pagedllama-ignored-tools and the request log name them)."""
    use: ToolUse
    grammar: str | None
    ignored_tools: list[str] = field(default_factory=list)


def constraints(body: ResponsesRequest, model) -> Constraints:
    """The request's tools, and the grammar its text.format or tool_choice implies (400s naming
    what is wrong, as chat's response_format and tools)."""
    tools = responses_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    fmt_grammar = text_format_grammar(body.format, model)
    tool_grammar = tools.use.grammar()
    if fmt_grammar and tool_grammar:
        raise APIError(400, "a tool_choice that forces a call cannot be combined with a "
                       "text.format other than text", "invalid_value", "tool_choice")
    return Constraints(tools.use, fmt_grammar or tool_grammar, tools.ignored)


# ---- input ---------------------------------------------------------------------------------------
def _text(content: Any, where: str, parts: set[str]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", "invalid_value",
                       where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in parts \
                or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "unsupported_parameter",
                           f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str, what: str = "a non-empty string") -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key not in ("arguments", "input")):
        raise APIError(400, f"{where}.{key} must be {what}", "invalid_value", f"{where}.{key}")
    return value


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"input[{i}].role must be user, assistant, system or developer",
                       "invalid_value", f"input[{i}].role")
    return {"role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), f"input[{i}].content", _TEXT_PARTS)}


def _add_call(messages: list[dict], item: dict, i: int, use: ToolUse | None) -> None:
    """A function_call (or custom_tool_call) item as chat's assistant `tool_calls`, under the
    name the model knows its tool by: calls in a row, and the assistant text just before them,
    are one assistant turn. A custom tool's input is its function's one argument."""
    where = f"input[{i}]"
    name = _string(item, "name", where)
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({"input": _string(item, "input", where, "a string")},
                               ensure_ascii=False)
    else:
        arguments = _string(item, "arguments", where, "a string (JSON)")
    if use is not None:
        name = model_name(use, name, item.get("namespace"))
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_output(item: dict, i: int) -> dict:
    """A function_call_output (or custom_tool_call_output) item as chat's `tool` message."""
    where = f"input[{i}]"
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where),
            "content": _text(item.get("output"), f"{where}.output", {"input_text", "text"})}


def _reasoning(item: dict, i: int) -> str:
    """A reasoning item's text: its `encrypted_content` opened (what this server sealed), else
    its reasoning_text parts, else its summary."""
    sealed = item.get("encrypted_content")
    if sealed is not None:
        where = f"input[{i}].encrypted_content"
        if not isinstance(sealed, str):
            raise APIError(400, f"{where} must be a string", "invalid_value", where)
        try:
            return sealing.unseal(sealed)
        except sealing.SealError as exc:
            raise APIError(400, f"{where} does not open: it was not sealed by this server "
                           "(or under another key), or it was altered", "invalid_value",
                           where) from exc
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"input[{i}]: a reasoning item's content and summary are lists of "
                       "text parts", "invalid_value", f"input[{i}]")
    return "\n\n".join(p["text"] for p in parts)


def to_messages(body: ResponsesRequest, use: ToolUse | None = None) -> list[dict]:
    """Chat messages from `instructions` and `input` (developer messages become system ones;
    function and custom tool calls and their outputs become assistant `tool_calls` and `tool`
    messages, a call under the name the model knows its tool by in `use`; a reasoning item, the
    `reasoning_content` of the assistant turn it starts, which thinking templates read)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, i)
            last = messages[-1] if messages else None
            if (message["role"] == "assistant" and last is not None and "reasoning_content" in last
                    and not last["content"] and "tool_calls" not in last):
                last["content"] = message["content"]   # the answer after its reasoning
            else:
                messages.append(message)
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": _reasoning(item, i)})
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, item, i, use)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(_call_output(item, i))
        else:
            raise APIError(400, f"input items of type '{kind}' are not supported",
                           "unsupported_parameter", f"input[{i}]")
    if not messages:
        raise APIError(400, "input has no messages", "invalid_value", "input")
    return messages
