"""OpenAI response shaping: one place that turns engine events into chat/completion bodies and
SSE chunks (choices, deltas, finish reasons, usage). A new response field touches only this file."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from engine import Request
from scheduler import FinishReason
from engine.logprobs import TokenLogprob
from server.tools import parse_tool_calls

Kind = Literal["chat", "completion"]


def openai_finish(reason: FinishReason | None) -> str | None:
    if reason is FinishReason.TIMEOUT:   # a deadline ends a request like max_tokens does
        return FinishReason.LENGTH.value
    return reason.value if reason else None


def usage(req: Request) -> dict:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": req.num_output,
            "total_tokens": len(req.prompt) + req.num_output,
            "prompt_tokens_details": {"cached_tokens": req.num_cached}}


def sse(payload: dict | str) -> dict:
    return {"data": payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}


@dataclass
class OpenAIFormat:
    """How one request's answer is shaped: its id, kind, model name and stream options."""
    kind: Kind
    model: str
    id: str
    created: int
    stream: bool = False
    include_usage: bool = False
    echo: str = ""                     # completions: the prompt text to put before the answer
    tools: bool = False                # chat with tools: calls are parsed out of the text

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # ---- a whole response ---------------------------------------------------------------------
    def response(self, text: str, finish: FinishReason, req: Request,
                 logprobs: list[TokenLogprob] | None = None) -> dict:
        text = self.echo + text
        if not self.chat:
            choice = {"index": 0, "text": text, "finish_reason": openai_finish(finish)}
        else:
            message, reason = self._message(text, finish)
            choice = {"index": 0, "message": message, "finish_reason": reason}
        choice["logprobs"] = self._logprobs(logprobs, len(self.echo))
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [choice], "usage": usage(req)}

    def _message(self, text: str, finish: FinishReason) -> tuple[dict, str | None]:
        calls = []
        if self.tools:
            text, calls = parse_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, openai_finish(finish)
        return ({"role": "assistant", "content": text or None,
                 "tool_calls": [c.openai() for c in calls]}, "tool_calls")

    def _logprobs(self, items: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if not items:
            return None
        return chat_logprobs(items) if self.chat else completion_logprobs(items, offset)

    # ---- a stream -----------------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        if self.chat:
            return [self._chunk({"role": "assistant", "content": ""}, None)]
        return [self._chunk(self.echo, None)] if self.echo else []

    def text_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict:
        return self._chunk({"content": text} if self.chat else text, None,
                           self._logprobs(logprobs))

    def finish_chunk(self, finish: FinishReason) -> dict:
        return self._chunk({} if self.chat else "", openai_finish(finish))

    def closing_chunks(self, held: str, finish: FinishReason) -> list[dict]:
        """The text held back (with tools), the calls as deltas, then the finish chunk: per call
        one delta with its index, id and name, then one with its arguments."""
        if not self.tools:
            return [self.finish_chunk(finish)]
        text, calls = parse_tool_calls(held)
        chunks = [self.text_chunk(text)] if text else []
        for i, call in enumerate(calls):
            head = call.openai(i)
            head["function"] = {"name": call.name, "arguments": ""}
            chunks.append(self._chunk({"tool_calls": [head]}, None))
            chunks.append(self._chunk({"tool_calls": [
                {"index": i, "function": {"arguments": call.arguments}}]}, None))
        reason = "tool_calls" if calls else openai_finish(finish)
        return chunks + [self._chunk({}, reason)]

    def usage_chunk(self, req: Request) -> dict:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model, "choices": [], "usage": usage(req)})

    def _chunk(self, delta: dict | str, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = ({"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta})
        choice.update(logprobs=logprobs, finish_reason=finish)
        payload = {"id": self.id, "object": self.chunk_object, "created": self.created,
                   "model": self.model, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    """OpenAI chat shape: per token its text, logprob, bytes and the top alternatives."""
    def entry(piece: bytes, logprob: float) -> dict:
        return {"token": _text(piece), "logprob": logprob, "bytes": list(piece)}
    return {"content": [{**entry(t.piece, t.logprob),
                         "top_logprobs": [entry(p, lp) for _, p, lp in t.top]} for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict:
    """OpenAI (legacy) completions shape: parallel lists and text offsets."""
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(_text(t.piece))
    return {"tokens": [_text(t.piece) for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{_text(p): lp for _, p, lp in t.top} for t in items],
            "text_offset": offsets}
