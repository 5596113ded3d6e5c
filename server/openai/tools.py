"""Tool calls: rendered by the model's chat template when it knows tools, else through a
documented fallback format (SmolLM2's template, among others, knows none).

Either way the model calls a function by answering `<tool_call>{"name": "NAME", "arguments":
{...}}</tool_call>` (several such blocks for parallel calls), and `parse_tool_calls` reads them
back. A template that knows tools (engine/chat.py `ChatTemplate.knows_tools`: it reads `tools`
and writes `<tool_call>`, as Hermes and Qwen2.5 templates do) gets them as its `tools` variable
in OpenAI's shape, and the history as it is (assistant `tool_calls` with their arguments parsed,
`tool` messages). The fallback describes the tools in the system message, renders an
assistant's `tool_calls` in the tagged format and a `tool` message as a user turn wrapped in
`<tool_response>`. `tool_choice` "required" or a named function constrains the whole answer
with a grammar built from the functions' parameter schemas, so the arguments always parse and
validate; "auto" leaves the model free and parses what it wrote; "none" does not show the tools.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import GrammarError, check, closed, from_lark, json_value_lark
from server.http.errors import APIError
from server.openai.fields import check_keys
from server.openai.structured import compile_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass
class Function:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ToolUse:
    """What a request asked for: its functions, the choice, and the grammar it implies."""
    functions: list[Function]
    choice: str                     # "none" | "auto" | "required" | a function name
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def grammar(self) -> str | None:
        if self.choice in ("none", "auto"):
            return None
        allowed = [f for f in self.functions if self.choice in ("required", f.name)]
        # a named function is called once (OpenAI's forced call; vLLM's too): with parallel
        # calls allowed, a small model would repeat the call until max_tokens
        return calls_grammar(allowed, self.parallel and self.choice == "required")


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


def calls_grammar(functions: list[Function], parallel: bool) -> str:
    """Grammar: one tagged call (or several, when parallel) to one of these functions, the
    arguments held to the function's parameters schema."""
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f.name}, "arguments": f.parameters},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}
    call = f'"{OPEN}" "\\n"? call "\\n"? "{CLOSE}"'   # Hermes-style templates put newlines there
    lark = (f'start: {call}' + (f' ("\\n" {call})*' if parallel else "")
            + f"\ncall: {json_value_lark(closed(schema))}\n")
    grammar = from_lark(lark)
    try:
        check(grammar)
    except GrammarError as exc:
        raise APIError(400, f"a function's parameters cannot be enforced: {exc}",
                       "invalid_schema", "tools") from exc
    return grammar


# ---- prompt side ---------------------------------------------------------------------------------
def system_text(use: ToolUse) -> str:
    lines = ["You can call these functions (JSON schema of each one's arguments):"]
    for f in use.functions:
        lines.append(json.dumps({"name": f.name, "description": f.description,
                                 "parameters": f.parameters}, ensure_ascii=False))
    lines.append(f'To call a function, answer with {OPEN}{{"name": "NAME", "arguments": '
                 f'{{...}}}}{CLOSE}' + (" (one block per call)" if use.parallel else "") + ".")
    return "\n".join(lines)


def prompt_input(messages: list[dict], use: ToolUse,
                 native: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and the chat template's `tools`: `native` (the template knows tools) passes
    the tools and the history to the template, else the fallback renders them as text."""
    if not native:
        return render_messages(messages, use), None
    tools = [{"type": "function", "function": {"name": f.name, "description": f.description,
                                               "parameters": f.parameters}}
             for f in use.functions] if use.active else None
    return [_native(m) for m in messages], tools


def _native(m: dict) -> dict:
    """An assistant's calls with their arguments parsed: templates write `arguments | tojson`."""
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or not isinstance(calls, list):
        return m
    return {**m, "tool_calls": [_parsed(c) for c in calls]}


def _parsed(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    return {**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}}


def _arguments(text: Any) -> Any:
    """JSON text parsed; anything else (text that is not JSON, an object already) as it is."""
    if not isinstance(text, str):
        return {} if text is None else text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def render_messages(messages: list[dict], use: ToolUse) -> list[dict]:
    """Messages in the fallback format: tools in the system message, calls and results as text."""
    out = [_render(m) for m in messages]
    if not use.active:
        return out
    tools = system_text(use)
    if out and out[0]["role"] in ("system", "developer"):
        return [{**out[0], "content": f"{out[0]['content']}\n\n{tools}"}] + out[1:]
    return [{"role": "system", "content": tools}] + out


def _render(m: dict) -> dict:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>{m.get('content', '')}</tool_response>"}
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        blocks = [f'{OPEN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                  f'{c["function"].get("arguments") or "{}"}}}{CLOSE}' for c in calls]
        text = (m.get("content") or "") + "\n".join(blocks)
        return {"role": "assistant", "content": text}
    return {k: v for k, v in m.items() if k != "tool_calls"}


# ---- answer side ---------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside tagged calls, and the calls whose JSON parses (others stay in the text).
    A call the answer ends inside (cut off by max_tokens or a stop string before its closing
    tag) is left out of the text too: it is call markup, not an answer."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    rest = text[last:]
    cut = rest.rfind(OPEN)
    if cut >= 0 and CLOSE not in rest[cut:]:
        kept.append(rest[:cut])
        return "".join(kept).strip(), calls
    kept.append(rest)
    return "".join(kept).strip() if calls else text, calls


def _call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", {})
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args))
