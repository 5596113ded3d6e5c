"""A generated answer, as it streams, told apart into what each API shapes differently: a
thinking model's reasoning, the text, and tool calls.

A model thinks when its chat template writes `<think>…</think>` (Qwen3, the DeepSeek-R1
distills; engine/chat.py `ChatTemplate.thinks`). Its answer then starts with the reasoning:
either the prompt already opened the block (the template ends the generation prompt with
`<think>`: `Thinking.OPEN`), or the model may open it itself as its first words
(`Thinking.MAYBE`). The reasoning ends at `</think>`; the whitespace around it is dropped.
What follows is the answer, where tool calls are parsed out when tools are offered
(server/chat/tool_calls.py `CallSplitter`).

`AnswerStream.push` gives, for each piece of generated text, what can go out now: pieces of
reasoning (`Reasoning`), pieces of text (`str`) and whole calls (`ToolCall`), holding back only
what may be the start of a tag. `split_answer` does the same for a whole answer, so a streamed
answer and the same answer collected are the same reasoning, text and calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.grammar import GrammarError, after_thinking
from server.chat.tool_calls import (
    CallSplitter,
    Function,
    ToolCall,
    as_written,
    breaks_schema,
    ready,
)
from server.errors import APIError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Thinking(Enum):
    """Where a thinking model's answer starts."""
    OPEN = "open"       # inside a reasoning block the prompt opened
    MAYBE = "maybe"     # the model may open one as its first words


class Reasoning(str):
    """A piece of reasoning (a str, told apart from answer text by its type)."""


Piece = Reasoning | str | ToolCall


def thinking_mode(thinks: bool, prompt_opens: bool) -> Thinking | None:
    """How an answer starts: None for a model that does not think."""
    if not thinks:
        return None
    return Thinking.OPEN if prompt_opens else Thinking.MAYBE


def constrain_after_thinking(grammar: str | None, thinking: Thinking | None) -> str | None:
    """A thinking model's grammar (structured output, a forced call) applies once its reasoning
    has ended."""
    if grammar is None or thinking is None:
        return grammar
    try:
        return after_thinking(grammar, thinking is Thinking.OPEN)
    except GrammarError as exc:
        raise APIError(400, f"the constraint cannot follow the model's reasoning: {exc}",
                       "invalid_schema") from exc


class ReasoningSplitter:
    """Generated text split into reasoning (Reasoning) and answer (str) pieces."""

    def __init__(self, mode: Thinking):
        self.state = "thinking" if mode is Thinking.OPEN else "start"
        self.held = ""
        self.trim = mode is Thinking.OPEN    # drop the whitespace that starts the next part

    def push(self, text: str) -> list[Piece]:
        self.held += text
        out: list[Piece] = []
        while True:
            if self.state == "start":
                lead = self.held.lstrip()
                if lead.startswith(THINK_OPEN):
                    self.held, self.state, self.trim = lead[len(THINK_OPEN):], "thinking", True
                    continue
                if THINK_OPEN.startswith(lead):    # may still become the tag
                    return out
                self.state = "answer"
                continue
            if self.trim:
                self.held = self.held.lstrip()
                if not self.held:
                    return out
                self.trim = False
            if self.state == "answer":
                if self.held:
                    out.append(self.held)
                self.held = ""
                return out
            end = self.held.find(THINK_CLOSE)
            if end >= 0:
                self._reason(out, self.held[:end].rstrip())
                self.held = self.held[end + len(THINK_CLOSE):]
                self.state, self.trim = "answer", True
                continue
            part, self.held = ready(self.held, THINK_CLOSE)
            self._reason(out, part)
            return out

    def end(self) -> list[Piece]:
        held, self.held = self.held, ""
        if self.state == "start":
            return [held] if held else []
        if self.state == "thinking":
            held = held.rstrip()
            return [Reasoning(held)] if held else []
        return []

    @staticmethod
    def _reason(out: list, text: str) -> None:
        if text:
            out.append(Reasoning(text))


class AnswerStream:
    """One answer's pieces as its text streams: reasoning (when the model thinks), then text and,
    when tools are offered, calls."""

    def __init__(self, tools: bool = False, thinking: Thinking | None = None,
                 first_call_only: bool = False):
        self.reasoning = ReasoningSplitter(thinking) if thinking else None
        self.calls = CallSplitter(first_call_only) if tools else None

    @property
    def passthrough(self) -> bool:
        """Nothing to tell apart: every piece is text as it came."""
        return self.reasoning is None and self.calls is None

    def push(self, text: str) -> list[Piece]:
        pieces = self.reasoning.push(text) if self.reasoning else [text]
        return self._calls(pieces)

    def end(self) -> list[Piece]:
        pieces = self.reasoning.end() if self.reasoning else []
        out = self._calls(pieces)
        return out + (self.calls.end() if self.calls else [])

    def _calls(self, pieces: list[Piece]) -> list[Piece]:
        if self.calls is None:
            return [p for p in pieces if p]
        out: list[Piece] = []
        for p in pieces:
            out += [p] if isinstance(p, Reasoning) else self.calls.push(p)
        return out


@dataclass
class Answer:
    """A whole answer told apart."""
    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if isinstance(p, ToolCall):
                self.calls.append(p)
            elif isinstance(p, Reasoning):
                self.reasoning += p
            else:
                self.text += p


def split_answer(text: str, tools: bool = False, thinking: Thinking | None = None,
                 first_call_only: bool = False) -> Answer:
    stream = AnswerStream(tools, thinking, first_call_only)
    answer = Answer()
    answer.add(stream.push(text))
    answer.add(stream.end())
    return answer


def checked_pieces(pieces: list[Piece], functions: list[Function]) -> list[Piece]:
    """The pieces with each call to a strict function whose arguments break its schema turned
    back into the text the model wrote, as a call whose JSON does not parse stays text (every
    API reports such a call the same way; a call to a function that is not strict stays a
    call, `breaks_schema`)."""
    return [as_written(p) if isinstance(p, ToolCall) and breaks_schema(p, functions) else p
            for p in pieces]
