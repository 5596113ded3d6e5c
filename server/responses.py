"""POST /v1/responses: OpenAI's Responses API, stateless.

`input` (a string, or a list of message items) and `instructions` become chat messages and go
through the model's chat template; generation is the same service path as chat completions
(service.submit / service.events). Streamed, the typed events follow OpenAI's order:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta…, response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens ended it). Nothing is stored: `store: true`,
`previous_response_id`, `background`, tools and non-text `text.format` are 400s.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from pydantic import ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from engine import Request, Worker
from scheduler import FinishReason
from server.errors import APIError, error_body
from server.openapi import ERROR_RESPONSES, RESPONSES_STREAMED
from server.schemas import INT32_MAX, Bool, Int, SamplingFields
from server.service import Service, error_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
_TEXT_PARTS = {"input_text", "output_text", "text"}
_CHAT_ONLY = ("response_format", "json_schema", "grammar")
# Accepted and ignored: they label or route a request, or only matter with tools (refused).
_HARMLESS = frozenset({"user", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention", "truncation", "parallel_tool_calls",
                       "tool_choice", "reasoning", "include"})


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
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


def reject_unsupported(body: ResponsesRequest) -> None:
    def unsupported(param: str, why: str) -> APIError:
        return APIError(400, f"'{param}' is not supported: {why}", "unsupported_parameter", param)

    for name, value in (body.model_extra or {}).items():
        if value not in (None, [], {}) and name not in _HARMLESS:
            raise unsupported(name, "this server does not implement it, and ignoring it could "
                              "change the answer")
    for name in _CHAT_ONLY:   # SamplingFields' chat-only fields (structured output, part 1)
        if getattr(body, name, None) is not None:
            raise unsupported(name, "structured output is not available on /v1/responses yet")
    if body.n != 1:
        raise unsupported("n", "one output per response")
    if body.store:
        raise unsupported("store", "this server is stateless and keeps no responses")
    if body.previous_response_id:
        raise unsupported("previous_response_id", "this server is stateless; send the history "
                          "in 'input'")
    if body.background:
        raise unsupported("background", "responses are computed while the request is open")
    if body.tools:
        raise unsupported("tools", "tool calls are not available on /v1/responses yet")
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise unsupported("text.format", "only plain text output is available on /v1/responses")


def _item_text(item: dict, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts",
                       "invalid_value", f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "unsupported_parameter",
                           f"input[{i}].content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def to_messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages from `instructions` and `input` (developer messages become system ones)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if item.get("type", "message") != "message":
            raise APIError(400, f"input items of type '{item.get('type')}' are not supported",
                           "unsupported_parameter", f"input[{i}]")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"input[{i}].role must be user, assistant, system or developer",
                           "invalid_value", f"input[{i}].role")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _item_text(item, i)})
    if not messages:
        raise APIError(400, "input has no messages", "invalid_value", "input")
    return messages


@dataclass
class ResponseState:
    """One response being built: what every event and the final object carry."""
    body: ResponsesRequest
    model: str
    req: Request
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    item_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    finish: FinishReason | None = None
    seq: int = 0

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def item(self, done: bool) -> dict:
        return {"type": "message", "id": self.item_id, "role": "assistant",
                "status": "completed" if done else "in_progress",
                "content": [self.part()] if done else []}

    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "completed" if self.finish is FinishReason.STOP else "incomplete"

    def usage(self) -> dict:
        n_in, n_out = len(self.req.prompt), self.req.num_output
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": self.req.num_cached},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + n_out}

    def response(self) -> dict:
        b, status = self.body, self.status()
        done = self.finish is not None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.model, "output": [self.item(True)] if done else [],
                "parallel_tool_calls": False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
                "truncation": "disabled", "usage": self.usage() if done else None,
                "user": None, "metadata": b.metadata or {}}

    def event(self, kind: str, **payload) -> dict:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return {"event": kind, "data": json.dumps(data, ensure_ascii=False)}


@router.post("/responses", responses=RESPONSES_STREAMED)
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    reject_unsupported(body)
    svc: Service = http.app.state.service
    lm = svc.get(body.model)
    max_tokens = body.max_output_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, to_messages(body), max_tokens, http)
    worker, req = svc.submit(lm, prompt, body, max_tokens)
    state = ResponseState(body, lm.name, req)
    if body.stream:
        return EventSourceResponse(_stream(svc, worker, state, http), ping=15, sep="\n")
    async for event in svc.events(worker, req, http, poll_disconnect=True):
        if event.error:   # 500 engine_error, or 503 when a drain ended it
            status, code = error_status(event)
            raise APIError(status, event.error, code)
        state.text += event.text
        state.finish = event.finish_reason or state.finish
    if state.finish is None:   # the client went away
        raise APIError(499, "client disconnected", "client_disconnected")
    return state.response()


async def _stream(svc: Service, worker: Worker, s: ResponseState,
                  http: HTTPRequest) -> AsyncIterator[dict]:
    where = {"item_id": s.item_id, "output_index": 0, "content_index": 0}
    yield s.event("response.created", response=s.response())
    yield s.event("response.in_progress", response=s.response())
    yield s.event("response.output_item.added", output_index=0, item=s.item(False))
    yield s.event("response.content_part.added", **where,
                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    async for event in svc.events(worker, s.req, http):
        if event.error:   # the final event: an engine error, or a drain ended the response
            status, code = error_status(event)
            yield {"event": "error", "data": json.dumps(
                {**error_body(status, event.error, code)["error"], "type": "error",
                 "sequence_number": s.seq})}
            return
        if event.text:
            s.text += event.text
            yield s.event("response.output_text.delta", **where, delta=event.text, logprobs=[])
        s.finish = event.finish_reason or s.finish
    yield s.event("response.output_text.done", **where, text=s.text, logprobs=[])
    yield s.event("response.content_part.done", **where, part=s.part())
    yield s.event("response.output_item.done", output_index=0, item=s.item(True))
    final = "response.completed" if s.status() == "completed" else "response.incomplete"
    yield s.event(final, response=s.response())
