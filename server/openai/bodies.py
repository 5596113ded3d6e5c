"""Request bodies (OpenAI-compatible plus the extensions vLLM and llama-server accept).

Numbers and booleans are strict: `"max_tokens": true`, `"max_tokens": "16"`, `"priority": false`
and non-finite floats (`1e400`, `NaN`) are 400s, not coerced. Every string anywhere in a body
must be valid Unicode: a lone surrogate (`"\\ud800"`, which JSON allows) cannot be encoded to
UTF-8 for the tokenizer or echoed back, so it is a 400 naming where it was found. Every request
body (here, and in server/openai/responses_body.py, server/api/embeddings.py,
server/api/models.py) derives from `Body`, which makes that check.

Unknown fields are kept at run time (`extra="allow"`, model_extra) so that the route refuses
them by name (server/openai/fields.py), while each body's OpenAPI schema states what is
accepted: `additionalProperties: false`, the extra fields a route accepts declared with their
types (`Body.EXTRAS`: labels and hints, and SGLang's fields at their defaults), `n`, `stream`
and `echo` nullable (null is the default), and the fields a route refuses whatever their value
left out (`Body.SCHEMA`).
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.durations import parse_keep_alive
from server.http.errors import APIError
from server.openai.fields import LABELS, NEUTRAL
from server.sampling import INT32_MAX, TUNABLE, Float, Int, tunable_fields
from server.service.request import Blame, GenerationRequest, Sampling

INT64_MAX = 2**63 - 1
JSON_INT_MAX = 2**53 - 1   # the largest integer that every JSON reader holds exactly (a double)

Bool = Annotated[bool, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]



def _keep_alive(value: Any) -> float | None:
    return None if value is None else parse_keep_alive(value, "keep_alive")


# Ollama's keep_alive, accepted as an extension: how long the model stays loaded once idle
# (seconds, or "10m", "1h"; negative: until unloaded by hand; 0: unloaded when idle)
KeepAlive = Annotated[float | None, BeforeValidator(_keep_alive,
                                                    json_schema_input_type=float | str | None)]

# at most 16 strings (checked where the field is, with its own message; the schema says it too)
StopList = Annotated[list[str], WithJsonSchema({"type": "array", "items": {"type": "string"},
                                                "maxItems": 16})]

# token id (as a string) -> bias in [-100, 100] (checked against the model's vocabulary where
# the request is made: service.py)
LogitBias = Annotated[dict[str, Float], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})]

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where (a dotted path) the first string holding a lone surrogate is, or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key_path = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return key_path
        found = find_lone_surrogate(item, key_path)
        if found is not None:
            return found
    return None


def nullable(types: dict[str, Any], description: str) -> dict[str, dict]:
    """JSON schemas of extra fields accepted with these types, or null (= absent)."""
    return {name: {**TypeAdapter(kind | None).json_schema(), "description": description}
            for name, kind in types.items()}


def only(values: dict[str, tuple], description: str) -> dict[str, dict]:
    """JSON schemas of extra fields accepted with these values only, or null (= absent)."""
    return {name: {"enum": list(dict.fromkeys((*accepted, None))), "description": description}
            for name, accepted in values.items()}


def or_null(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A JSON schema, or null (= absent)."""
    return {"anyOf": [schema, {"type": "null"}], "description": description}


def _closed_schema(schema: dict[str, Any], cls: type[Body]) -> None:
    """The body's OpenAPI schema: what is accepted (see the module's docstring)."""
    schema["additionalProperties"] = False
    props = schema.setdefault("properties", {})
    for name in cls.NULL_IS_DEFAULT:
        if name in props:
            props[name] = _or_null(props[name])
    for name, sub in cls.EXTRAS.items():
        props.setdefault(name, sub)
    for name, sub in cls.SCHEMA.items():
        if sub is None:
            props.pop(name, None)
        else:
            props[name] = sub


def _or_null(prop: dict[str, Any]) -> dict[str, Any]:
    outer = {k: prop[k] for k in ("title", "description", "default") if k in prop}
    inner = {k: v for k, v in prop.items() if k not in outer}
    said = outer.get("description")
    return {"anyOf": [inner, {"type": "null"}], **outer,
            "description": f"{said}; null: the default" if said else "null: the default"}


class Body(BaseModel):
    """A request body: no lone surrogate anywhere in it (known fields or not), and an OpenAPI
    schema that says what is accepted."""
    model_config = ConfigDict(json_schema_extra=_closed_schema)

    # extra fields the route accepts (kept in model_extra), as JSON schemas: declared only
    EXTRAS: ClassVar[dict[str, dict]] = {
        **nullable(LABELS, "a label: accepted and ignored"),
        **only(NEUTRAL, "SGLang's (sglang-router forwards it): accepted at its default only")}
    # fields whose null is their default (OpenAI's spec lets `n`, `stream`, `echo` be null)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()
    # properties of the schema replaced (a schema: what this route accepts of a field its base
    # declares) or left out (None: refused whatever the value, but null)
    SCHEMA: ClassVar[dict[str, dict | None]] = {}

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode", "{where}: contains a lone UTF-16 surrogate (not valid "
                "Unicode text)", {"where": where})
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A null in NULL_IS_DEFAULT is the same as leaving the field out."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items()
                    if not (k in cls.NULL_IS_DEFAULT and v is None)}
        return data


# The sampling values a request may tune, as fields of a body (server/sampling.py: TUNABLE):
# temperature, top_k, top_p, min_p and the penalties, each optional within its range.
TunableBody: type[Body] = create_model("TunableBody", __base__=Body, **tunable_fields())


class SamplingFields(TunableBody):
    # Unknown fields are kept (model_extra) so that server/openai/fields.py can refuse them by name.
    model_config = ConfigDict(extra="allow")
    NULL_IS_DEFAULT = ("n", "stream", "echo")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    seed: Int | None = Field(None, description="any integer; -1: random (llama-server's)")
    stop: str | StopList | None = None
    ignore_eos: Bool = False
    n: Int = Field(1, ge=1, le=INT32_MAX)   # above PAGEDLLAMA_MAX_N: a 400 in the routes
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int = Field(0, ge=-JSON_INT_MAX, le=JSON_INT_MAX)
    timeout: Float | None = Field(None, gt=0.0, description="seconds before the request is ended")
    keep_alive: KeepAlive = Field(None, description="seconds (or \"5m\", \"1h\") the model "
                                  "stays loaded once idle; negative: until unloaded")
    # structured output (server/openai/structured.py): OpenAI's, and llama-server's two fields
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    logit_bias: LogitBias | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys of ASCII digits ("²" is a digit to str.isdigit, not to int())."""
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key[:40]!r} is not a token id")
        return value

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

    def sampling(self) -> Sampling:
        """The sampling values the service takes (a 400 for logprobs asked for wrongly)."""
        try:
            k = self.logprobs_k()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", "top_logprobs") from exc
        return Sampling(
            **{name: getattr(self, name) for name in TUNABLE}, seed=self.seed,
            stop=tuple(self.stop_list()), ignore_eos=self.ignore_eos, logit_bias=self.logit_bias,
            logprobs=k, prompt_logprobs=bool(getattr(self, "echo", False)) and k is not None)

    def generation(self, prompts: list[list[int]], max_tokens: int | None,
                   grammar: str | None = None, *, affinity: str | None = None,
                   prompt_field: str = "prompt",
                   ignored_tools: tuple[str, ...] = ()) -> GenerationRequest:
        """This body as the service's request: `prompt_field` is what a prompt error names."""
        return GenerationRequest(prompts, self.sampling(), max_tokens, self.n, self.priority,
                                 self.timeout, grammar, affinity, Blame(prompt=prompt_field),
                                 ignored_tools)


def _stream_options_schema(schema: dict[str, Any]) -> None:
    schema["additionalProperties"] = False
    schema["properties"]["include_obfuscation"] = {
        "enum": [False, None], "description": "OpenAI's; false only: deltas are never padded"}


class StreamOptions(BaseModel):
    # unknown options are kept so that server/openai/fields.py can refuse them by name; the
    # schema says what is accepted
    model_config = ConfigDict(extra="allow", json_schema_extra=_stream_options_schema)

    include_usage: Bool = False
    continuous_usage_stats: Bool = False   # vLLM's and SGLang's: usage in every chunk


class UnsupportedContent(ValueError):
    """A content part other than text (image_url, input_audio, file, …)."""


class FunctionCall(BaseModel):
    """An assistant's call of a function, as OpenAI sends it back in the history."""
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(strict=True, min_length=1)]
    arguments: Annotated[str, Field(strict=True)]   # JSON text

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be JSON text ({exc.msg})") from None
        return value


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: Annotated[str, Field(strict=True)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a chat history. Every nested shape is checked here, so a malformed one is
    a 400 naming its field (`messages.0.tool_calls.0.function.name`), never an error later."""
    # other keys are passed on to the chat template; the schema says what _fields_of_its_role
    # checks
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"properties": {"tool_call_id": {"type": "string"}},
                  "required": ["tool_call_id"]}},
        {"if": {"properties": {"tool_calls": {"type": "array"}}, "required": ["tool_calls"]},
         "then": {"properties": {"role": {"const": "assistant"}}}}]})

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: Annotated[str, Field(strict=True)] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: Annotated[str, Field(strict=True)] | None = None

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("field_missing", "a tool message needs 'tool_call_id'",
                                      {"field": "tool_call_id"})
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("field_not_allowed", "only assistant messages have "
                                      "'tool_calls'", {"field": "tool_calls"})
        return self

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
    max_completion_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None          # server/openai/tool_fields.py checks each one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    # vLLM's assistant prefill: continue the last (assistant) message instead of a new turn
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False


    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Int | None = Field(None, ge=0, le=INT32_MAX)   # 0: score the prompt (echo)
    echo: Bool = False
    logprobs: Int | None = Field(None, ge=0, le=5)

    def logprobs_k(self) -> int | None:
        return self.logprobs


class GenerateRequest(SamplingFields):
    """The native /generate_stream body: a prompt and the same sampling fields."""
    SCHEMA = {"n": {"enum": [1, None], "description": "one answer per request"},
              "stream": {"enum": [True, None], "description": "this route always streams"},
              "stream_options": None}   # the done event carries the counts
    prompt: str = Field(..., min_length=1)
    max_tokens: Int | None = Field(256, ge=1, le=INT32_MAX)
    raw: Bool = Field(False, description="send the prompt as is, without the chat template")


SamplingFields.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
GenerateRequest.model_rebuild()
