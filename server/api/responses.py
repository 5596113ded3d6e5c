"""POST /v1/responses: OpenAI's Responses API (server/openai/responses.py shapes it). Generation
is the same service path as chat completions; without tools the text streams as it comes, with
tools it is held to the end, as chat holds it, since only then can a call be told from text."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from engine import Worker
from server.http.errors import APIError, error_body
from server.http.openapi import ERROR_RESPONSES, RESPONSES_STREAMED
from server.http.sse import EventStream, message
from server.openai.responses import (
    ResponsesRequest,
    ResponseState,
    constraints,
    reject_unsupported,
    to_messages,
)
from server.service.service import Service, error_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/responses", responses=RESPONSES_STREAMED)
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    reject_unsupported(body)
    svc: Service = http.app.state.service
    lm = svc.get(body.model)
    use, grammar = constraints(body, lm.model)
    max_tokens = body.max_output_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, to_messages(body), max_tokens, http, use=use)
    worker, req = svc.submit(lm, prompt, body, max_tokens, grammar)
    state = ResponseState(body, lm.name, req, use)
    if body.stream:
        return EventStream(_stream(svc, worker, state, http))
    async for event in svc.events(worker, req, http, poll_disconnect=True):
        if event.error:   # 500 engine_error, or 503 when a drain ended it
            status, code = error_status(event)
            raise APIError(status, event.error, code)
        state.text += event.text
        state.finish = event.finish_reason or state.finish
    if state.finish is None:   # the client went away
        raise APIError(499, "client disconnected", "client_disconnected")
    state.finish_output()
    return state.response()


async def _stream(svc: Service, worker: Worker, s: ResponseState,
                  http: HTTPRequest) -> AsyncIterator[bytes]:
    """Without tools the message streams as it comes; with tools the text is held back and the
    items (a message, function calls) go out whole at the end."""
    live = not s.use.active
    yield s.event("response.created", response=s.response())
    yield s.event("response.in_progress", response=s.response())
    if live:
        for e in s.message_opened(0):
            yield e
    async for event in svc.events(worker, s.req, http):
        if event.error:   # the final event: an engine error, or a drain ended the response
            status, code = error_status(event)
            yield message(json.dumps(
                {**error_body(status, event.error, code)["error"], "type": "error",
                 "sequence_number": s.seq}), "error")
            return
        if event.text:
            s.text += event.text
            if live:
                yield s.text_delta(0, event.text)
        s.finish = event.finish_reason or s.finish
    items = s.finish_output()
    if live:
        for e in s.message_closed(0, items[0]):
            yield e
    else:
        for index, item in enumerate(items):
            for e in s.item_events(index, item):
                yield e
    final = "response.completed" if s.status() == "completed" else "response.incomplete"
    yield s.event(final, response=s.response())
