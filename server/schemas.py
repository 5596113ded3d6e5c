"""Request bodies (OpenAI-compatible plus the extensions vLLM and llama-server accept)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingFields(BaseModel):
    # Unknown fields are kept (model_extra) so that server/fields.py can refuse them by name.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    timeout: float | None = Field(None, gt=0.0, description="seconds before the request is ended")
    # structured output (server/structured.py): OpenAI's, and llama-server's two fields
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    logit_bias: dict[str, float] | None = None    # token id (as a string) -> bias in [-100, 100]

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        return value

    def logprobs_k(self) -> int | None:
        """How many alternatives to report with each token's logprob (None: no logprobs)."""
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class StreamOptions(BaseModel):
    include_usage: bool = False


class UnsupportedContent(ValueError):
    """A content part other than text (image_url, input_audio, file, …)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedContent(str(part.get("type")))
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a 'text' string")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None          # server/tools.py checks each one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's assistant prefill: continue the last (assistant) message instead of a new turn
    add_generation_prompt: bool = True
    continue_final_message: bool = False


    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)    # 0: score the prompt only (with echo)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    def logprobs_k(self) -> int | None:
        return self.logprobs


class GenerateRequest(SamplingFields):
    """The native /generate_stream body: a prompt and the same sampling fields."""
    prompt: str = Field(..., min_length=1)
    max_tokens: int | None = Field(256, ge=1)
    raw: bool = Field(False, description="send the prompt as is, without the chat template")


SamplingFields.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
GenerateRequest.model_rebuild()
