"""OpenAI's Responses API, stateless: its request body, the checks of what it asks for, its
`input` items as chat messages, and its answer as output items and typed stream events.

`input` (a string, or a list of items: messages, `function_call`s and `function_call_output`s)
and `instructions` become chat messages (developer messages become system ones; calls and their
outputs become assistant `tool_calls` and `tool` messages). `text.format` (`json_object`,
`json_schema`) constrains the output with the grammar chat's `response_format` uses; function
`tools` and `tool_choice` work as in chat, in the Responses shapes, and each call comes back as
a `function_call` output item. Nothing is stored: `store: true`, `previous_response_id`,
`background` and tools other than functions are 400s.

Streamed, the typed events follow OpenAI's order: response.created, response.in_progress, then
per output item response.output_item.added, (a message) response.content_part.added,
response.output_text.delta…, response.output_text.done, response.content_part.done, (a call)
response.function_call_arguments.delta, response.function_call_arguments.done, and
response.output_item.done; then response.completed (or response.incomplete when
max_output_tokens ended it).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, Field

from engine import Request
from scheduler import FinishReason
from server.chat.answer import AnswerStream, Reasoning, Thinking, split_answer
from server.chat.tools import ToolCall, ToolUse
from server.http.errors import APIError
from server.http.sse import json_data, message
from server.openai.fields import check_keys, check_stream_options
from server.openai.schemas import INT32_MAX, Bool, Int, SamplingFields
from server.openai.structured import text_format_grammar
from server.openai.tools import parse_tools

_TEXT_PARTS = {"input_text", "output_text", "text"}
_CHAT_ONLY = ("response_format", "json_schema", "grammar")
# Accepted and ignored: they label or route a request.
_HARMLESS = frozenset({"user", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention"})
_FORMAT_FIELDS = ("type", "name", "schema", "description", "strict")
_CHECKED = frozenset({"include", "reasoning", "truncation"})   # _check_extras


class ResponsesRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")   # unknown fields are refused by name, not ignored

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    store: Bool | None = None
    previous_response_id: str | None = None
    background: Bool | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None            # server/openai/tools.py checks each one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    metadata: dict[str, Any] | None = None

    @property
    def format(self) -> Any:
        """`text.format` as sent (None when absent)."""
        return (self.text or {}).get("format")


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not supported: {why}", "unsupported_parameter", param)


def reject_unsupported(body: ResponsesRequest) -> None:
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


def _check_extras(extra: dict, text: dict) -> None:
    """The Responses fields that only ask for nothing at their defaults: `include` (extra
    output: logprobs, sources, ...), `reasoning` (an effort or a summary), `text.verbosity`
    (chat's `reasoning_effort` and `verbosity` are refused as well), and `truncation`: "auto"
    would drop the start of an input too long for the context, which is refused anyway
    (context_length_exceeded), so both values behave alike on everything we accept."""
    if extra.get("include"):
        raise _unsupported("include", f"no extra output ({extra['include']!r}) is produced here")
    reasoning = extra.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise APIError(400, "reasoning must be an object", "invalid_value", "reasoning")
        check_keys(reasoning, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
        if any(v is not None for v in reasoning.values()):
            raise _unsupported("reasoning", "the models served here have no reasoning effort "
                               "or summary to set")
    if extra.get("truncation") not in (None, "auto", "disabled"):
        raise APIError(400, "truncation must be 'auto' or 'disabled'", "invalid_value",
                       "truncation")
    check_keys(text, frozenset({"format", "verbosity"}), "text")
    if text.get("verbosity") not in (None, "medium"):
        raise _unsupported("text.verbosity", "the output's length is set by max_output_tokens")


def constraints(body: ResponsesRequest, model) -> tuple[ToolUse, str | None]:
    """The request's tools, and the grammar its text.format or tool_choice implies (400s naming
    what is wrong, as chat's response_format and tools)."""
    use = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, responses=True)
    fmt_grammar = text_format_grammar(body.format, model)
    tool_grammar = use.grammar()
    if fmt_grammar and tool_grammar:
        raise APIError(400, "a tool_choice that forces a call cannot be combined with a "
                       "text.format other than text", "invalid_value", "tool_choice")
    return use, fmt_grammar or tool_grammar


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
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise APIError(400, f"{where}.{key} must be {what}", "invalid_value", f"{where}.{key}")
    return value


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"input[{i}].role must be user, assistant, system or developer",
                       "invalid_value", f"input[{i}].role")
    return {"role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), f"input[{i}].content", _TEXT_PARTS)}


def _add_call(messages: list[dict], item: dict, i: int) -> None:
    """A function_call item as chat's assistant `tool_calls`: calls in a row, and the assistant
    text just before them, are one assistant turn."""
    where = f"input[{i}]"
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where, "a string (JSON)")}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_output(item: dict, i: int) -> dict:
    """A function_call_output item as chat's `tool` message."""
    where = f"input[{i}]"
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where),
            "content": _text(item.get("output"), f"{where}.output", {"input_text", "text"})}


def _reasoning(item: dict, i: int) -> str:
    """A reasoning item's text (its reasoning_text parts, else its summary)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"input[{i}]: a reasoning item's content and summary are lists of "
                       "text parts", "invalid_value", f"input[{i}]")
    return "\n\n".join(p["text"] for p in parts)


def to_messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages from `instructions` and `input` (developer messages become system ones;
    function calls and their outputs become assistant `tool_calls` and `tool` messages; a
    reasoning item, the `reasoning_content` of the assistant turn it starts, which thinking
    templates read)."""
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
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
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


def call_item(call: ToolCall, done: bool = True) -> dict:
    """A function_call item; its id ("fc_…") is derived from the call's id ("call_…")."""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id, "name": call.name, "arguments": call.arguments if done else "",
            "status": "completed" if done else "in_progress"}


def reasoning_item(item_id: str, text: str | None) -> dict:
    """A reasoning item (a thinking model's reasoning), in progress while `text` is None."""
    done = text is not None
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [reasoning_part(text)] if done else [],
            "status": "completed" if done else "in_progress"}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_items(text: str, use: ToolUse, message_id: str,
                 thinking: Thinking | None = None) -> list[dict]:
    """The output items of a finished answer: its reasoning (a thinking model's), its text as a
    message (unless it is only calls), then one function_call item per call (calls are parsed
    only when tools are active)."""
    answer = split_answer(text, use.active, thinking)
    items = [reasoning_item(new_id("rs_"), answer.reasoning)] if answer.reasoning else []
    if answer.text or not answer.calls:
        items.append(message_item(message_id, answer.text))
    return items + [call_item(c) for c in answer.calls]


def echo_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        return {"type": "text"}
    return {k: fmt[k] for k in _FORMAT_FIELDS if k in fmt}


def echo_tool_choice(use: ToolUse) -> str | dict:
    if use.choice in ("none", "auto", "required"):
        return use.choice
    return {"type": "function", "name": use.choice}


@dataclass
class ResponseState:
    """One response being built: what every event and the final object carry."""
    body: ResponsesRequest
    model: str
    req: Request
    use: ToolUse
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
        self.output = output_items(self.text, self.use, self.item_id, self.thinking)
        return self.output

    # ---- a streamed answer, item by item as its pieces come --------------------------------
    def pieces_events(self, text: str) -> Iterator[bytes]:
        """New text of a streamed answer: what of it can go out now, as item events (text as
        output_text deltas at once, except what may start a call; a call as its item once it
        is complete; reasoning as reasoning_text deltas)."""
        if self.answer is None:
            self.answer = AnswerStream(self.use.active, self.thinking)
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
        for piece in pieces:
            if isinstance(piece, ToolCall):
                yield from self._close()
                item = call_item(piece)
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
                         item=reasoning_item(self.open["id"], None))
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

    @staticmethod
    def _final(item: dict) -> dict:
        if item["type"] == "message":
            return message_item(item["id"], item["text"])
        if item["type"] == "reasoning":
            return reasoning_item(item["id"], item["text"])
        return item

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                "content_index": 0}

    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "completed" if self.finish is FinishReason.STOP else "incomplete"

    def usage(self) -> dict:
        n_in, n_out = len(self.req.prompt), self.req.num_output
        return {"input_tokens": n_in,
                "input_tokens_details": {"cached_tokens": self.req.num_cached},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + n_out}

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
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": echo_format(b.format)},
                "tool_choice": echo_tool_choice(self.use), "tools": b.tools or [],
                "truncation": (b.model_extra or {}).get("truncation") or "disabled",
                "usage": self.usage() if done else None,
                "user": None, "metadata": b.metadata or {}}

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
        where = {"item_id": item["id"], "output_index": index}
        yield self.event("response.output_item.added", output_index=index,
                         item={**item, "arguments": "", "status": "in_progress"})
        yield self.event("response.function_call_arguments.delta", **where,
                         delta=item["arguments"])
        yield self.event("response.function_call_arguments.done", **where,
                         arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)

    def item_events(self, index: int, item: dict) -> Iterator[bytes]:
        """A finished item's whole life as events (what a held-back answer sends at its end)."""
        if item["type"] == "function_call":
            yield from self.call_events(index, item)
            return
        yield from self.message_opened(index)
        if item["content"][0]["text"]:
            yield self.text_delta(index, item["content"][0]["text"])
        yield from self.message_closed(index, item)

    def _where(self, index: int) -> dict:
        return {"item_id": self.item_id, "output_index": index, "content_index": 0}


