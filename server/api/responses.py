"""POST /v1/responses: OpenAI's Responses API (server/openai/responses_api.py shapes it). Generation
is the same service path as chat completions, `prompt_cache_key` keeping a session on the
replica that holds its cache; streamed, the text goes out as it comes, except what may start a
call (tools), and each call goes out as its item once it is complete. Hosted tools left out of
the prompt are named in the `x-pagedllama-ignored-tools` header and the request log."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from engine import Worker
from server.chat.answer import constrain_after_thinking, thinking_mode
from server.http.errors import APIError, error_body
from server.http.openapi import ERROR_RESPONSES, RESPONSES_STREAMED
from server.http.sse import EventStream, message
from server.openai.responses_api import (
    ResponsesRequest,
    ResponseState,
    constraints,
    reject_unsupported,
    to_messages,
)
from server.service.service import IGNORED_TOOLS_HEADER, Service, error_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/responses", responses=RESPONSES_STREAMED)
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    svc, worker, state, headers = await start_response(body, http)
    if body.stream:
        return EventStream(_stream(svc, worker, state, http), headers=headers)
    return JSONResponse(await answer(svc, worker, state, http), headers=headers)


async def start_response(body: ResponsesRequest,
                         http: HTTPRequest) -> tuple[Service, Worker, ResponseState, dict]:
    """The body checked, its prompt rendered and tokenized, and its generation submitted; with
    the headers of its answer. The Batch API runs a batch line through this and `answer`."""
    reject_unsupported(body)
    svc: Service = http.app.state.service
    lm = await svc.get(body.model, http, body.keep_alive)
    asked = constraints(body, lm.model)
    http.state.ignored_tools = asked.ignored_tools   # for the request log
    use = asked.use
    max_tokens = body.max_output_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, to_messages(body, use), max_tokens, http, use=use)
    thinking = thinking_mode(lm.template.thinks, prompt.opens_thinking)
    grammar = constrain_after_thinking(asked.grammar, thinking)
    worker, req = svc.submit(lm, prompt, body.generation(
        [prompt], max_tokens, grammar, affinity=body.prompt_cache_key, prompt_field="input"))
    headers = ({IGNORED_TOOLS_HEADER: ",".join(asked.ignored_tools)}
               if asked.ignored_tools else {})
    return svc, worker, ResponseState(body, lm.name, req, use, thinking=thinking), headers


async def answer(svc: Service, worker: Worker, state: ResponseState, http: HTTPRequest) -> dict:
    """A started response run to its end: the response object, not streamed."""
    async for event in svc.events(worker, state.req, http, poll_disconnect=True):
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
    """The items as the answer's pieces come: a message's text as deltas, a call's item when it
    is complete, reasoning as reasoning_text deltas (ResponseState.pieces_events)."""
    yield s.event("response.created", response=s.response())
    yield s.event("response.in_progress", response=s.response())
    async for event in svc.events(worker, s.req, http):
        if event.error:   # the final event: an engine error, or a drain ended the response
            status, code = error_status(event)
            yield message(json.dumps(
                {**error_body(status, event.error, code)["error"], "type": "error",
                 "sequence_number": s.seq}), "error")
            return
        if event.text:
            for e in s.pieces_events(event.text):
                yield e
        s.finish = event.finish_reason or s.finish
    for e in s.end_events():
        yield e
    final = "response.completed" if s.status() == "completed" else "response.incomplete"
    yield s.event(final, response=s.response())
