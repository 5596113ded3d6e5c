"""OpenAI's tool fields: `tools` and `tool_choice` as chat completions send them (`{"type":
"function", "function": {...}}`) and as the Responses API sends them (flat), checked and turned
into the request's ToolUse. The tool-call machinery itself (the prompt side, the grammar of forced
calls, calls read back out of the text) is server/chat/tool_calls.py, shared by every API.

A function's parameters schema is compiled to a grammar: a `strict` one must be enforceable
whole (else a 400 naming it); one that is not strict may use keywords the grammar cannot enforce
(`propertyNames`, …): the model sees the whole schema, a forced call is held to the rest
(`Function.enforced`). A call the model writes is returned as a call whatever its arguments, for
the client to check, as OpenAI returns one; only a strict function's call that breaks its schema
(one written under `tool_choice` "auto", which no grammar holds) is text
(server/chat/answer.py `checked_pieces`).

The Responses API's tools besides `function`:
- `namespace` (`{"type": "namespace", "name", "description", "tools": [function and custom
  tools]}`, Codex's MCP servers and sub-agent tools): its tools are offered one by one, each
  under its own name (`namespace.name` where two tools would share a name); a call comes back
  under its own name with the item's `namespace` set, which is how the client finds the tool.
- `custom` (freeform: `{"type": "custom", "name", "description", "format"}`, Codex's
  apply_patch): offered as a function of one string argument, `input`; a call comes back as a
  `custom_tool_call` item carrying that string. Its format (a Lark grammar) is shown to the
  model in the description, not enforced.
- any other type (`web_search`, `file_search`, `mcp`, `image_generation`, `local_shell`, …: tools
  the provider runs) is not run here: it is left out of the prompt and its type named
  (`ResponsesTools.ignored`); a tool_choice forcing one is a 400.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from server.chat.tool_calls import (  # noqa: F401
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
from server.openai.structured import enforceable_schema


@dataclass
class ClientTool(Function):
    """A Responses tool offered as a function, and how its calls go back to the client: the
    tool's own name (`Function.name` is the one the model sees), its namespace, and whether it
    is a custom tool (a call carries its `input` string)."""
    own_name: str = ""
    namespace: str | None = None
    custom: bool = False


@dataclass
class ResponsesTools:
    use: ToolUse
    ignored: list[str] = field(default_factory=list)   # the types of the tools left out


def tool_named(use: ToolUse, name: str) -> ClientTool | None:
    """The Responses tool the model calls by this name (None: no such tool)."""
    return next((f for f in use.functions if f.name == name and isinstance(f, ClientTool)), None)


def model_name(use: ToolUse, name: str, namespace: Any = None) -> str:
    """The name the model knows a client's tool by (a call item in the history names the tool
    by its own name and namespace)."""
    for f in use.functions:
        if isinstance(f, ClientTool) and f.own_name == name and f.namespace == (namespace or None):
            return f.name
    return name


def parse_tools(tools: list | None, tool_choice: Any, parallel: bool | None,
                responses: bool = False) -> ToolUse:
    """A request's tools and tool_choice, checked: chat's shape (`{"type": "function",
    "function": {...}}`), or with `responses` the Responses API's flat one (`{"type":
    "function", "name", "parameters", ...}`, tool_choice `{"type": "function", "name"}`)."""
    if responses:
        return responses_tools(tools, tool_choice, parallel).use
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    names = {f.name for f in functions}
    choice = _choice(tool_choice, names)
    if choice != "none" and not functions and tool_choice is not None:
        raise APIError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
    return ToolUse(functions, choice, parallel is not False)


def responses_tools(tools: list | None, tool_choice: Any, parallel: bool | None) -> ResponsesTools:
    """The Responses API's tools and tool_choice, checked: functions, namespaces and custom
    tools offered to the model, the other (hosted) tools left out and named."""
    offered: list[ClientTool] = []
    ignored: list[str] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = _kind(tool, where)
        if kind == "namespace":
            offered += _namespace(tool, where, ignored)
        elif kind in ("function", "custom"):
            offered.append(_client_tool(tool, where, kind))
        elif kind not in ignored:
            ignored.append(kind)
    _name_for_model(offered)
    choice = _responses_choice(tool_choice, offered, ignored)
    if choice not in ("none", "auto") and not offered:   # "auto" with none: Codex sends it
        raise APIError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
    use = ToolUse(list(offered), choice if offered else "none", parallel is not False)
    return ResponsesTools(use, ignored)


def _function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where}: only tools of type 'function' are supported",
                       "unsupported_parameter", where)
    check_keys(tool, frozenset({"type", "function"}), where)
    return _named(tool.get("function"), f"{where}.function")


_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _kind(tool: Any, where: str) -> str:
    if not isinstance(tool, dict):
        raise APIError(400, f"{where} must be an object", "invalid_value", where)
    kind = tool.get("type")
    if not isinstance(kind, str) or not _TYPE.fullmatch(kind):   # named in a response header
        raise APIError(400, f"{where}.type must be a tool type (letters, digits, '_', '-', '.')",
                       "invalid_value", f"{where}.type")
    return kind


_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# Responses: `defer_loading` (load the tool only when a tool search finds it) is served by
# offering the tool at once; `output_schema` (of its output) and `async` (its output may come in
# a later request: every output does here) ask nothing of the answer; `allowed_callers`
# must let the model call it directly
_RESPONSES_KEYS = frozenset({"type", "defer_loading", "output_schema", "async",
                             "allowed_callers"})
_FLAT_KEYS = _FUNCTION_KEYS | _RESPONSES_KEYS


def _named(fn: Any, where: str, flat: bool = False, cls: type[Function] = Function,
           **extra) -> Function:
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where} needs a 'name'", "invalid_value", where)
    check_keys(fn, _FLAT_KEYS if flat else _FUNCTION_KEYS, where)
    if flat:
        _check_callers(fn, where)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict must be true or false", "invalid_value",
                       f"{where}.strict")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    # a 400 naming it if it is invalid, or strict and not enforceable whole
    enforced = enforceable_schema(params, f"{where}.parameters", strict=bool(strict))
    return cls(fn["name"], fn.get("description") or "", params,
               enforced=None if enforced is params else enforced, strict=bool(strict), **extra)


_CUSTOM_KEYS = frozenset({"name", "description", "format"}) | _RESPONSES_KEYS - {"output_schema"}
_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
          "additionalProperties": False}


def _client_tool(tool: dict, where: str, kind: str, namespace: str | None = None) -> ClientTool:
    if kind == "function":
        fn = _named(tool, where, flat=True, cls=ClientTool, namespace=namespace)
        fn.own_name = fn.name
        return fn   # type: ignore[return-value]
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where} needs a 'name'", "invalid_value", where)
    check_keys(tool, _CUSTOM_KEYS, where)
    _check_callers(tool, where)
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", "invalid_value",
                       f"{where}.description")
    # strict: a custom call carries its one string argument (`input`), so a call without it
    # cannot be returned as one
    return ClientTool(name, _custom_description(description, tool.get("format"), where),
                      _INPUT, own_name=name, namespace=namespace, custom=True, strict=True)


def _check_callers(tool: dict, where: str) -> None:
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
        raise APIError(400, f"{where}.allowed_callers must include 'direct': the model calls "
                       "tools directly here", "unsupported_parameter", f"{where}.allowed_callers")


def _custom_description(description: str, fmt: Any, where: str) -> str:
    """A custom tool's description, told as a function's: its input is the one string
    argument, in the format's grammar when it has one."""
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text",
                                                                               "grammar")):
        raise APIError(400, f"{where}.format must be {{\"type\": \"text\"}} or a grammar",
                       "invalid_value", f"{where}.format")
    note = "Its whole input is the string argument `input` (raw text, written as a JSON string)."
    definition = (fmt or {}).get("definition")
    if isinstance(definition, str) and definition and definition not in description:
        note += (f" That text follows this {(fmt or {}).get('syntax') or 'grammar'} grammar:\n"
                 f"{definition}")
    return f"{description}\n\n{note}" if description else note


_NAMESPACE_KEYS = frozenset({"type", "name", "description", "tools"})


def _namespace(tool: dict, where: str, ignored: list[str]) -> list[ClientTool]:
    """A namespace's functions and custom tools (its other tools are left out, named)."""
    check_keys(tool, _NAMESPACE_KEYS, where)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where} needs a 'name'", "invalid_value", where)
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise APIError(400, f"{where}.tools must be a list of tools", "invalid_value",
                       f"{where}.tools")
    out = []
    for j, t in enumerate(inner):
        kind = _kind(t, f"{where}.tools[{j}]")
        if kind in ("function", "custom"):
            out.append(_client_tool(t, f"{where}.tools[{j}]", kind, namespace=name))
        elif kind not in ignored:
            ignored.append(kind)
    return out


def _name_for_model(tools: list[ClientTool]) -> None:
    """A namespace's tool keeps its own name unless another tool has it too, then it is
    `namespace.name`."""
    count: dict[str, int] = {}
    for t in tools:
        count[t.own_name] = count.get(t.own_name, 0) + 1
    for t in tools:
        if t.namespace is not None and count[t.own_name] > 1:
            t.name = f"{t.namespace}.{t.own_name}"


def _choice(tool_choice: Any, names: set[str]) -> str:
    """Chat's tool_choice: 'none', 'auto', 'required' or `{"type": "function", "function":
    {"name"}}`."""
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', "invalid_value",
                       "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names the function '{name}', which is not in tools",
                       "invalid_value", "tool_choice")
    return name


def _responses_choice(tool_choice: Any, tools: list[ClientTool], ignored: list[str]) -> str:
    """The Responses API's tool_choice: 'none', 'auto', 'required', `{"type": "function" or
    "custom", "name"}` (a namespace's tool by its own name or the model's); a hosted tool's
    type forces a tool this server does not run (a 400), and `allowed_tools` is not served."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind == "allowed_tools":
        raise APIError(400, "tool_choice of type 'allowed_tools' is not supported",
                       "unsupported_parameter", "tool_choice")
    if isinstance(kind, str) and kind not in ("function", "custom"):
        raise APIError(400, f"tool_choice forces the hosted tool {kind!r}, which this server "
                       "does not run" + (" (it is left out of the prompt)" if kind in ignored
                                         else ""), "unsupported_parameter", "tool_choice")
    name = tool_choice.get("name") if isinstance(tool_choice, dict) else None
    if kind is None or not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       '{"type": "function", "name": ...}', "invalid_value", "tool_choice")
    found = [t for t in tools if t.name == name] or [t for t in tools if t.own_name == name]
    if len(found) != 1:
        raise APIError(400, f"tool_choice names the {'tool' if kind == 'custom' else 'function'}"
                       f" '{name}', which is " + ("not in tools" if not found else
                                                  "in several namespaces: name it "
                                                  "'namespace.name'"),
                       "invalid_value", "tool_choice")
    return found[0].name
