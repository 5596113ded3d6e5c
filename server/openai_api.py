"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from sse_starlette.sse import EventSourceResponse

from engine import Request, Worker
from scheduler import FinishReason
from server.errors import APIError, error_body
from server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.service import LoadedModel, Service

router = APIRouter(prefix="/v1")


def service(http: HTTPRequest) -> Service:
    return http.app.state.service


def _openai_finish(reason: FinishReason | None) -> str | None:
    if reason is FinishReason.TIMEOUT:   # a deadline ends a request like max_tokens does
        return FinishReason.LENGTH.value
    return reason.value if reason else None


def _usage(req: Request) -> dict:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": req.num_output,
            "total_tokens": len(req.prompt) + req.num_output,
            "prompt_tokens_details": {"cached_tokens": req.num_cached}}


@router.get("/models")
async def list_models(http: HTTPRequest) -> dict:
    svc = service(http)
    return {"object": "list", "data": [
        {"id": lm.name, "object": "model", "created": lm.created, "owned_by": "pagedllama",
         "max_model_len": lm.max_seq_len, "contexts": len(lm.workers), "gguf": lm.facts}
        for lm in svc.models.values()]}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    svc = service(http)
    lm = svc.get(body.model)
    try:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_content", "messages") from exc
    prompt = await svc.chat_prompt(lm, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await _respond(svc, lm, body, prompt, max_tokens, http, chat=True)


@router.post("/completions")
async def completions(body: CompletionRequest, http: HTTPRequest):
    svc = service(http)
    lm = svc.get(body.model)
    prompt_in = body.prompt
    if isinstance(prompt_in, list) and prompt_in and isinstance(prompt_in[0], (str, list)):
        if len(prompt_in) != 1:
            raise APIError(400, "send one prompt per request (batched prompts are not supported)",
                           "unsupported_batch", "prompt")
        prompt_in = prompt_in[0]
    if isinstance(prompt_in, str):
        if not prompt_in:
            raise APIError(400, "the prompt is empty", "empty_prompt", "prompt")
        prompt = await svc.text_prompt(lm, prompt_in)
    else:
        prompt = list(prompt_in)
    echo = prompt_in if body.echo and isinstance(prompt_in, str) else ""
    return await _respond(svc, lm, body, prompt, body.max_tokens or 16, http, chat=False,
                          echo=echo)


async def _respond(svc: Service, lm: LoadedModel, body: SamplingFields, prompt: list[int],
                   max_tokens: int | None, http: HTTPRequest, chat: bool, echo: str = ""):
    worker, req = svc.submit(lm, prompt, body, max_tokens)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(svc, worker, req, http, lm.name, rid, created, chat, include_usage, echo)
        return EventSourceResponse(chunks, ping=15, sep="\n")
    parts, finish = [echo], None
    async for event in svc.events(worker, req, http, poll_disconnect=True):
        if event.error:
            raise APIError(500, event.error, "engine_error")
        parts.append(event.text)
        finish = event.finish_reason
    if finish is None:   # client went away
        raise APIError(499, "client disconnected", "client_disconnected")
    text = "".join(parts)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
              else {"index": 0, "text": text})
    choice.update(logprobs=None, finish_reason=_openai_finish(finish))
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": lm.name, "choices": [choice], "usage": _usage(req)}


async def _stream(svc: Service, worker: Worker, req: Request, http: HTTPRequest, model: str,
                  rid: str, created: int, chat: bool, include_usage: bool,
                  echo: str) -> AsyncIterator[dict]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload = {"id": rid, "object": obj, "created": created, "model": model,
                   "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return {"data": json.dumps(payload, ensure_ascii=False)}

    if chat:
        yield chunk(None, None, first=True)
    elif echo:
        yield chunk(echo, None)
    async for event in svc.events(worker, req, http):
        if event.error:
            yield {"data": json.dumps(error_body(500, event.error, "engine_error"))}
            return
        if event.text:
            yield chunk(event.text, None)
        if event.finish_reason:
            yield chunk(None, _openai_finish(event.finish_reason))
    if include_usage:
        yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                   "choices": [], "usage": _usage(req)})}
    yield {"data": "[DONE]"}
