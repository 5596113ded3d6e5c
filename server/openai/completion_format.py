"""OpenAI response shaping: one place that turns engine events into chat/completion bodies and
SSE chunks (choices, deltas, finish reasons, usage). A new response field touches only this file.
Choices are indexed prompt_i * n + j (n choices per prompt, as OpenAI numbers them).

With tools, or a model that thinks, a chat answer is told apart as it streams
(server/chat/answer.py): text goes out as `content` deltas at once, except what may start a call;
each call goes out as tool-call deltas when it is complete; reasoning as `reasoning_content`
deltas (and `message.reasoning_content` when not streamed)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.logprobs import TokenLogprob
from scheduler import FinishReason
from server.chat.answer import Answer, AnswerStream, Reasoning, Thinking, checked_pieces
from server.chat.tool_calls import Function, ToolCall
from server.http.sse import json_data, message
from server.service.generation import Usage

Kind = Literal["chat", "completion"]


def openai_finish(reason: FinishReason | None) -> str | None:
    if reason is FinishReason.TIMEOUT:   # a deadline ends a request like max_tokens does
        return FinishReason.LENGTH.value
    return reason.value if reason else None


def calls_finish(calls: list, reason: FinishReason | None) -> str | None:
    """finish_reason for an answer with tool calls parsed out of it: "tool_calls", unless the
    answer was cut off ("length": the limit ended it, maybe inside a further call)."""
    finish = openai_finish(reason)
    return "tool_calls" if calls and finish != FinishReason.LENGTH.value else finish


def usage(counts: Usage) -> dict:
    """A request's usage in OpenAI's shape (Generation.usage: every prompt counts once, every
    choice's completion tokens count)."""
    return {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens,
            "total_tokens": counts.total_tokens,
            "prompt_tokens_details": {"cached_tokens": counts.cached_tokens}}


class Choice(Protocol):
    """One choice's collected answer (server.service.generation.Collected)."""
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] | None


def sse(payload: dict | str) -> bytes:
    """One SSE message: a JSON payload, or a string as it is ("[DONE]")."""
    return message(payload if isinstance(payload, str) else json_data(payload))


@dataclass
class OpenAIFormat:
    """How one request's answer is shaped: its id, kind, model name and stream options."""
    kind: Kind
    model: str
    id: str
    created: int
    stream: bool = False
    include_usage: bool = False
    echo: list[str] = field(default_factory=list)   # completions: per prompt, its text to
    tools: bool = False                # chat with tools: calls are parsed out of the text
    n: int = 1                         # choices per prompt
    num_choices: int = 1               # n times the number of prompts
    continuous_usage: bool = False     # stream_options.continuous_usage_stats: usage per chunk
    thinking: Thinking | None = None   # chat: where a thinking model's answer starts
    functions: list[Function] = field(default_factory=list)   # a call breaking its schema: text
    usage_now: Callable[[], dict] | None = field(default=None, repr=False)   # set by the stream
    # streamed completions: per choice, the text offset its next token's logprobs start at
    _offsets: dict[int, int] = field(default_factory=dict, repr=False)
    _frames: dict[tuple[int, bool], tuple[bytes, bytes, bytes]] = field(default_factory=dict,
                                                                        repr=False)
    # streamed chat answers told apart (tools, thinking): per choice its stream and calls so far
    _answers: dict[int, AnswerStream] = field(default_factory=dict, repr=False)
    _calls: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def splits(self) -> bool:
        """Whether a chat answer is told apart into reasoning, text and calls."""
        return self.chat and (self.tools or self.thinking is not None)

    def echo_of(self, index: int) -> str:
        """The text put before choice `index` (completions echo: its prompt)."""
        return self.echo[index // self.n] if self.echo else ""

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
    def response(self, choices: list[Choice], usage: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [self._choice(c) for c in choices],
                "usage": usage}

    def _choice(self, c: Choice) -> dict:
        echo = self.echo_of(c.index)
        text = echo + c.text
        if not self.chat:
            choice = {"index": c.index, "text": text,
                      "finish_reason": openai_finish(c.finish_reason)}
        else:
            message, reason = self._message(text, c.finish_reason)
            choice = {"index": c.index, "message": message, "finish_reason": reason}
        choice["logprobs"] = self._logprobs(c.logprobs, len(echo), c.prompt_logprobs)
        return choice

    def _message(self, text: str, finish: FinishReason) -> tuple[dict, str | None]:
        if not self.splits:
            return {"role": "assistant", "content": text}, openai_finish(finish)
        stream, answer = AnswerStream(self.tools, self.thinking), Answer()
        answer.add(checked_pieces(stream.push(text) + stream.end(), self.functions))
        message = {"role": "assistant", "content": answer.text or None if answer.calls
                   else answer.text}
        if self.thinking is not None:
            message["reasoning_content"] = answer.reasoning or None
        if answer.calls:
            message["tool_calls"] = [c.openai() for c in answer.calls]
        return message, calls_finish(answer.calls, finish)

    def _logprobs(self, items: list[TokenLogprob] | None, offset: int = 0,
                  prompt: list[TokenLogprob] | None = None) -> dict | None:
        if not items and not prompt:
            return None
        return chat_logprobs(items) if self.chat else completion_logprobs(items, offset, prompt)

    # ---- a stream -----------------------------------------------------------------------------
    def opening_chunks(self) -> list[bytes]:
        """Chat: the assistant role for every choice."""
        if self.chat:
            return [self._chunk({"role": "assistant", "content": ""}, None, index=i)
                    for i in range(self.num_choices)]
        return []

    def echo_chunks(self, index: int, prompt_logprobs: list | None = None) -> list[bytes]:
        """Completions echo: the prompt (with its logprobs when asked), sent with the choice's
        first event, when the prompt's logprobs are known."""
        echo = self.echo_of(index)
        if not echo and not prompt_logprobs:
            return []
        lps = completion_logprobs([], 0, prompt_logprobs) if prompt_logprobs else None
        return [self._chunk(echo, None, lps, index)]

    def text_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None,
                   index: int = 0) -> bytes:
        """Completions' text_offset counts from the start of the choice's text (its echo
        included) across chunks, as in the whole response."""
        lps = None
        if logprobs and not self.chat:
            at = self._offsets.get(index, len(self.echo_of(index)))
            lps = completion_logprobs(logprobs, at)
            self._offsets[index] = at + sum(map(len, lps["tokens"]))
        elif logprobs:
            lps = chat_logprobs(logprobs)
        if lps is None:   # the common chunk: one per token
            head, mid, tail = self._text_frame(index)
            quoted = json_data(text).encode()
            if self.usage_now is None:
                return head + quoted + mid
            return head + quoted + mid + json.dumps(self.usage_now()).encode() + tail
        return self._chunk({"content": text} if self.chat else text, None, lps, index)

    def _text_frame(self, index: int) -> tuple[bytes, bytes, bytes]:
        """A plain text chunk of choice `index` as the bytes around its JSON-quoted text (and
        around its usage, with continuous usage): the message `_chunk` makes, without building
        and encoding a dict per token (the event loop sends one per token while llama.cpp
        computes)."""
        key = (index, self.usage_now is not None)
        frame = self._frames.get(key)
        if frame is None:
            text, usage_mark = "\ue000text\ue000", "\ue000usage\ue000"
            whole = sse(self._payload({"content": text} if self.chat else text, None, None, index,
                                      usage_mark if self.usage_now is not None else None))
            head, _, rest = whole.rpartition(json.dumps(text, ensure_ascii=False).encode())
            mid, _, tail = rest.partition(json.dumps(usage_mark, ensure_ascii=False).encode())
            frame = self._frames[key] = (head, mid, tail)
        return frame

    def finish_chunk(self, finish: FinishReason, index: int = 0) -> bytes:
        return self._chunk({} if self.chat else "", openai_finish(finish), index=index)

    def piece_chunks(self, text: str, index: int = 0,
                     logprobs: list[TokenLogprob] | None = None) -> list[bytes]:
        """A told-apart answer's new text (`splits`): what of it can go out now, as content,
        reasoning_content and tool-call deltas (the token logprobs with the first chunk)."""
        return self._pieces(self._answer(index).push(text), index, logprobs)

    def closing_chunks(self, text: str, finish: FinishReason, index: int = 0,
                       logprobs: list[TokenLogprob] | None = None) -> list[bytes]:
        """A choice's last text and its end: what a told-apart answer still held (the calls as
        deltas: per call one with its index, id and name, then one with its arguments), then
        the finish chunk."""
        if not self.splits:
            return [self.finish_chunk(finish, index)]
        stream = self._answer(index)
        chunks = self._pieces(stream.push(text) + stream.end(), index, logprobs)
        calls = self._calls.pop(index, 0)
        self._answers.pop(index, None)
        return chunks + [self._chunk({}, calls_finish(calls, finish), index=index)]

    def _answer(self, index: int) -> AnswerStream:
        stream = self._answers.get(index)
        if stream is None:
            stream = self._answers[index] = AnswerStream(self.tools, self.thinking)
        return stream

    def _pieces(self, pieces: list, index: int, logprobs: list[TokenLogprob] | None) -> list[bytes]:
        chunks = []
        lps = chat_logprobs(logprobs) if logprobs else None
        for piece in checked_pieces(pieces, self.functions):
            if isinstance(piece, ToolCall):
                i = self._calls.get(index, 0)
                self._calls[index] = i + 1
                head = piece.openai(i)
                head["function"] = {"name": piece.name, "arguments": ""}
                chunks.append(self._chunk({"tool_calls": [head]}, None, index=index))
                chunks.append(self._chunk({"tool_calls": [
                    {"index": i, "function": {"arguments": piece.arguments}}]}, None, index=index))
            elif isinstance(piece, Reasoning):
                chunks.append(self._chunk({"reasoning_content": str(piece)}, None, lps, index))
                lps = None
            else:
                chunks.append(self._chunk({"content": piece}, None, lps, index))
                lps = None
        if lps is not None:   # this token's text is held back: its logprobs go out now
            chunks.append(self._chunk({"content": ""}, None, lps, index))
        return chunks

    def usage_chunk(self, usage: dict) -> bytes:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model, "choices": [], "usage": usage})

    def _chunk(self, delta: dict | str, finish: str | None, logprobs: dict | None = None,
               index: int = 0) -> bytes:
        usage = self.usage_now() if self.usage_now is not None else None
        return sse(self._payload(delta, finish, logprobs, index, usage))

    def _payload(self, delta: dict | str, finish: str | None, logprobs: dict | None, index: int,
                 usage) -> dict:
        choice = ({"index": index, "delta": delta} if self.chat
                  else {"index": index, "text": delta})
        choice.update(logprobs=logprobs, finish_reason=finish)
        payload = {"id": self.id, "object": self.chunk_object, "created": self.created,
                   "model": self.model, "choices": [choice]}
        if self.usage_now is not None or self.include_usage:   # null until the last chunk,
            payload["usage"] = usage                           # or the usage so far
        return payload


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    """OpenAI chat shape: per token its text, logprob, bytes and the top alternatives."""
    def entry(piece: bytes, logprob: float) -> dict:
        return {"token": _text(piece), "logprob": logprob, "bytes": list(piece)}
    return {"content": [{**entry(t.piece, t.logprob),
                         "top_logprobs": [entry(p, lp) for _, p, lp in t.top]} for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenLogprob], offset: int = 0,
                        prompt: list[TokenLogprob] | None = None) -> dict:
    """OpenAI (legacy) completions shape: parallel lists and text offsets. With echo, the
    prompt's tokens come first, from offset 0 (its first token's logprob is None: null)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt:
        _add_logprobs(out, prompt, 0)
    _add_logprobs(out, items, offset)
    return out


def _add_logprobs(out: dict, items: list[TokenLogprob], at: int) -> None:
    for t in items:
        text = _text(t.piece)
        out["text_offset"].append(at)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        # the first prompt token has nothing before it to predict it: null, as OpenAI and vLLM;
        # otherwise the k most likely and, as OpenAI's legacy API, the chosen one (k + 1 at most)
        if t.logprob is None:
            out["top_logprobs"].append(None)
        else:
            top = {_text(p): lp for _, p, lp in t.top}
            top.setdefault(text, t.logprob)
            out["top_logprobs"].append(top)
        at += len(text)
