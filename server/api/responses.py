"""POST /v1/responses: OpenAI's Responses API (server/openai/responses_format.py: its body and
shapes). Generation is the same service path as chat completions, `prompt_cache_key` keeping a
session on the replica that holds its cache; streamed, the text goes out as it comes, except
what may start a call (tools), and each call goes out as its item once it is complete. Hosted
tools left out of the prompt are named in the `x-pagedllama-ignored-tools` header and the
request log."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.chat.answer import constrain_after_thinking, thinking_mode
from server.http.client import HTTPClient
from server.http.errors import error_body
from server.http.openapi import ERROR_RESPONSES, RESPONSES_STREAMED
from server.http.sse import EventStream, message
from server.openai.responses_body import (
    ResponsesRequest,
    constraints,
    reject_unsupported,
    to_messages,
)
from server.openai.responses_format import ResponseState
from server.service.client import Client
from server.service.generation import Final, Generation, error_status
from server.service.service import IGNORED_TOOLS_HEADER, Service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/responses", responses=RESPONSES_STREAMED)
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    gen, state, headers = await start_response(http.app.state.service, body, HTTPClient(http))
    if body.stream:
        return EventStream(_stream(gen, state), headers=headers)
    return JSONResponse(await answer(gen, state), headers=headers)


async def start_response(svc: Service, body: ResponsesRequest,
                         client: Client) -> tuple[Generation, ResponseState, dict]:
    """The body checked, its prompt rendered and tokenized, and its generation submitted; with
    the headers of its answer. The Batch API runs a batch line through this and `answer`."""
    reject_unsupported(body)
    lm = await svc.get(body.model, client, body.keep_alive)
    asked = constraints(body, lm.model)
    use = asked.use
    max_tokens = body.max_output_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, to_messages(body, use), max_tokens, client, use=use)
    thinking = thinking_mode(lm.template.thinks, prompt.opens_thinking)
    grammar = constrain_after_thinking(asked.grammar, thinking)
    gen = svc.generate(lm, body.generation(
        [prompt], max_tokens, grammar, affinity=body.prompt_cache_key, prompt_field="input",
        ignored_tools=tuple(asked.ignored_tools)), client)
    headers = ({IGNORED_TOOLS_HEADER: ",".join(asked.ignored_tools)}
               if asked.ignored_tools else {})
    return gen, ResponseState(body, lm.name, use, thinking=thinking), headers


async def answer(gen: Generation, state: ResponseState) -> dict:
    """A started response run to its end: the response object, not streamed."""
    (choice,) = await gen.collect()
    state.text, state.finish, state.counts = choice.text, choice.finish_reason, choice.usage
    state.finish_output()
    return state.response()


async def _stream(gen: Generation, s: ResponseState) -> AsyncIterator[bytes]:
    """The items as the answer's pieces come: a message's text as deltas, a call's item when it
    is complete, reasoning as reasoning_text deltas (ResponseState.pieces_events)."""
    yield s.event("response.created", response=s.response())
    yield s.event("response.in_progress", response=s.response())
    async for event in gen.stream():
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
        if isinstance(event, Final):
            s.counts = event.usage
    for e in s.end_events():
        yield e
    final = "response.completed" if s.status() == "completed" else "response.incomplete"
    yield s.event(final, response=s.response())
