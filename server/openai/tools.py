"""OpenAI's tool fields: `tools` and `tool_choice` as chat completions send them (`{"type":
"function", "function": {...}}`) and as the Responses API sends them (flat), checked and turned
into the request's ToolUse. The tool-call machinery itself (the prompt side, the grammar of forced
calls, calls read back out of the text) is server/chat/tools.py, shared by every API."""
from __future__ import annotations

from typing import Any

from server.chat.tools import (  # noqa: F401
    CLOSE,
    OPEN,
    CallSplitter,
    Function,
    ToolCall,
    ToolUse,
    calls_grammar,
    parse_tool_calls,
    prompt_input,
    render_messages,
    system_text,
)
from server.http.errors import APIError
from server.openai.fields import check_keys
from server.openai.structured import compile_schema


def parse_tools(tools: list | None, tool_choice: Any, parallel: bool | None,
                responses: bool = False) -> ToolUse:
    """A request's tools and tool_choice, checked: chat's shape (`{"type": "function",
    "function": {...}}`), or with `responses` the Responses API's flat one (`{"type":
    "function", "name", "parameters", ...}`, tool_choice `{"type": "function", "name"}`)."""
    functions = [(_flat_function if responses else _function)(i, t)
                 for i, t in enumerate(tools or [])]
    names = {f.name for f in functions}
    choice = _choice(tool_choice, names, responses)
    if choice != "none" and not functions and tool_choice is not None:
        raise APIError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
    return ToolUse(functions, choice, parallel is not False)


def _function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where}: only tools of type 'function' are supported",
                       "unsupported_parameter", where)
    check_keys(tool, frozenset({"type", "function"}), where)
    return _named(tool.get("function"), f"{where}.function")


def _flat_function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(400, f"{where} must be an object", "invalid_value", where)
    if tool.get("type") != "function":
        raise APIError(400, f"{where}: tools of type {tool.get('type')!r} are not supported "
                       "(only 'function')", "unsupported_parameter", f"{where}.type")
    return _named(tool, where, flat=True)


_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _named(fn: Any, where: str, flat: bool = False) -> Function:
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where} needs a 'name'", "invalid_value", where)
    check_keys(fn, (_FUNCTION_KEYS | {"type"}) if flat else _FUNCTION_KEYS, where)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    compile_schema(params, f"{where}.parameters")   # a 400 naming it if it is invalid
    return Function(fn["name"], fn.get("description") or "", params)


def _choice(tool_choice: Any, names: set[str], responses: bool = False) -> str:
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    name = None
    if isinstance(tool_choice, dict):
        if responses and tool_choice.get("type") != "function":   # allowed_tools, hosted tools
            raise APIError(400, f"tool_choice of type {tool_choice.get('type')!r} is not "
                           "supported", "unsupported_parameter", "tool_choice")
        fn = tool_choice if responses else (tool_choice.get("function") or {})
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        shape = '{"type": "function", "name": ...}' if responses else \
            '{"type": "function", "function": {"name": ...}}'
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {shape}",
                       "invalid_value", "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names the function '{name}', which is not in tools",
                       "invalid_value", "tool_choice")
    return name
