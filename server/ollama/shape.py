"""Ollama's answer shapes: model names as its clients write them (`name:tag`), the model
descriptions of /api/tags, /api/show and /api/ps, chat messages in and out, and the objects of
an answer (one per NDJSON line when streamed), the last with `done: true`, the reason and the
statistics in nanoseconds."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from server.chat.answer import Reasoning
from server.chat.tool_calls import ToolCall
from server.errors import APIError
from server.ollama.bodies import OllamaMessage
from server.service.generation import Usage

LATEST = ":latest"
# The Ollama release whose API these routes follow (GET /api/version): clients gate features
# (tools, thinking, structured output) on it.
API_VERSION = "0.12.0"
NS = 1_000_000_000
FOREVER = datetime(2318, 1, 1, tzinfo=UTC)   # a model that never unloads expires "never"


def timestamp(when: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at`."""
    moment = datetime.fromtimestamp(time.time() if when is None else when, UTC)
    return moment.isoformat().replace("+00:00", "Z")


# ---- model names -------------------------------------------------------------------------------
def listed_name(name: str) -> str:
    """A catalogued model's name as Ollama lists it: with a tag (`:latest` unless it has one)."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + LATEST


def resolve(name: str, catalogued: list[str]) -> str:
    """The catalogued model an Ollama client means: the name itself, the name without
    `:latest`, or either case-insensitively; else a 404 in Ollama's words."""
    wanted = [name, name.removesuffix(LATEST)] if name.endswith(LATEST) else [name]
    for candidate in wanted:
        if candidate in catalogued:
            return candidate
    folded = {n.lower(): n for n in catalogued}
    for candidate in wanted:
        if candidate.lower() in folded:
            return folded[candidate.lower()]
    listed = ", ".join(listed_name(n) for n in catalogued)
    raise APIError(404, f'model "{name}" not found (this server does not pull models; the '
                   f"models here: {listed})", "model_not_found", "model")


def digest(name: str, size: int, mtime: float) -> str:
    """A stable identifier of a model file (not the file's own hash, which would mean reading
    it whole): sha256 of its name, size and modification time."""
    return hashlib.sha256(f"{name}\0{size}\0{mtime}".encode()).hexdigest()


def parameter_size(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


def details(facts: dict) -> dict:
    """Ollama's `details` of a model, from its GGUF header's facts."""
    arch = facts.get("architecture") or "unknown"
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": parameter_size(facts.get("parameters") or 0),
            "quantization_level": facts.get("quantization") or ""}


@dataclass
class ModelFacts:
    """What the model routes say of one catalogued model (read from its entry by the route)."""
    name: str
    size: int
    mtime: float
    facts: dict

    def listed(self) -> dict:
        """One model of /api/tags."""
        return {"name": listed_name(self.name), "model": listed_name(self.name),
                "modified_at": timestamp(self.mtime), "size": self.size,
                "digest": digest(self.name, self.size, self.mtime),
                "details": details(self.facts)}

    def running(self, memory: int, expires: float | None, context: int) -> dict:
        """One model of /api/ps: its memory, when it unloads (None: never) and its context."""
        until = FOREVER if expires is None else datetime.fromtimestamp(expires, UTC)
        return {**self.listed(), "size": memory, "size_vram": 0,
                "expires_at": until.isoformat().replace("+00:00", "Z"),
                "context_length": context}


def model_info(metadata: dict, verbose: bool) -> dict:
    """A GGUF header's metadata as /api/show's `model_info`: the long token lists are null
    unless `verbose` (as Ollama shows them); the chat template is the answer's `template`."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, (list, tuple)) and len(value) > 64 and not verbose:
            value = None
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def parameters_text(defaults: dict, stops: list[str]) -> str:
    """/api/show's `parameters`, as a Modelfile writes them: the model's defaults (a models
    file's), under Ollama's option names."""
    names = {"repetition_penalty": "repeat_penalty"}
    lines = [f"{names.get(k, k)} {v}" for k, v in defaults.items()]
    lines += [f"stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines)


# ---- messages in -------------------------------------------------------------------------------
def to_chat(messages: list[OllamaMessage]) -> list[dict]:
    """Ollama's messages as chat messages (OpenAI's shape, which server/chat/ and the templates
    read): an assistant's `tool_calls` with their arguments as JSON text and ids, its
    `thinking` as `reasoning_content`, a tool's result with the call it answers."""
    out: list[dict] = []
    call_ids: dict[str, list[str]] = {}   # function name -> ids of calls not yet answered
    for i, m in enumerate(messages):
        chat: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            raise APIError(400, f"messages[{i}].images: no model served here reads images",
                           "unsupported_parameter", f"messages[{i}].images")
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                args = call.function.arguments
                call_id = call.id or f"call_{i}_{j}"
                call_ids.setdefault(call.function.name, []).append(call_id)
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
            chat["tool_calls"] = calls
        if m.role == "assistant" and m.thinking:
            chat["reasoning_content"] = m.thinking
        if m.role == "tool":
            name = m.tool_name
            pending = call_ids.get(name or "", [])
            call_id = m.tool_call_id or (pending.pop(0) if pending else None)
            if call_id:
                chat["tool_call_id"] = call_id
            if name:
                chat["name"] = name
        out.append(chat)
    return out


# ---- answers -----------------------------------------------------------------------------------
def tool_call(call: ToolCall, index: int) -> dict:
    """A call as Ollama returns it: arguments as an object."""
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        args = call.arguments
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": args}}


def done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


@dataclass
class Timing:
    """A request's clock: when the route started, how long its model took to load."""
    start: float = field(default_factory=time.monotonic)
    load_s: float = 0.0


def statistics(timing: Timing, usage: Usage, ttft_s: float | None,
               total_s: float | None) -> dict:
    """The last object's statistics, in nanoseconds. `prompt_eval_count`: the prompt tokens
    computed (those taken from the prefix cache are not, as Ollama counts)."""
    first = ttft_s or 0.0
    return {"total_duration": int((time.monotonic() - timing.start) * NS),
            "load_duration": int(timing.load_s * NS),
            "prompt_eval_count": usage.prompt_tokens - usage.cached_tokens,
            "prompt_eval_duration": int(first * NS),
            "eval_count": usage.completion_tokens,
            "eval_duration": int(max(0.0, (total_s or first) - first) * NS)}


class AnswerShape:
    """The objects of one answer: /api/chat's (`message`) or /api/generate's (`response`)."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.calls = 0

    def _object(self, **fields) -> dict:
        return {"model": self.model, "created_at": timestamp(), **fields}

    def pieces(self, pieces: list, done: bool = False) -> dict | None:
        """An object with these pieces of the answer (text, reasoning, calls), or None when
        they hold nothing."""
        text = "".join(p for p in pieces if isinstance(p, str) and not isinstance(p, Reasoning))
        thinking = "".join(p for p in pieces if isinstance(p, Reasoning))
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        if not (text or thinking or calls or done):
            return None
        if not self.chat:
            out = self._object(response=text, done=done)
            if thinking:
                out["thinking"] = thinking
            return out
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [tool_call(c, self.calls + k) for k, c in enumerate(calls)]
            self.calls += len(calls)
        return self._object(message=message, done=done)

    def last(self, pieces: list, finish: str | None, stats: dict) -> dict:
        out = self.pieces(pieces, done=True)
        assert out is not None
        return {**out, "done_reason": done_reason(finish), **stats}

    def lifecycle(self, reason: str) -> dict:
        """The answer to a request with nothing to generate: the model loaded or unloaded."""
        if self.chat:
            return self._object(message={"role": "assistant", "content": ""}, done=True,
                                done_reason=reason)
        return self._object(response="", done=True, done_reason=reason)


def expires_at(keep_alive: float, idle_since: float | None) -> float | None:
    """When an idle model unloads (wall-clock seconds), None for never: `idle_since` is the
    monotonic time it was last used (None: in use now, the clock starts when it is released)."""
    if keep_alive < 0:
        return None
    since = time.time() if idle_since is None else time.time() - (time.monotonic() - idle_since)
    return since + keep_alive
