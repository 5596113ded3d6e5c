"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models. A route turns its
body into a prompt and an OpenAIFormat; `_respond` runs it (service.generate) and shapes the
answer (server/openai_format.py)."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from sse_starlette.sse import EventSourceResponse

from server.errors import APIError, error_body
from server.fields import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, check_fields, unsupported
from server.model_routes import model_object
from server.openapi import ERROR_RESPONSES, STREAMED
from server.openai_format import Kind, OpenAIFormat, sse
from server.schemas import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                            UnsupportedContent)
from server.structured import grammar_for
from server.tools import parse_tools, render_messages
from server.service import Generation, LoadedModel, Service, error_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def service(http: HTTPRequest) -> Service:
    return http.app.state.service


@router.get("/models")
async def list_models(http: HTTPRequest) -> dict:
    return {"object": "list", "data": [model_object(lm) for lm in service(http).models.values()]}


@router.post("/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    check_fields(body, UNSUPPORTED_CHAT)
    _check_n(body)
    svc = service(http)
    lm = svc.get(body.model)
    try:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    except UnsupportedContent as exc:
        raise unsupported("messages", f"content parts of type '{exc}' are not supported "
                          "(text only)") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_content", "messages") from exc
    use = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    grammar = grammar_for(body, lm.model.vocab)
    if grammar and use.grammar():
        raise APIError(400, "a tool_choice that forces a call cannot be combined with "
                       "response_format, json_schema or grammar", "invalid_value", "tool_choice")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                       "invalid_value", "continue_final_message")
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, render_messages(messages, use), max_tokens, http,
                                   body.add_generation_prompt, body.continue_final_message)
    gen = svc.generate(lm, prompt, body, max_tokens, http, grammar or use.grammar())
    return await _respond(svc, gen, _format("chat", lm, body, tools=use.active))


@router.post("/completions", responses=STREAMED)
async def completions(body: CompletionRequest, http: HTTPRequest):
    check_fields(body, UNSUPPORTED_COMPLETION)
    _check_n(body)
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
        prompt = await svc.text_prompt(lm, prompt_in, body.max_tokens or 16, http)
    else:
        prompt = list(prompt_in)
    echo = prompt_in if body.echo and isinstance(prompt_in, str) else ""
    if body.echo and body.logprobs is not None:
        raise unsupported("echo", "with logprobs (the prompt's logprobs) is not supported yet")
    gen = svc.generate(lm, prompt, body, body.max_tokens or 16, http,
                       grammar_for(body, lm.model.vocab))
    return await _respond(svc, gen, _format("completion", lm, body, echo))


def _check_n(body: SamplingFields) -> None:
    if body.n != 1:
        raise unsupported("n", "above 1 is not supported yet (one choice per request)")


def _format(kind: Kind, lm: LoadedModel, body: SamplingFields, echo: str = "",
            tools: bool = False) -> OpenAIFormat:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return OpenAIFormat(kind, lm.name, prefix + uuid.uuid4().hex[:24], int(time.time()),
                        body.stream, include_usage, echo, tools)


async def _respond(svc: Service, gen: Generation, fmt: OpenAIFormat):
    if fmt.stream:
        return EventSourceResponse(_stream(svc, gen, fmt), ping=15, sep="\n")
    done = await svc.collect(gen)
    return fmt.response(done.text, done.finish_reason, gen.req, done.logprobs)


async def _stream(svc: Service, gen: Generation, fmt: OpenAIFormat) -> AsyncIterator[dict]:
    """With tools, the text is held back until the end: only then can it be told apart from a
    call (the fallback format), and the calls go out as OpenAI's tool-call deltas."""
    for chunk in fmt.opening_chunks():
        yield chunk
    held = []
    async for event in svc.stream(gen):
        if event.error:   # the stream still ends as streams do: with [DONE]
            status, code = error_status(event)
            yield sse(error_body(status, event.error, code))
            yield sse("[DONE]")
            return
        if event.text and fmt.tools:
            held.append(event.text)
        elif event.text or event.logprobs:
            yield fmt.text_chunk(event.text, event.logprobs)
        if event.finish_reason:
            for chunk in fmt.closing_chunks("".join(held), event.finish_reason):
                yield chunk
    if fmt.include_usage:
        yield fmt.usage_chunk(gen.req)
    yield sse("[DONE]")
