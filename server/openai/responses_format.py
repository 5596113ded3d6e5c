"""OpenAI's Responses API, stateless: its request body, the checks of what it asks for, its
`input` items as chat messages, and its answer as output items and typed stream events.

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

Streamed, the typed events follow OpenAI's order: response.created, response.in_progress, then
per output item response.output_item.added, (a message) response.content_part.added,
response.output_text.delta…, response.output_text.done, response.content_part.done, (a call)
response.function_call_arguments.delta / .done or response.custom_tool_call_input.delta /
.done, and response.output_item.done; then response.completed (or response.incomplete when
max_output_tokens ended it).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, Field

from scheduler import FinishReason
from server.chat.answer import Answer, AnswerStream, Reasoning, Thinking, checked_pieces
from server.chat.tool_calls import ToolCall, ToolUse
from server.http.errors import APIError
from server.http.sse import json_data, message
from server.openai import sealing
from server.openai.bodies import INT32_MAX, Bool, Int, SamplingFields, nullable, or_null
from server.openai.fields import check_keys, check_stream_options, check_types
from server.openai.structured import text_format_grammar
from server.openai.tool_fields import ClientTool, model_name, responses_tools, tool_named
from server.service.generation import Usage

_TEXT_PARTS = {"input_text", "output_text", "text"}
_CHAT_ONLY = ("response_format", "json_schema", "grammar")
# Accepted and ignored: they label or route a request (of these types: a 400 otherwise).
_LABELS: dict[str, Any] = {"user": str, "service_tier": str, "safety_identifier": str,
                           "prompt_cache_retention": str, "client_metadata": dict[str, Any]}
_HARMLESS = frozenset(_LABELS)
_FORMAT_FIELDS = ("type", "name", "schema", "description", "strict")
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


# ---- output --------------------------------------------------------------------------------------
def message_item(item_id: str, text: str | None) -> dict:
    """An assistant message item: in progress (no content yet) while `text` is None."""
    done = text is not None
    return {"type": "message", "id": item_id, "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [text_part(text)] if done else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: ToolCall, done: bool = True, tool: ClientTool | None = None) -> dict:
    """A call's item, its id derived from the call's id ("call_…"): a function_call ("fc_…"),
    or for a custom tool a custom_tool_call ("ctc_…") carrying its input; named as the client
    knows the tool, with its namespace when it has one."""
    suffix = call.id.removeprefix("call_")
    status = "completed" if done else "in_progress"
    name = tool.own_name if tool is not None else call.name
    if tool is not None and tool.custom:
        item = {"type": "custom_tool_call", "id": "ctc_" + suffix, "call_id": call.id,
                "name": name, "input": custom_input(call) if done else "", "status": status}
    else:
        item = {"type": "function_call", "id": "fc_" + suffix, "call_id": call.id,
                "name": name, "arguments": call.arguments if done else "", "status": status}
    if tool is not None and tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def custom_input(call: ToolCall) -> str:
    """A custom tool call's input: its one argument (a custom tool is strict: checked_pieces
    lets through only calls whose arguments hold it)."""
    return json.loads(call.arguments)["input"]


def reasoning_item(item_id: str, text: str | None, sealed: bool = False) -> dict:
    """A reasoning item (a thinking model's reasoning), in progress while `text` is None; once
    done, with `sealed` its text sealed as `encrypted_content` too."""
    done = text is not None
    item = {"type": "reasoning", "id": item_id, "summary": [],
            "content": [reasoning_part(text)] if done else [],
            "status": "completed" if done else "in_progress"}
    if sealed:
        item["encrypted_content"] = sealing.seal(text) if done else None
    return item


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_items(text: str, use: ToolUse, message_id: str, thinking: Thinking | None = None,
                 sealed: bool = False) -> list[dict]:
    """The output items of a finished answer: its reasoning (a thinking model's; `sealed`:
    with its encrypted_content), its text as a message (unless it is only calls), then one item
    per call (calls are parsed only when tools are active; without parallel calls, the first
    only)."""
    stream, answer = AnswerStream(use.active, thinking, not use.parallel), Answer()
    answer.add(checked_pieces(stream.push(text) + stream.end(), use.functions))
    items = [reasoning_item(new_id("rs_"), answer.reasoning, sealed)] if answer.reasoning else []
    if answer.text or not answer.calls:
        items.append(message_item(message_id, answer.text))
    return items + [call_item(c, tool=tool_named(use, c.name)) for c in answer.calls]


def echo_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        return {"type": "text"}
    return {k: fmt[k] for k in _FORMAT_FIELDS if k in fmt}


def echo_tool_choice(use: ToolUse) -> str | dict:
    if use.choice in ("none", "auto", "required"):
        return use.choice
    tool = tool_named(use, use.choice)
    if tool is None:
        return {"type": "function", "name": use.choice}
    return {"type": "custom" if tool.custom else "function", "name": tool.own_name}


@dataclass
class ResponseState:
    """One response being built: what every event and the final object carry."""
    body: ResponsesRequest
    model: str
    use: ToolUse
    counts: Usage = Usage()             # the request's usage, once it has finished
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    item_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    finish: FinishReason | None = None
    output: list[dict] | None = None   # the output items, once the answer is finished
    seq: int = 0
    thinking: Thinking | None = None   # where a thinking model's answer starts
    # streamed: the items sent so far (the last one maybe still open) and the answer told apart
    items: list[dict] = field(default_factory=list)
    open: dict | None = None
    answer: AnswerStream | None = None

    def finish_output(self) -> list[dict]:
        self.output = output_items(self.text, self.use, self.item_id, self.thinking,
                                   self.body.seals_reasoning)
        return self.output

    # ---- a streamed answer, item by item as its pieces come --------------------------------
    def pieces_events(self, text: str) -> Iterator[bytes]:
        """New text of a streamed answer: what of it can go out now, as item events (text as
        output_text deltas at once, except what may start a call; a call as its item once it
        is complete; reasoning as reasoning_text deltas)."""
        if self.answer is None:
            self.answer = AnswerStream(self.use.active, self.thinking, not self.use.parallel)
        self.text += text
        yield from self._pieces(self.answer.push(text))

    def end_events(self) -> Iterator[bytes]:
        """The streamed answer's end: what was held, the last item closed; an answer that made
        no item gets an empty message. The response's output is the items as they were sent."""
        if self.answer is not None:
            yield from self._pieces(self.answer.end())
        yield from self._close()
        if not self.items:
            yield from self._open_message()
            yield from self._close()
        self.output = [self._final(item) for item in self.items]

    def _pieces(self, pieces: list) -> Iterator[bytes]:
        for piece in checked_pieces(pieces, self.use.functions):
            if isinstance(piece, ToolCall):
                yield from self._close()
                item = call_item(piece, tool=tool_named(self.use, piece.name))
                self.items.append(item)
                yield from self.call_events(len(self.items) - 1, item)
            elif isinstance(piece, Reasoning):
                if self.open is None or self.open["type"] != "reasoning":
                    yield from self._close()
                    yield from self._open_reasoning()
                self.open["text"] += piece
                yield self.event("response.reasoning_text.delta", **self._at(), delta=str(piece))
            else:
                if self.open is None or self.open["type"] != "message":
                    yield from self._close()
                    yield from self._open_message()
                self.open["text"] += piece
                yield self.event("response.output_text.delta", **self._at(), delta=piece,
                                 logprobs=[])

    def _open_message(self) -> Iterator[bytes]:
        item_id = self.item_id if not any(i["type"] == "message" for i in self.items) \
            else new_id("msg_")
        self.open = {"type": "message", "id": item_id, "text": ""}
        self.items.append(self.open)
        index = len(self.items) - 1
        yield self.event("response.output_item.added", output_index=index,
                         item=message_item(item_id, None))
        yield self.event("response.content_part.added", **self._at(), part=text_part(""))

    def _open_reasoning(self) -> Iterator[bytes]:
        self.open = {"type": "reasoning", "id": new_id("rs_"), "text": ""}
        self.items.append(self.open)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item=reasoning_item(self.open["id"], None, self.body.seals_reasoning))
        yield self.event("response.content_part.added", **self._at(), part=reasoning_part(""))

    def _close(self) -> Iterator[bytes]:
        if self.open is None:
            return
        open_, index = self.open, len(self.items) - 1
        where, text = self._at(), open_["text"]
        self.open = None
        if open_["type"] == "message":
            yield self.event("response.output_text.done", **where, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, part=text_part(text))
        else:
            yield self.event("response.reasoning_text.done", **where, text=text)
            yield self.event("response.content_part.done", **where, part=reasoning_part(text))
        yield self.event("response.output_item.done", output_index=index,
                         item=self._final(open_))

    def _final(self, item: dict) -> dict:
        if item["type"] == "message":
            return message_item(item["id"], item["text"])
        if item["type"] == "reasoning":
            if "sealed" not in item:   # sealed once: the done event and the output agree
                item["sealed"] = reasoning_item(item["id"], item["text"],
                                                self.body.seals_reasoning)
            return item["sealed"]
        return item

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                "content_index": 0}

    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "completed" if self.finish is FinishReason.STOP else "incomplete"

    def usage(self) -> dict:
        c = self.counts
        return {"input_tokens": c.prompt_tokens,
                "input_tokens_details": {"cached_tokens": c.cached_tokens},
                "output_tokens": c.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": c.total_tokens}

    def response(self) -> dict:
        b, status = self.body, self.status()
        done = self.output is not None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.model, "output": self.output or [],
                "parallel_tool_calls": self.use.parallel, "previous_response_id": None,
                "reasoning": self._reasoning_asked(), "store": False,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": echo_format(b.format),
                         "verbosity": (b.text or {}).get("verbosity") or "medium"},
                "tool_choice": echo_tool_choice(self.use), "tools": b.tools or [],
                "truncation": (b.model_extra or {}).get("truncation") or "disabled",
                "usage": self.usage() if done else None,
                "user": None, "metadata": b.metadata or {}}

    def _reasoning_asked(self) -> dict:
        asked = (self.body.model_extra or {}).get("reasoning") or {}
        return {"effort": asked.get("effort"),
                "summary": asked.get("summary") or asked.get("generate_summary")}

    def event(self, kind: str, **payload) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return message(json_data(data), kind)

    # ---- the events of one output item ----------------------------------------------------
    def message_opened(self, index: int) -> Iterator[bytes]:
        yield self.event("response.output_item.added", output_index=index,
                         item=message_item(self.item_id, None))
        yield self.event("response.content_part.added", **self._where(index), part=text_part(""))

    def text_delta(self, index: int, text: str) -> bytes:
        return self.event("response.output_text.delta", **self._where(index), delta=text,
                          logprobs=[])

    def message_closed(self, index: int, item: dict) -> Iterator[bytes]:
        text = item["content"][0]["text"]
        yield self.event("response.output_text.done", **self._where(index), text=text, logprobs=[])
        yield self.event("response.content_part.done", **self._where(index), part=text_part(text))
        yield self.event("response.output_item.done", output_index=index, item=item)

    def call_events(self, index: int, item: dict) -> Iterator[bytes]:
        """A complete call's events: its item added (empty), its arguments (a custom tool's
        input) as one delta, then done."""
        where = {"item_id": item["id"], "output_index": index}
        key, kind = (("input", "response.custom_tool_call_input")
                     if item["type"] == "custom_tool_call"
                     else ("arguments", "response.function_call_arguments"))
        yield self.event("response.output_item.added", output_index=index,
                         item={**item, key: "", "status": "in_progress"})
        yield self.event(kind + ".delta", **where, delta=item[key])
        yield self.event(kind + ".done", **where, **{key: item[key]})
        yield self.event("response.output_item.done", output_index=index, item=item)

    def item_events(self, index: int, item: dict) -> Iterator[bytes]:
        """A finished item's whole life as events (what a held-back answer sends at its end)."""
        if item["type"] in ("function_call", "custom_tool_call"):
            yield from self.call_events(index, item)
            return
        yield from self.message_opened(index)
        if item["content"][0]["text"]:
            yield self.text_delta(index, item["content"][0]["text"])
        yield from self.message_closed(index, item)

    def _where(self, index: int) -> dict:
        return {"item_id": self.item_id, "output_index": index, "content_index": 0}


