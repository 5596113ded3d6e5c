"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens. The body
becomes chat messages and a ToolUse (server/anthropic/convert.py), then goes the way a chat
completion goes (service.chat_prompt, service.generate); the answer is shaped as Anthropic's
message or stream events (server/anthropic/message_shape.py). Errors on these routes come in
Anthropic's shape (server/http/errors.py)."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.anthropic.context import ContextEdits, apply_edits, parse_edits
from server.anthropic.convert import Tools, generation, thinking_of, to_chat, tools_of
from server.anthropic.message_shape import MessageShape, error_event, ping, stop_reason, usage
from server.anthropic.messages_body import (
    CountTokensRequest,
    MessagesFields,
    MessagesRequest,
    check_fields,
    unsupported,
)
from server.chat.answer import AnswerStream, constrain_after_thinking, thinking_mode
from server.http.client import HTTPClient
from server.http.openapi import ANTHROPIC_ERROR_RESPONSES, MESSAGES_STREAMED
from server.http.sse import EventStream
from server.service.client import Client
from server.service.generation import Collected, Final, Generation, Usage, error_status
from server.service.loading import LoadedModel
from server.service.service import IGNORED_TOOLS_HEADER, Service

router = APIRouter(prefix="/v1", responses=ANTHROPIC_ERROR_RESPONSES)

PING_S = 1.0          # a ping this often while the prompt computes
ADMISSION_POLL_S = 0.02


def _thinks(lm: LoadedModel) -> bool:
    return lm.template is not None and lm.template.thinks


@router.post("/messages", responses=MESSAGES_STREAMED)
async def create_message(body: MessagesRequest, http: HTTPRequest):
    check_fields(body)
    edits = parse_edits(body.context_management)
    svc: Service = http.app.state.service
    client = HTTPClient(http)
    lm = await svc.get(body.model, client, body.keep_alive)
    if body.max_tokens == 0:
        raise unsupported("max_tokens", "0 (filling the cache without an answer) is not served "
                          "here: our prefix cache keeps every prompt it computes anyway")
    tools = tools_of(body)
    ask = thinking_of(body, lm.name, _thinks(lm), body.max_tokens)
    body, applied = await _edit_context(svc, lm, body, edits, tools, ask.off, client)
    messages, prefill = to_chat(body)
    prompt = await svc.chat_prompt(lm, messages, body.max_tokens, client, not prefill, prefill,
                                   tools.use, no_thinking=ask.off)
    mode = None if prefill or ask.off else thinking_mode(_thinks(lm), prompt.opens_thinking)
    grammar = constrain_after_thinking(tools.use.grammar(), mode)
    gen = svc.generate(lm, generation(body, prompt, grammar, session_key(body, http),
                                      tuple(tools.ignored)), client)
    answer = AnswerStream(tools.use.active, mode, tools.first_only)
    shape = MessageShape(lm.name, ask.omit, tools=tools.use.functions, edits=applied)
    headers = _ignored_header(tools.ignored)
    if body.stream:
        return EventStream(_stream(gen, shape, answer), headers=headers)
    (choice,) = await gen.collect()
    shape.add(answer.push(choice.text) + answer.end())
    shape.close()
    return JSONResponse(shape.message(_stop(choice, shape), _usage(gen, choice.usage)),
                        headers=headers)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, http: HTTPRequest) -> dict:
    """The prompt /v1/messages would compute for the same system, messages, tools, thinking
    and context editing, tokenized: its exact length."""
    check_fields(body)
    edits = parse_edits(body.context_management)
    svc: Service = http.app.state.service
    client = HTTPClient(http)
    lm = await svc.get(body.model, client, body.keep_alive)
    tools = tools_of(body)
    ask = thinking_of(body, lm.name, _thinks(lm))
    body, applied = await _edit_context(svc, lm, body, edits, tools, ask.off, client)
    messages, prefill = to_chat(body)
    prompt = await svc.chat_prompt(lm, messages, None, client, not prefill, prefill, tools.use,
                                   no_thinking=ask.off)
    if edits is None:
        return {"input_tokens": len(prompt)}
    # each applied edit measured what it cleared: the unedited prompt is the sum
    before = len(prompt) + sum(e["cleared_input_tokens"] for e in applied or [])
    return {"input_tokens": len(prompt),
            "context_management": {"original_input_tokens": before}}


def session_key(body: MessagesFields, http: HTTPRequest) -> str | None:
    """The session a request belongs to, which keeps it on the replica holding its cache:
    Claude Code's `X-Claude-Code-Session-Id` header, else the session named in
    `metadata.user_id` (`…_session_<id>`, or a JSON object with `session_id`), else the user."""
    header = http.headers.get("x-claude-code-session-id")
    if header:
        return header
    user = (getattr(body, "metadata", None) or {}).get("user_id")
    if not isinstance(user, str) or not user:
        return None
    try:
        parsed = json.loads(user)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
        return parsed["session_id"]
    _, found, session = user.rpartition("_session_")
    return session if found and session else user


async def _edit_context(svc: Service, lm: LoadedModel, body: MessagesFields,
                        edits: ContextEdits | None, tools: Tools, no_thinking: bool,
                        client: Client) -> tuple[MessagesFields, list[dict] | None]:
    """The body with its context edits applied (on the prompt pool: measuring the prompt
    renders and tokenizes it), and the applied edits to report (None: none were asked)."""
    if edits is None:
        return body, None
    if lm.template is None:   # the chat prompt's own 400
        await svc.chat_prompt(lm, [], None, client)

    def count(messages: list[dict]) -> int:
        chat, prefill = to_chat(body.model_copy(update={"messages": messages}))
        return svc.count_chat_tokens(lm, chat, tools.use, prefill, no_thinking)

    edited, applied = await svc.prepare(lm, len(json.dumps(body.messages)), client,
                                        lambda: apply_edits(edits, body.messages, count))
    return body.model_copy(update={"messages": edited}), applied


def _ignored_header(ignored: list[str]) -> dict[str, str]:
    """Server tools this server does not run, left out of the prompt: named for the client."""
    return {IGNORED_TOOLS_HEADER: ",".join(ignored)} if ignored else {}


def _usage(gen: Generation, counts: Usage | None = None) -> dict:
    """The usage in Anthropic's shape: `counts` (a finished answer's), else the usage so far."""
    engine = gen.lm.spec.engine
    return usage(counts or gen.usage(), engine.block_size, engine.prefix_caching)


def _stop(end: Final | Collected, shape: MessageShape) -> tuple[str, str | None]:
    """The stop reason; a length finish that filled the context (a max_tokens beyond the
    context left was capped there) is model_context_window_exceeded."""
    return stop_reason(end.finish_reason, shape.calls > 0, end.stop_string, end.context_full)


async def _stream(gen: Generation, shape: MessageShape,
                  answer: AnswerStream) -> AsyncIterator[bytes]:
    """message_start once the engine has opened the request (its cache hit is then known) or
    after a second in its queue, pings while it waits and its prompt computes, then the blocks
    as the answer's pieces come."""
    events = gen.stream().__aiter__()
    pending = asyncio.ensure_future(events.__anext__())
    started = tokens = False
    opened = last_ping = time.monotonic()
    try:
        while True:
            wait = ADMISSION_POLL_S if not started else PING_S
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if not done:
                if not started and (gen.admitted or time.monotonic() - opened >= PING_S):
                    started, last_ping = True, time.monotonic()
                    yield shape.start(_usage(gen))
                elif started and not tokens and time.monotonic() - last_ping >= PING_S:
                    last_ping = time.monotonic()
                    yield ping()
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            if not started:
                started = True
                yield shape.start(_usage(gen))
            if event.error:   # the stream ends with Anthropic's error event
                status, _ = error_status(event)
                yield error_event(status, event.error)
                return
            if event.text:
                tokens = True
                for chunk in shape.add(answer.push(event.text)):
                    yield chunk
            if isinstance(event, Final):
                for chunk in shape.add(answer.end()):
                    yield chunk
                for chunk in shape.finish(_stop(event, shape), _usage(gen, event.usage)):
                    yield chunk
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        if not pending.done():
            pending.cancel()      # the service cancels the request and frees its KV
        else:
            await events.aclose()

