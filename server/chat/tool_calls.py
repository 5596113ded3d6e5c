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
with a grammar built from the functions' parameter schemas (of a schema with keywords the
grammar cannot enforce, what it can: `Function.enforced`), so the arguments always parse;
"auto" leaves the model free and parses what it wrote; "none" does not show the tools.

Prompt order is a cache decision: an agent resends the same tool definitions in every session,
while its system text names the session's folder, date or memory path early on. So the tools
come first (`tools_first`, PAGEDLLAMA_TOOLS_FIRST, on by default), then the system text, as
Anthropic orders a prompt (tools, system, messages): a new session's prompt then shares the
whole tool section with the last one's, in the prefix cache. The fallback format puts the tool
description at the head of the system message; a template of engine/templates that renders
tools reads the same choice as its `tools_first` variable; a model's own template keeps its
order (docs/agents.md, "Prompt order and new sessions").
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing.exceptions

from engine.grammar import GrammarError, check, closed, from_lark, json_value_lark
from server.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Function:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    # what of `parameters` a grammar can hold, when not all of it (a tool that is not strict,
    # whose schema has keywords llguidance cannot enforce): a forced call is held to it (the
    # model sees the whole `parameters`)
    enforced: dict | None = None
    # the client was promised calls that hold to `parameters` (`strict: true`): a call that
    # breaks it is not returned as a call (`breaks_schema`); any other call is returned as the
    # model wrote it, for the client to check, as OpenAI and Anthropic return one
    strict: bool = False


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


def calls_grammar(functions: list[Function], parallel: bool) -> str:
    """Grammar: one tagged call (or several, when parallel) to one of these functions, the
    arguments held to the function's parameters schema."""
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f.name},
        "arguments": f.parameters if f.enforced is None else f.enforced},
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


def prompt_input(messages: list[dict], use: ToolUse, native: bool,
                 tools_first: bool = True) -> tuple[list[dict], list[dict] | None]:
    """The messages and the chat template's `tools`: `native` (the template knows tools) passes
    the tools and the history to the template, else the fallback renders them as text, ahead of
    the system text when `tools_first`."""
    if not native:
        return render_messages(messages, use, tools_first), None
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


def render_messages(messages: list[dict], use: ToolUse, tools_first: bool = True) -> list[dict]:
    """Messages in the fallback format: tools in the system message (before its text when
    `tools_first`, else after it), calls and results as text."""
    out = [_render(m) for m in messages]
    if not use.active:
        return out
    tools = system_text(use)
    if out and out[0]["role"] in ("system", "developer"):
        head, text = out[0], out[0].get("content") or ""
        joined = f"{tools}\n\n{text}" if tools_first else f"{text}\n\n{tools}"
        return [{**head, "content": joined if text else tools}] + out[1:]
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
    """The text outside tagged calls, and the calls whose JSON parses (a block that does not
    parse stays in the text). What `CallSplitter` streams, at once: without calls the text is
    returned as it is."""
    splitter = CallSplitter()
    pieces = splitter.push(text) + splitter.end()
    return ("".join(p for p in pieces if isinstance(p, str)),
            [p for p in pieces if isinstance(p, ToolCall)])


class CallSplitter:
    """Generated text, as it comes, split into text pieces (str) and calls (ToolCall). Text goes
    out at once, except what may be the start of a call: a partial `<tool_call>` at its end,
    and the whitespace before it. A call goes out whole when its closing tag arrives; a block
    whose JSON does not parse goes out as text, and a call the answer ends inside (cut off by
    max_tokens or a stop string) is left out: it is call markup, not an answer.

    Whitespace: an answer without calls comes out exactly as it was written. Around calls, the
    whitespace that separates text from a call is dropped (`"Let me look.\n<tool_call>…"` gives
    the text "Let me look."), as is the whitespace that ends an answer with calls; text after a
    call keeps the whitespace before it when text came before the call. `first_only` keeps the
    first call and drops later ones (a client that disabled parallel calls gets at most one)."""

    def __init__(self, first_only: bool = False):
        self.first_only = first_only
        self.held = ""          # trailing whitespace and a partial tag; or an open call's body
        self.in_call = False
        self.before = ""        # the whitespace before an open call (text again if it is not)
        self.emitted = False    # some text went out
        self.after_call = False  # the last thing that went out was a call
        self.calls = 0
        self._scan = 0          # where to look for the closing tag in an open call's body

    def push(self, text: str) -> list[str | ToolCall]:
        self.held += text
        out: list[str | ToolCall] = []
        while True:
            if self.in_call:
                end = self.held.find(CLOSE, self._scan)
                if end < 0:
                    self._scan = max(0, len(self.held) - len(CLOSE) + 1)
                    return out
                body, self.held = self.held[:end], self.held[end + len(CLOSE):]
                self.in_call, self._scan = False, 0
                call = _call(body.strip())
                if call is None:
                    self._text(out, self.before + OPEN + body + CLOSE)
                else:
                    self.calls += 1
                    if self.calls == 1 or not self.first_only:
                        out.append(call)
                    self.after_call = True
                continue
            start = self.held.find(OPEN)
            if start >= 0:
                before = self.held[:start]
                text_part = before.rstrip()
                self._text(out, text_part)
                self.before = before[len(text_part):]
                self.held, self.in_call = self.held[start + len(OPEN):], True
                continue
            text_part, self.held = ready(self.held, OPEN)
            self._text(out, text_part)
            return out

    def end(self) -> list[str | ToolCall]:
        """What is left once the answer has ended."""
        out: list[str | ToolCall] = []
        rest, self.held = ("" if self.in_call else self.held), ""
        self.in_call = False
        self._text(out, rest.rstrip() if self.calls else rest)
        return out

    def _text(self, out: list, text: str) -> None:
        if self.after_call and not self.emitted:
            text = text.lstrip()
        if text:
            out.append(text)
            self.emitted, self.after_call = True, False


def ready(held: str, tag: str) -> tuple[str, str]:
    """Streamed text with no `tag` in it, cut into what may go out now and what is held until
    more comes: an end that may be the start of `tag`, and the whitespace before it (which
    belongs to what follows, a tag or more text)."""
    part = held[:len(held) - partial_suffix(held, tag)].rstrip()
    return part, held[len(part):]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", {})
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args))


def validate_arguments(schema: dict, arguments_json: str) -> str | None:
    """None when these arguments (JSON text) are valid under the schema, else the first
    violation's message (where it is, what is wrong)."""
    try:
        value = json.loads(arguments_json)
    except (TypeError, ValueError):
        return "the arguments are not JSON"
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable):
        return None   # a schema the check cannot run: compile_schema has accepted it
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def breaks_schema(call: ToolCall, functions: list[Function]) -> bool:
    """Whether a call to a strict function breaks its schema: a call the model wrote while no
    grammar held it (`tool_choice` "auto"). A call to a function that is not strict is a call
    whatever its arguments: the client checks them, as it does OpenAI's and Anthropic's."""
    fn = next((f for f in functions if f.name == call.name), None)
    return (fn is not None and fn.strict
            and validate_arguments(fn.parameters, call.arguments) is not None)


def as_written(call: ToolCall) -> str:
    """A call as the text the model wrote: what a call that is not one becomes."""
    return f'{OPEN}{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}{CLOSE}'
