"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models. A route turns its
body into a prompt and an OpenAIFormat (`start_chat`, `start_completion`: the request submitted,
service.generate, for a client: server/service/client.py); `_respond` streams or collects it and
shapes the answer (server/openai/completion_format.py). The Batch API runs a batch line through
the same two steps, not streamed (`start_…` then `answer`), for a client of its own."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from server.api.models import model_object
from server.chat.answer import constrain_after_thinking, thinking_mode
from server.http.client import HTTPClient
from server.http.errors import APIError, error_body
from server.http.openapi import ERROR_RESPONSES, STREAMED
from server.http.sse import EventStream
from server.openai.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    UnsupportedContent,
)
from server.openai.completion_format import Kind, OpenAIFormat, sse, usage
from server.openai.fields import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, check_fields, unsupported
from server.openai.structured import grammar_for
from server.openai.tool_fields import parse_tools
from server.service.client import Client
from server.service.generation import Generation, error_status
from server.service.loading import LoadedModel
from server.service.service import Service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def service(http: HTTPRequest) -> Service:
    return http.app.state.service


@router.get("/models")
async def list_models(http: HTTPRequest) -> dict:
    """Every catalogued model, loaded or not, with its state and memory."""
    catalog = service(http).catalog
    assert catalog is not None, "started"
    return {"object": "list", "data": [model_object(e) for e in catalog.entries.values()]}


Started = tuple[Generation, OpenAIFormat]


@router.post("/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    return await _respond(*await start_chat(service(http), body, HTTPClient(http)))


async def start_chat(svc: Service, body: ChatCompletionRequest, client: Client) -> Started:
    """The body checked, its prompt rendered and tokenized, and its generation submitted."""
    lm = await _model_for(svc, body, client, UNSUPPORTED_CHAT)
    try:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    except UnsupportedContent as exc:
        raise unsupported("messages", f"content parts of type '{exc}' are not supported "
                          "(text only)") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_content", "messages") from exc
    use = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    grammar = grammar_for(body, lm.model)
    if grammar and use.grammar():
        raise APIError(400, "a tool_choice that forces a call cannot be combined with "
                       "response_format, json_schema or grammar", "invalid_value", "tool_choice")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                       "invalid_value", "continue_final_message")
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt = await svc.chat_prompt(lm, messages, max_tokens, client, body.add_generation_prompt,
                                   body.continue_final_message, use)
    thinking = None if body.continue_final_message else thinking_mode(
        lm.template.thinks, prompt.opens_thinking)
    grammar = constrain_after_thinking(grammar or use.grammar(), thinking)
    gen = svc.generate(lm, body.generation([prompt], max_tokens, grammar,
                                           affinity=cache_key(body), prompt_field="messages"),
                       client)
    fmt = _format("chat", lm, body, tools=use.active)
    fmt.functions = use.functions
    fmt.thinking = thinking
    return gen, fmt


@router.post("/completions", responses=STREAMED)
async def completions(body: CompletionRequest, http: HTTPRequest):
    return await _respond(*await start_completion(service(http), body, HTTPClient(http)))


async def start_completion(svc: Service, body: CompletionRequest, client: Client) -> Started:
    """The body checked, its prompts tokenized, and its generation submitted."""
    lm = await _model_for(svc, body, client, UNSUPPORTED_COMPLETION)
    prompts_in = _prompt_list(body.prompt)
    if len(prompts_in) * body.n > lm.spec.engine.max_seqs + lm.spec.engine.max_queue:
        raise APIError(400, f"{len(prompts_in)} prompts x n={body.n} choices is more than this "
                       "server queues at once", "invalid_value", "prompt")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 is only meaningful with echo (scoring the prompt)",
                       "invalid_value", "max_tokens")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    prompts = []   # each string through the bounded prompt pool, refused before tokenizing
    for p in prompts_in:
        if isinstance(p, str) and not p:
            raise APIError(400, "the prompt is empty", "empty_prompt", "prompt")
        prompts.append(await svc.text_prompt(lm, p, max_tokens, client) if isinstance(p, str)
                       else list(p))
    gen = svc.generate(lm, body.generation(prompts, max_tokens, grammar_for(body, lm.model),
                                           affinity=cache_key(body)), client)
    echo = ([p if isinstance(p, str) else lm.model.detokenize(p) for p in prompts_in]
            if body.echo else [])   # after generate: it has checked the token ids
    return gen, _format("completion", lm, body, echo, len(prompts))


def _prompt_list(prompt) -> list:
    """A completions prompt as a list of prompts (each a string or token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


async def _model_for(svc: Service, body: SamplingFields, client: Client,
                     unsupported_fields: frozenset[str]) -> LoadedModel:
    """The body's fields checked, its model loaded (and held), its `n` within bounds."""
    check_fields(body, unsupported_fields)
    lm = await svc.get(body.model, client, body.keep_alive)
    _check_n(body, svc, lm)
    return lm


def _check_n(body: SamplingFields, svc: Service, lm: LoadedModel) -> None:
    limit = min(svc.settings.max_n, lm.spec.engine.max_seqs)
    if body.n > limit:
        why = ("PAGEDLLAMA_MAX_N" if limit == svc.settings.max_n
               else "the sequences a context runs at once, PAGEDLLAMA_MAX_SEQS")
        raise APIError(400, f"n must be at most {limit} ({why})", "invalid_value", "n")


def _format(kind: Kind, lm: LoadedModel, body: SamplingFields, echo: list[str] | None = None,
            num_prompts: int = 1, tools: bool = False) -> OpenAIFormat:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    options = body.stream_options if body.stream else None
    return OpenAIFormat(kind, lm.name, prefix + uuid.uuid4().hex[:24], int(time.time()),
                        body.stream, bool(options and options.include_usage), echo or [], tools,
                        body.n, body.n * num_prompts,
                        bool(options and options.continuous_usage_stats))


async def _respond(gen: Generation, fmt: OpenAIFormat):
    if fmt.stream:
        return EventStream(_stream(gen, fmt))
    return await answer(gen, fmt)


async def answer(gen: Generation, fmt: OpenAIFormat) -> dict:
    """A started request run to its end: the answer, not streamed."""
    choices = await gen.collect()
    return fmt.response(choices, usage(gen.usage()))


async def _stream(gen: Generation, fmt: OpenAIFormat) -> AsyncIterator[bytes]:
    """Every chunk carries its choice's index. With tools, or a model that thinks, a choice's
    text is told apart as it comes (OpenAIFormat.splits): text goes out at once except what may
    start a call, each call as OpenAI's tool-call deltas once it is complete, reasoning as
    reasoning_content deltas. A completions echo goes out with its choice's first event,
    when the prompt's logprobs (if asked) are known. With continuous_usage_stats every chunk
    carries the usage so far (completion tokens: those delivered up to that chunk)."""
    delivered = 0
    if fmt.continuous_usage:
        def usage_now() -> dict:
            u = usage(gen.usage())
            u["completion_tokens"] = delivered
            u["total_tokens"] = u["prompt_tokens"] + delivered
            return u
        fmt.usage_now = usage_now
    for chunk in fmt.opening_chunks():
        yield chunk
    started: set[int] = set()
    async for event in gen.stream():
        if event.error:   # the stream still ends as streams do: with [DONE]
            status, code = error_status(event)
            yield sse(error_body(status, event.error, code))
            yield sse("[DONE]")
            return
        delivered += event.num_tokens
        i = event.index
        if i not in started:
            started.add(i)
            for chunk in fmt.echo_chunks(i, gen.prompt_logprobs(i)):
                yield chunk
        if fmt.splits:
            if event.finish_reason:
                chunks = fmt.closing_chunks(event.text, event.finish_reason, i, event.logprobs)
            else:
                chunks = fmt.piece_chunks(event.text, i, event.logprobs)
            for chunk in chunks:
                yield chunk
            continue
        if event.text or event.logprobs:
            yield fmt.text_chunk(event.text, event.logprobs, i)
        if event.finish_reason:
            for chunk in fmt.closing_chunks("", event.finish_reason, i):
                yield chunk
    if fmt.include_usage:
        yield fmt.usage_chunk(usage(gen.usage()))
    yield sse("[DONE]")


def cache_key(body) -> str | None:
    """The session a request belongs to (`prompt_cache_key`, else `user`), which keeps it on the
    replica holding its cache."""
    extra = body.model_extra or {}
    key = extra.get("prompt_cache_key") or extra.get("user")
    return key if isinstance(key, str) and key else None
