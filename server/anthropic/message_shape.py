"""Anthropic's answer shapes: a message (`msg_…`) with its content blocks (`thinking`, `text`,
`tool_use` with `toolu_…` ids and `input` objects), its stop reason and usage, and the same
message as Anthropic's stream events.

Blocks come from the answer's pieces (server/chat/answer.py) in the order the model wrote them:
reasoning is a `thinking` block, text a `text` block, each call a `tool_use` block. A streamed
message and the same message not streamed have the same blocks.

Usage counts what our prefix cache did with the prompt: `cache_read_input_tokens` are the
prompt tokens taken from it; `cache_creation_input_tokens` those this request computed into
full KV blocks, which the cache keeps for later requests (the cache takes every prompt by
itself: no `cache_control` marker is needed); `input_tokens` the rest (the last partial block).
The three add up to the prompt's length, as Anthropic's do.

Stream events: `message_start` (once the engine has opened the request, with its cache figures
then, or after a second in the queue), `ping` every second until the first token, per block
`content_block_start`, `content_block_delta` (`thinking_delta` then `signature_delta`,
`text_delta`, one `input_json_delta` with a call's whole input) and `content_block_stop`, then
`message_delta`
(stop reason, and the usage: cumulative, as Anthropic's), `message_stop`. A failure after the
start is a final `error` event.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from scheduler import FinishReason
from server.chat.answer import Piece, Reasoning
from server.chat.tool_calls import CLOSE, OPEN, Function, ToolCall, breaks_schema
from server.http.errors import anthropic_error
from server.http.sse import json_data, message
from server.service.generation import Usage


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(finish: FinishReason | None, calls: bool, stop_string: str | None,
                context_full: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A limit wins over calls (a call may have been cut off);
    a limit that was the context's, not max_tokens, is model_context_window_exceeded."""
    if finish in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return ("model_context_window_exceeded" if context_full else "max_tokens"), None
    if calls:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage(counts: Usage, block_size: int, caching: bool) -> dict:
    prompt, read = counts.prompt_tokens, counts.cached_tokens
    created = max(0, prompt // block_size * block_size - read) if caching else 0
    return {"input_tokens": prompt - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": counts.completion_tokens}


def _input(call: ToolCall) -> dict | None:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _markup(call: ToolCall) -> str:
    """A call whose arguments are not an object, as the text the model wrote."""
    return f'{OPEN}{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}{CLOSE}'


def _event(kind: str, **payload) -> bytes:
    return message(json_data({"type": kind, **payload}), kind)


@dataclass
class MessageShape:
    """One answer's blocks as they are built, and its events when it streams. A call whose
    input is not an object (a tool_use block's input is one), or that breaks a strict tool's
    input_schema, stays text, as the model wrote it; a call to a tool that is not strict is a
    tool_use block whatever its input, as Anthropic returns one (the client checks it)."""
    model: str
    omit_thinking: bool = False       # thinking.display "omitted": blocks without their text
    tools: list[Function] = field(default_factory=list)
    edits: list[dict] | None = None   # context_management's applied edits (None: none asked)
    id: str = field(default_factory=new_message_id)
    blocks: list[dict] = field(default_factory=list)
    open: str | None = None           # the kind of the open block ("text", "thinking")
    calls: int = 0

    # ---- blocks -----------------------------------------------------------------------------
    def add(self, pieces: list[Piece]) -> list[bytes]:
        """Add pieces to the blocks; the stream events they make."""
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                arguments = _input(piece)
                if arguments is None or breaks_schema(piece, self.tools):
                    out += self._text("text", _markup(piece))
                    continue
                out += self._close()
                self.calls += 1
                block = {"type": "tool_use", "id": tool_use_id(piece), "name": piece.name,
                         "input": arguments}
                self.blocks.append(block)
                index = len(self.blocks) - 1
                out.append(_event("content_block_start", index=index,
                                  content_block={**block, "input": {}}))
                out.append(_event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": piece.arguments}))
                out.append(_event("content_block_stop", index=index))
            elif isinstance(piece, Reasoning):
                out += self._text("thinking", str(piece))
            else:
                out += self._text("text", piece)
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open != kind:
            out += self._close()
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            self.blocks.append(block)
            self.open = kind
            out.append(_event("content_block_start", index=len(self.blocks) - 1,
                              content_block=dict(block)))
        if kind == "thinking" and self.omit_thinking:
            return out
        self.blocks[-1][kind] += text
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        out.append(_event("content_block_delta", index=len(self.blocks) - 1, delta=delta))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, kind, self.open = len(self.blocks) - 1, self.open, None
        out = []
        if kind == "thinking":
            out.append(_event("content_block_delta", index=index,
                              delta={"type": "signature_delta", "signature": ""}))
        return out + [_event("content_block_stop", index=index)]

    def close(self) -> list[bytes]:
        """The last block closed; an answer with no blocks gets one empty text block."""
        out = self._close()
        if not self.blocks:
            out += self._text("text", "")[:1] + self._close()
        return out

    # ---- a whole message ---------------------------------------------------------------------
    def message(self, stop: tuple[str | None, str | None], use: dict) -> dict:
        reason, sequence = stop
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": self.blocks, "stop_reason": reason, "stop_sequence": sequence,
                   "usage": use}
        if self.edits is not None:
            message["context_management"] = self.context_management()
        return message

    def context_management(self) -> dict:
        return {"applied_edits": self.edits or []}

    # ---- a stream ---------------------------------------------------------------------------
    def start(self, use: dict) -> bytes:
        return _event("message_start", message={**self.message((None, None), use),
                                                "content": []})

    def finish(self, stop: tuple[str, str | None], use: dict) -> list[bytes]:
        reason, sequence = stop
        return self.close() + [
            _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                   usage=use, **({"context_management": self.context_management()}
                                 if self.edits is not None else {})),
            _event("message_stop")]


def ping() -> bytes:
    return _event("ping")


def error_event(status: int, text: str) -> bytes:
    _, body = anthropic_error(status, text)
    return message(json_data(body), "error")
