"""Ollama's request bodies, checked strictly: a wrong type, an unknown field or a value not
served is a 400 in Ollama's shape (`{"error": "..."}`), naming the field. `stream` absent means
streamed, as in Ollama."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from server.ollama.options import Bool, OllamaOptions
from server.openai.bodies import Body, KeepAlive
from server.sampling import Int


class OllamaBody(Body):
    model_config = ConfigDict(extra="forbid")
    EXTRAS: ClassVar[dict[str, dict]] = {}


class OllamaFunction(OllamaBody):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: Int | None = None
    description: str | None = None


class OllamaToolCall(OllamaBody):
    function: OllamaFunction
    id: str | None = None
    type: Literal["function"] | None = None
    index: Int | None = None          # where Open WebUI writes it


class OllamaMessage(OllamaBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


Format = Literal["", "json"] | dict[str, Any] | None
Think = Bool | Literal["high", "medium", "low"] | None


class Generating(OllamaBody):
    """What /api/chat and /api/generate share."""
    model: str
    format: Format = None
    options: OllamaOptions | None = None
    stream: Bool | None = None       # absent: streamed
    keep_alive: KeepAlive = None
    think: Think = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    truncate: Bool | None = None
    shift: Bool | None = None
    # Open WebUI's: labels (accepted and ignored), and the token limit it writes here when a
    # chat asks for max_tokens (options.num_predict wins)
    metadata: dict[str, Any] | None = None
    num_predict: Int | None = Field(None, ge=-2)

    @property
    def streamed(self) -> bool:
        return self.stream is not False


class OllamaChatRequest(Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(Generating):
    prompt: str | None = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Int] | None = None
    raw: Bool | None = None
    images: list[str] | None = None


class OllamaEmbedRequest(OllamaBody):
    model: str
    input: str | list[str]
    truncate: Bool | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None
    dimensions: Int | None = Field(None, ge=1)


class OllamaEmbeddingsRequest(OllamaBody):
    """The older /api/embeddings: one `prompt`, one `embedding`. `input` is accepted and, as
    Ollama does on this route, not read (Open WebUI sends both, `prompt` its inputs joined)."""
    model: str
    prompt: str
    input: str | list[str] | None = None
    truncate: Bool | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class OllamaShowRequest(OllamaBody):
    model: str | None = None
    name: str | None = None       # the older clients' field
    verbose: Bool | None = None
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None


class OllamaCopyRequest(OllamaBody):
    source: str
    destination: str


class OllamaNameRequest(OllamaBody):
    """The bodies of /api/pull, /api/push, /api/create, /api/delete: only their model's name
    matters to the answer (models are not added or removed through this API here)."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
