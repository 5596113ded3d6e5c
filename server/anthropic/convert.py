"""A Messages request as what the service takes: chat messages, a ToolUse, a thinking choice and
sampling fields. Every nested shape is checked here; what is wrong or not served is a 400
naming its field (`messages.2.content.0.type`, `tools.1.input_schema`, `tool_choice.name`).

- `system` (a string or text blocks) and `role: "system"` messages become system messages;
  consecutive messages of one role are one turn (as Anthropic combines them); text blocks are
  joined with a blank line.
- An assistant's `tool_use` blocks become chat's `tool_calls` (their `input` as JSON text), its
  `thinking` blocks the message's `reasoning_content` (what thinking templates read); a user's
  `tool_result` blocks become `tool` messages (an `is_error` result is rendered as "Error: …"),
  in the order of the blocks. From there the tools go the way chat's go
  (server/chat/tool_calls.py: the template's own format or the fallback).
- A last message from the assistant is a prefill: the answer continues its text.
- `image` and `document` blocks are refused until a served model can see. Server tools
  (`web_search_…`, `bash_…`, …), which this server does not run, are left out of the prompt and
  named (the route's `x-pagedllama-ignored-tools` header); a tool_choice forcing one is a 400.
- A system block starting `x-anthropic-billing-header:` (Claude Code's, with a per-request hash)
  is left out: it means nothing to the model and would defeat the prefix cache.
- A tool whose schema uses keywords the grammar cannot enforce (`propertyNames`, …) is served
  unless it is `strict`; `thinking: adaptive` on a model that does not think answers without
  thinking.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.anthropic.messages_body import MessagesFields, MessagesRequest, invalid, unsupported
from server.chat.tool_calls import Function, ToolUse
from server.http.errors import APIError
from server.openai.structured import enforceable_schema
from server.service.request import Blame, GenerationRequest, Sampling

JOIN = "\n\n"   # between the text blocks of one message
_UNKNOWN = ("is not a field this server knows; it is refused rather than ignored, because "
            "ignoring it could silently change the answer")
_TEXT = frozenset({"type", "text", "cache_control", "citations"})
_TOOL_USE = frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"})
_TOOL_RESULT = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control",
                          "toolset_name"})
_THINKING = frozenset({"type", "thinking", "signature", "cache_control"})
_TOOL = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict",
                   "eager_input_streaming", "defer_loading", "input_examples", "allowed_callers"})
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_TOOL_TYPE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SEES = ("image", "document")


# ---- small checks ------------------------------------------------------------------------------
def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(where, "must be an object")
    return value


def _string(obj: dict, key: str, where: str, empty: bool = True) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise invalid(f"{where}.{key}", "must be a " + ("string" if empty else "non-empty string"))
    return value


def _keys(obj: dict, allowed: frozenset[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise unsupported(f"{where}.{key}", _UNKNOWN)


def _null_or(obj: dict, key: str, where: str, allowed: tuple = ()) -> None:
    """A field we accept only at a value that asks for nothing."""
    value = obj.get(key)
    if value is not None and value not in allowed:
        raise unsupported(f"{where}.{key}", _UNKNOWN if not allowed else
                          f"only {', '.join(json.dumps(a) for a in allowed)} is served")


# ---- text --------------------------------------------------------------------------------------
def _text_block(block: dict, where: str) -> str:
    _keys(block, _TEXT, where)
    if block.get("citations"):
        raise unsupported(f"{where}.citations", "is not supported: no citations are made here")
    return _string(block, "text", where)


def _block_type(block: Any, where: str) -> str:
    kind = _object(block, where).get("type")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type", "must be a string")
    if kind in _SEES:
        raise APIError(400, f"{where}: {kind} content is not supported: the models served here "
                       "read text only", "unsupported_parameter", f"{where}.type")
    return kind


def text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind != "text":
            raise unsupported(f"{at}.type", f"only text blocks are served here, not {kind!r}")
        texts.append(_text_block(block, at))
    return JOIN.join(texts)


# Claude Code's first system block: a client version and a per-request hash (`cch=`) that mean
# nothing to the model and would change the prompt's first tokens on every request.
BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(body: MessagesFields) -> str | None:
    """The system prompt as one text, without a billing-header block (or first line)."""
    system = body.system
    if system is None:
        return None
    if isinstance(system, str):
        head, _, rest = system.partition("\n")
        return rest if head.startswith(BILLING_HEADER) else system
    kept = [b for b in system if not (isinstance(b, dict) and b.get("type") == "text"
                                      and str(b.get("text", "")).startswith(BILLING_HEADER))]
    if len(kept) == len(system):
        return text_of(system, "system")
    return text_of(kept, "system") if kept else None


# ---- messages ----------------------------------------------------------------------------------
def _turns(messages: list[Any]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """Messages checked, as (role, [(where, block)]); consecutive messages of one role are one
    turn, a string content one text block."""
    turns: list[tuple[str, list[tuple[str, dict]]]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        message = _object(message, where)
        _keys(message, frozenset({"role", "content"}), where)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role", "must be 'user', 'assistant' or 'system'")
        content = message.get("content")
        if isinstance(content, str):
            blocks = [(f"{where}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            blocks = [(f"{where}.content.{j}", b) for j, b in enumerate(content)]
        else:
            raise invalid(f"{where}.content", "must be a string or a list of content blocks")
        if turns and turns[-1][0] == role and role != "system":
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    return turns


def _user(blocks: list[tuple[str, dict]]) -> list[dict]:
    out, texts = [], []
    for where, block in blocks:
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": JOIN.join(texts)})
                texts = []
            out.append(_tool_result(block, where))
        else:
            raise _not_here(kind, where, "user")
    if texts or not out:
        out.append({"role": "user", "content": JOIN.join(texts)})
    return out


def _tool_result(block: dict, where: str) -> dict:
    _keys(block, _TOOL_RESULT, where)
    _null_or(block, "toolset_name", where)
    call_id = _string(block, "tool_use_id", where, empty=False)
    content = block.get("content", "")
    text = "" if content is None else text_of(content, f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error", "must be true or false")
    return {"role": "tool", "tool_call_id": call_id,
            "content": f"Error: {text}" if is_error else text}


def _assistant(blocks: list[tuple[str, dict]]) -> dict:
    texts, calls, thoughts = [], [], []
    for where, block in blocks:
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind == "thinking":
            _keys(block, _THINKING, where)
            thoughts.append(_string(block, "thinking", where))
        elif kind == "redacted_thinking":   # opaque (another server's): nothing to show
            _keys(block, frozenset({"type", "data", "cache_control"}), where)
        else:
            raise _not_here(kind, where, "assistant")
    message: dict = {"role": "assistant", "content": JOIN.join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = JOIN.join(thoughts)
    return message


def _tool_use(block: dict, where: str) -> dict:
    _keys(block, _TOOL_USE, where)
    _null_or(block, "caller", where, ({"type": "direct"},))
    _null_or(block, "toolset_name", where)
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", "must be an object")
    return {"id": _string(block, "id", where, empty=False), "type": "function",
            "function": {"name": _string(block, "name", where, empty=False),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _not_here(kind: str, where: str, role: str) -> APIError:
    if kind in ("tool_use", "thinking", "tool_result", "text"):
        return invalid(f"{where}.type", f"a {role} message cannot hold a {kind!r} block")
    return unsupported(f"{where}.type", f"content blocks of type {kind!r} are not served here")


def to_chat(body: MessagesFields) -> tuple[list[dict], bool]:
    """The chat messages (the system prompt first), and whether the last message is an
    assistant prefill the answer continues."""
    messages = []
    system = system_text(body)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for role, blocks in _turns(body.messages):
        if role == "user":
            messages += _user(blocks)
        elif role == "assistant":
            messages.append(_assistant(blocks))
        else:
            messages.append({"role": "system", "content": text_of(
                [b for _, b in blocks], blocks[0][0].rsplit(".content", 1)[0] + ".content")})
    prefill = messages[-1]["role"] == "assistant"
    if prefill and messages[-1].get("tool_calls"):
        raise invalid(f"messages.{len(body.messages) - 1}", "the last message cannot be an "
                      "assistant's tool_use: send its tool_result in a user message")
    return messages, prefill


# ---- tools -------------------------------------------------------------------------------------
@dataclass
class Tools:
    use: ToolUse
    first_only: bool = False    # disable_parallel_tool_use with "auto": at most one call kept
    ignored: list[str] = field(default_factory=list)   # the types of server tools left out


def tools_of(body: MessagesFields) -> Tools:
    choice = _choice(body)
    functions, names, ignored = [], set(), {}
    for i, tool in enumerate(body.tools or []):
        kind = _object(tool, f"tools.{i}").get("type")
        if kind not in (None, "custom"):   # a server tool: not run here, left out of the prompt
            if not isinstance(kind, str) or not _TOOL_TYPE.match(kind):
                raise invalid(f"tools.{i}.type", "must be a tool type name (letters, digits, "
                              "'_', '-', '.')")
            ignored[str(tool.get("name") or kind)] = kind
            continue
        fn = _tool(tool, f"tools.{i}", choice)
        if fn.name in names:
            raise invalid(f"tools.{i}.name", f"the tool name {fn.name!r} is given twice")
        names.add(fn.name)
        functions.append(fn)
    kind, name, parallel = choice
    if kind == "tool" and name in ignored:
        raise unsupported("tool_choice.name", f"forces the server tool {name!r} "
                          f"({ignored[name]}), which this server does not run")
    if kind == "tool" and name not in names:
        raise invalid("tool_choice.name", f"names the tool {name!r}, which is not in tools")
    if kind in ("any", "tool") and not functions:
        raise invalid("tool_choice", f"tool_choice {kind!r} needs tools")
    mapped = {"auto": "auto" if functions else "none", "any": "required", "none": "none",
              "tool": name}[kind]
    return Tools(ToolUse(functions, mapped, parallel), first_only=kind == "auto" and not parallel,
                 ignored=sorted(set(ignored.values())))


def _choice(body: MessagesFields) -> tuple[str, str | None, bool]:
    choice = body.tool_choice
    if choice is None:
        return "auto", None, True
    kind = choice.get("type")
    allowed = {"auto": {"type", "disable_parallel_tool_use"},
               "any": {"type", "disable_parallel_tool_use"},
               "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in allowed:
        raise invalid("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    _keys(choice, frozenset(allowed[kind]), "tool_choice")
    disable = choice.get("disable_parallel_tool_use", False)
    if disable is not None and not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "must be true or false")
    name = _string(choice, "name", "tool_choice", empty=False) if kind == "tool" else None
    return kind, name, not disable


def _tool(tool: Any, where: str, choice: tuple[str, str | None, bool]) -> Function:
    tool = _object(tool, where)
    _keys(tool, _TOOL, where)
    name = _string(tool, "name", where, empty=False)
    if not _TOOL_NAME.match(name):
        raise invalid(f"{where}.name", "must be letters, digits, '_' or '-' (at most 128)")
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.description", "must be a string")
    examples = tool.get("input_examples")   # shown to the model after the description
    if examples is not None:
        if not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples):
            raise invalid(f"{where}.input_examples", "must be a list of objects")
        description += "".join("\nExample input: " + json.dumps(e, ensure_ascii=False)
                               for e in examples)
    _null_or(tool, "allowed_callers", where, (["direct"],))
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict", "must be true or false")
    if strict and choice[0] not in ("any", "tool"):
        raise unsupported(f"{where}.strict", "a tool's input is held to its schema only when "
                          "tool_choice forces a call ('any' or 'tool')")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise invalid(f"{where}.input_schema", "must be a JSON schema of type 'object'")
    # a 400 naming it if it is invalid; keywords the grammar cannot enforce are a 400 only for
    # a strict tool (a call to one that is not strict is returned whatever its input)
    enforced = enforceable_schema(schema, f"{where}.input_schema", strict=bool(strict))
    return Function(name, description, schema,
                    enforced=None if enforced is schema else enforced, strict=bool(strict))


# ---- thinking ----------------------------------------------------------------------------------
@dataclass
class ThinkingAsk:
    off: bool = False       # "disabled" on a thinking model: an empty reasoning block first
    omit: bool = False      # display "omitted": thinking blocks without their text


def thinking_of(body: MessagesFields, model: str, thinks: bool,
                max_tokens: int | None = None) -> ThinkingAsk:
    """What `thinking` asks of this model. A model thinks when its chat template writes
    reasoning; one that does not refuses "enabled" and "adaptive"."""
    t = body.thinking
    if t is None:
        return ThinkingAsk()
    kind = t.get("type")
    if kind == "disabled":
        _keys(t, frozenset({"type"}), "thinking")
        return ThinkingAsk(off=thinks)
    if kind not in ("enabled", "adaptive"):
        raise invalid("thinking.type", "must be 'enabled', 'adaptive' or 'disabled'")
    _keys(t, frozenset({"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set())),
          "thinking")
    if not thinks and kind == "adaptive":   # the model decides, and this one never thinks
        return ThinkingAsk()
    if not thinks:
        raise unsupported("thinking", f"the model '{model}' does not think (its chat template "
                          "writes no reasoning)")
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise invalid("thinking.budget_tokens", "must be an integer of at least 1024")
        if max_tokens is not None and budget >= max_tokens:
            raise invalid("thinking.budget_tokens", "must be less than max_tokens")
    display = t.get("display")
    if display not in (None, "summarized", "omitted"):
        raise invalid("thinking.display", "must be 'summarized' or 'omitted'")
    return ThinkingAsk(omit=display == "omitted")


# ---- sampling ----------------------------------------------------------------------------------
def sampling(body: MessagesRequest) -> Sampling:
    """The sampling values the service takes (stop_sequences as stop strings)."""
    stops = body.stop_sequences or []
    if len(stops) > 16:
        raise invalid("stop_sequences", "at most 16 stop sequences")
    if any(not s for s in stops):
        raise invalid("stop_sequences", "a stop sequence cannot be empty")
    return Sampling(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                    min_p=body.min_p, seed=body.seed, stop=tuple(stops),
                    ignore_eos=body.ignore_eos)


def generation(body: MessagesRequest, prompt: list[int], grammar: str | None,
               affinity: str | None, ignored_tools: tuple[str, ...] = ()) -> GenerationRequest:
    """The request as the service takes it; a prompt error names `messages`; `ignored_tools`
    (server tools left out of the prompt) are named in the request log."""
    return GenerationRequest([prompt], sampling(body), body.max_tokens, 1, body.priority,
                             body.timeout, grammar, affinity, Blame(prompt="messages"),
                             ignored_tools)
