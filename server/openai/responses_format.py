"""OpenAI's Responses API: its answer as output items and typed stream events (its body and
input: server/openai/responses_body.py).

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

from scheduler import FinishReason
from server.chat.answer import Answer, AnswerStream, Reasoning, Thinking, checked_pieces
from server.chat.tool_calls import ToolCall, ToolUse
from server.http.sse import json_data, message
from server.openai import sealing
from server.openai.responses_body import ResponsesRequest
from server.openai.tool_fields import ClientTool, tool_named
from server.service.generation import Usage

# what of a text.format the answer echoes
_FORMAT_FIELDS = ("type", "name", "schema", "description", "strict")


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
