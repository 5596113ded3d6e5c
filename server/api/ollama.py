"""Ollama's native API over the same service as every other API: POST /api/chat,
/api/generate, /api/embed, /api/embeddings, /api/show; GET /api/tags, /api/ps, /api/version;
and the model management routes (/api/pull, /api/push, /api/create, /api/copy, /api/delete),
which answer how models are added here. A body becomes chat messages or a prompt, sampling
values and a grammar (server/ollama/), goes through service.chat_prompt / text_prompt and
service.generate, and comes back as Ollama's objects: NDJSON lines when streamed (the default),
one JSON object when not (server/ollama/shape.py). Errors on these routes are Ollama's
`{"error": "..."}` (server/http/errors.py)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from engine.gguf_info import read_header
from server.api import embeddings
from server.chat.answer import AnswerStream, constrain_after_thinking, thinking_mode
from server.http.client import HTTPClient
from server.http.errors import APIError, OllamaErrorResponse
from server.http.openapi import NDJSON_STREAMED, OLLAMA_ERROR_RESPONSES
from server.http.sse import json_data
from server.ollama import options as opts
from server.ollama.bodies import (
    Generating,
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaNameRequest,
    OllamaShowRequest,
)
from server.ollama.shape import (
    API_VERSION,
    AnswerShape,
    ModelFacts,
    Timing,
    details,
    expires_at,
    model_info,
    parameters_text,
    resolve,
    statistics,
    timestamp,
    to_chat,
)
from server.openai.structured import schema_grammar
from server.openai.tool_fields import parse_tools
from server.service.catalog import Entry, Models, State
from server.service.client import Client
from server.service.generation import Final, Generation
from server.service.loading import LoadedModel
from server.service.request import Blame, GenerationRequest
from server.service.service import Service


class JSONBody(APIRoute):
    """A body is JSON whatever its Content-Type says: Ollama reads it so, and its examples send
    JSON with curl's `-d` (application/x-www-form-urlencoded)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: HTTPRequest):
            kind = request.headers.get("content-type", "")
            if request.method in ("POST", "DELETE") and "json" not in kind:
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                request.scope["headers"] = headers + [(b"content-type", b"application/json")]
                request.__dict__.pop("_headers", None)
            return await handler(request)
        return route


router = APIRouter(prefix="/api", responses=OLLAMA_ERROR_RESPONSES, route_class=JSONBody)
NDJSON = "application/x-ndjson"
# keep_alive 0 with nothing to generate unloads the model: a pinned model stays (409)
PINNED = {409: {"model": OllamaErrorResponse, "description": "keep_alive 0 asked to unload a "
                "pinned model, which stays loaded"}}
HOW_MODELS_ARE_ADDED = (
    "models are not pulled, pushed, created or copied through this API here: the models served "
    "are the GGUF files of PAGEDLLAMA_MODELS_DIR and those a models file lists "
    "(PAGEDLLAMA_MODELS_FILE), read at start-up; add a file there and restart "
    "(docs/models-on-demand.md). GET /api/tags lists them")


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


def _catalog(svc: Service) -> Models:
    assert svc.catalog is not None, "started"
    return svc.catalog


def _entry(svc: Service, name: str) -> Entry:
    catalog = _catalog(svc)
    return catalog.entries[resolve(name, list(catalog.entries))]


def _facts(entry: Entry) -> ModelFacts:
    stat = entry.spec.path.stat()
    return ModelFacts(entry.name, stat.st_size, stat.st_mtime, entry.facts)


async def _load(svc: Service, body: Generating, client: Client, timing: Timing) -> LoadedModel:
    entry = _entry(svc, body.model)
    started = time.monotonic()
    lm = await svc.get(entry.name, client, body.keep_alive)
    timing.load_s = time.monotonic() - started
    return lm


def _line(obj: dict) -> bytes:
    return (json_data(obj) + "\n").encode("utf-8")


def _one(obj: dict, streamed: bool):
    """A single object: one NDJSON line when streamed, else JSON."""
    if streamed:
        return StreamingResponse(iter([_line(obj)]), media_type=NDJSON)
    return JSONResponse(obj)


# ---- generation --------------------------------------------------------------------------------
def _check(body: Generating) -> None:
    opts.check(body.options)
    if body.logprobs or body.top_logprobs:
        raise APIError(400, "logprobs are not served on Ollama's routes here (the OpenAI routes, "
                       "/v1/chat/completions, have them)", "unsupported_parameter", "logprobs")


def _no_thinking(body: Generating, lm: LoadedModel) -> bool:
    """Whether to answer without reasoning (`think: false` on a model that reasons); a 400
    for `think` on a model that does not, or for a reasoning level."""
    thinks = lm.template is not None and lm.template.thinks
    if body.think is None:
        return False
    if body.think is not False and not thinks:
        raise APIError(400, f'"{body.model}" does not support thinking', "invalid_value", "think")
    if isinstance(body.think, str):
        raise APIError(400, "think: reasoning levels are not served for this model; give true "
                       "or false", "invalid_value", "think")
    return body.think is False and thinks


def _grammar(body: Generating, lm: LoadedModel) -> str | None:
    """`format`: "json" (a JSON object) or a JSON schema, as a grammar."""
    if body.format in (None, ""):
        return None
    schema = {"type": "object"} if body.format == "json" else body.format
    return schema_grammar(schema, lm.model, "format")


async def _lifecycle(svc: Service, body: Generating, client: Client, chat: bool):
    """A request with nothing to generate: Ollama's way of loading a model (or, with
    `keep_alive: 0`, of unloading it now)."""
    entry = _entry(svc, body.model)
    shape = AnswerShape(body.model, chat)
    if body.keep_alive == 0:
        catalog = _catalog(svc)
        if entry.state is not State.UNLOADED:
            now = catalog.unload(entry, "unload asked for (keep_alive 0)")
            if now and entry.task is not None:
                await asyncio.shield(entry.task)
        return _one(shape.lifecycle("unload"), body.streamed)
    await svc.get(entry.name, client, body.keep_alive)
    return _one(shape.lifecycle("load"), body.streamed)


@router.post("/chat", responses=NDJSON_STREAMED | PINNED)
async def chat(body: OllamaChatRequest, http: HTTPRequest):
    """A chat turn: `messages` (with `tool_calls`, `thinking`, tool results), `tools`,
    `format`, `options`, `think`, `keep_alive`. No messages: loads (or unloads) the model."""
    timing, svc, client = Timing(), _service(http), HTTPClient(http)
    _check(body)
    messages = to_chat(body.messages)
    if not messages:
        return await _lifecycle(svc, body, client, chat=True)
    lm = await _load(svc, body, client, timing)
    if lm.template is None:
        raise APIError(400, f'"{body.model}" has no chat template in its GGUF file: use '
                       "/api/generate with a prompt (read as it is)", "no_chat_template")
    no_thinking = _no_thinking(body, lm)
    use = parse_tools(body.tools, None, True) if body.tools else None
    grammar = _grammar(body, lm)
    limit = opts.max_tokens(body.options, body.num_predict)
    prompt = await svc.chat_prompt(lm, messages, limit, client, use=use, no_thinking=no_thinking)
    mode = None if no_thinking else thinking_mode(lm.template.thinks, prompt.opens_thinking)
    gen = _submit(svc, lm, body, prompt, limit, constrain_after_thinking(grammar, mode), client,
                  "messages")
    answer = AnswerStream(use is not None and use.active, mode)
    return await _respond(gen, answer, AnswerShape(body.model, chat=True), timing, body.streamed)


@router.post("/generate", responses=NDJSON_STREAMED | PINNED)
async def generate(body: OllamaGenerateRequest, http: HTTPRequest):
    """A completion of `prompt`: through the model's chat template as a user message (after
    `system`), or as it is with `raw: true`. No prompt: loads (or unloads) the model."""
    timing, svc, client = Timing(), _service(http), HTTPClient(http)
    _check(body)
    for name in ("template", "context", "images"):
        if getattr(body, name):
            raise APIError(400, _NOT_SERVED[name], "unsupported_parameter", name)
    if body.suffix:
        entry = _entry(svc, body.model)
        raise APIError(400, f'"{body.model}" cannot fill in the middle: suffix is not served '
                       f"for {entry.name}", "unsupported_parameter", "suffix")
    if not body.prompt:
        return await _lifecycle(svc, body, client, chat=False)
    lm = await _load(svc, body, client, timing)
    no_thinking = _no_thinking(body, lm)
    grammar = _grammar(body, lm)
    limit = opts.max_tokens(body.options, body.num_predict)
    mode = None
    if lm.template is not None and not body.raw:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        messages.append({"role": "user", "content": body.prompt})
        prompt = await svc.chat_prompt(lm, messages, limit, client, param="prompt",
                                       no_thinking=no_thinking)
        if not no_thinking:
            mode = thinking_mode(lm.template.thinks, prompt.opens_thinking)
    else:
        if body.system:
            raise APIError(400, "system is written by the chat template, which raw: true (or a "
                           "model without one) leaves out: put it in the prompt",
                           "unsupported_parameter", "system")
        prompt = await svc.text_prompt(lm, body.prompt, limit, client)
    gen = _submit(svc, lm, body, prompt, limit, constrain_after_thinking(grammar, mode), client,
                  "prompt")
    answer = AnswerStream(False, mode)
    return await _respond(gen, answer, AnswerShape(body.model, chat=False), timing,
                          body.streamed)


_NOT_SERVED = {
    "template": "template: a template in the request is not served; the model's own chat "
                "template renders the prompt (or raw: true with a prompt rendered by the client)",
    "context": "context: the token context of an earlier answer is not served; send the "
               "conversation as messages to /api/chat (the prefix cache reuses its tokens)",
    "images": "images: no model served here reads images",
}


def _submit(svc: Service, lm: LoadedModel, body: Generating, prompt: list[int],
            limit: int | None, grammar: str | None, client: Client, field: str) -> Generation:
    limit = opts.within_context(body.options, len(prompt), limit, lm.max_seq_len)
    request = GenerationRequest([prompt], opts.sampling(body.options), limit, grammar=grammar,
                                blame=Blame(prompt=field))
    return svc.generate(lm, request, client)


async def _respond(gen: Generation, answer: AnswerStream, shape: AnswerShape, timing: Timing,
                   streamed: bool):
    if streamed:
        return StreamingResponse(_lines(gen, answer, shape, timing), media_type=NDJSON)
    (choice,) = await gen.collect()
    pieces = answer.push(choice.text) + answer.end()
    return JSONResponse(shape.last(pieces, choice.finish_reason, statistics(
        timing, choice.usage, choice.ttft_s, choice.total_s)))


async def _lines(gen: Generation, answer: AnswerStream, shape: AnswerShape,
                 timing: Timing) -> AsyncIterator[bytes]:
    """One line per piece of the answer (text, reasoning, a whole tool call), then, as Ollama
    ends its streams, a last line with no text of its own: `done: true` and the statistics. An
    engine error ends the stream with an `{"error": ...}` line, as Ollama's does. After the
    last line the engine's events run out (they end with it), so that the request ends as
    finished: a client that closes the connection as soon as it reads `done: true` (the
    JavaScript client, Open WebUI) has not left it early."""
    async for event in gen.stream():
        if event.error:
            yield _line({"error": event.error})
            return
        pieces = answer.push(event.text) if event.text else []
        if isinstance(event, Final):
            pieces += answer.end()
        obj = shape.pieces(pieces)
        if obj is not None:
            yield _line(obj)
        if isinstance(event, Final):
            yield _line(shape.last([], event.finish_reason, statistics(
                timing, event.usage, event.ttft_s, event.total_s)))


# ---- embeddings --------------------------------------------------------------------------------
async def _embed(svc: Service, name: str, inputs, keep_alive: float | None,
                 dimensions: int | None, client: Client) -> tuple[dict, Timing]:
    timing = Timing()
    entry = _entry(svc, name)
    started = time.monotonic()
    await svc.get(entry.name, client, keep_alive)
    timing.load_s = time.monotonic() - started
    request = embeddings.EmbeddingRequest(model=entry.name, input=inputs, keep_alive=keep_alive,
                                          dimensions=dimensions)
    return await embeddings.embed(svc, request, client), timing


@router.post("/embed")
async def embed(body: OllamaEmbedRequest, http: HTTPRequest) -> dict:
    """L2-normalized vectors of `input` (a string or a list); an input longer than the
    embedding context is a 400 whatever `truncate` says (never cut silently)."""
    opts.check(body.options)
    answer, timing = await _embed(_service(http), body.model, body.input, body.keep_alive,
                                  body.dimensions, HTTPClient(http))
    return {"model": body.model, "embeddings": [d["embedding"] for d in answer["data"]],
            "total_duration": int((time.monotonic() - timing.start) * 1e9),
            "load_duration": int(timing.load_s * 1e9),
            "prompt_eval_count": answer["usage"]["prompt_tokens"]}


@router.post("/embeddings")
async def embeddings_legacy(body: OllamaEmbeddingsRequest, http: HTTPRequest) -> dict:
    """The older route: one `prompt`, one `embedding`."""
    opts.check(body.options)
    answer, _ = await _embed(_service(http), body.model, body.prompt, body.keep_alive, None,
                             HTTPClient(http))
    return {"embedding": answer["data"][0]["embedding"]}


# ---- models ------------------------------------------------------------------------------------
@router.get("/tags")
async def tags(http: HTTPRequest) -> dict:
    """Every catalogued model, loaded or not, named as Ollama lists models (`name:latest`)."""
    entries = _catalog(_service(http)).entries.values()
    return {"models": [_facts(e).listed() for e in entries]}


@router.get("/ps")
async def ps(http: HTTPRequest) -> dict:
    """The models loaded now: their memory (what counts against the budget), when each unloads
    if left idle, and their context."""
    out = []
    for entry in _catalog(_service(http)).entries.values():
        if entry.state is not State.LOADED or entry.loaded is None:
            continue
        keep = -1.0 if entry.pinned else entry.keep_alive
        idle_since = None if entry.users else entry.last_used
        out.append(_facts(entry).running(entry.reserved, expires_at(keep, idle_since),
                                         entry.loaded.max_seq_len))
    return {"models": out}


@router.post("/show")
async def show(body: OllamaShowRequest, http: HTTPRequest) -> dict:
    """A model's details, its GGUF header's metadata (`model_info`), its chat template, its
    default parameters and what it can do."""
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required", "invalid_value", "model")
    entry = _entry(_service(http), name)
    spec = entry.spec
    header = await asyncio.to_thread(read_header, spec.path)
    template = (spec.chat_template.read_text() if spec.chat_template is not None
                else header.metadata.get("tokenizer.chat_template")) or ""
    capabilities = ["completion"] + (["tools"] if template else [])
    capabilities += ["thinking"] if entry.thinks else []
    parameters = parameters_text(dict(spec.defaults), [])
    facts = _facts(entry)
    return {"license": header.metadata.get("general.license", ""),
            "modelfile": f"# served by pagedllama from {spec.path.name}\nFROM {spec.path}\n"
                         + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
            "parameters": parameters, "template": template, "details": details(entry.facts),
            "model_info": model_info(header.metadata, bool(body.verbose)),
            "capabilities": capabilities, "modified_at": timestamp(facts.mtime)}


@router.get("/version")
async def version() -> dict:
    """The Ollama release whose API these routes follow."""
    return {"version": API_VERSION}


@router.post("/pull", responses=NDJSON_STREAMED)
async def pull(body: OllamaNameRequest, http: HTTPRequest):
    """A catalogued model is here already: success. Any other: how models are added."""
    name = body.model or body.name or ""
    try:
        _entry(_service(http), name)
    except APIError:
        raise APIError(400, f'cannot pull "{name}": {HOW_MODELS_ARE_ADDED}',
                       "unsupported") from None
    return _one({"status": "success"}, (body.model_extra or {}).get("stream") is not False)


@router.post("/push")
async def push(body: OllamaNameRequest) -> dict:
    raise APIError(400, HOW_MODELS_ARE_ADDED, "unsupported")


@router.post("/create")
async def create(body: OllamaNameRequest) -> dict:
    raise APIError(400, HOW_MODELS_ARE_ADDED, "unsupported")


@router.post("/copy")
async def copy(body: OllamaCopyRequest, http: HTTPRequest) -> dict:
    _entry(_service(http), body.source)
    raise APIError(400, f"a model's name here is its file's name (or the name a models file "
                   f"gives it): {HOW_MODELS_ARE_ADDED}", "unsupported")


@router.delete("/delete")
async def delete(body: OllamaNameRequest, http: HTTPRequest) -> dict:
    _entry(_service(http), body.model or body.name or "")
    raise APIError(400, "models are removed here by removing their file from the models folder "
                   "or the models file (then restart); to unload one now, send keep_alive: 0 "
                   "(POST /api/generate with no prompt)", "unsupported")
