"""Native routes: POST /generate_stream (SSE) and GET /health."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.http.client import HTTPClient
from server.http.errors import error_body
from server.http.openapi import ERROR_RESPONSES, NOT_READY, STREAM_ONLY
from server.http.sse import EventStream, json_data, message
from server.openai.bodies import GenerateRequest
from server.openai.fields import check_fields, unsupported
from server.openai.structured import grammar_for
from server.service.generation import Final, Generation, error_status
from server.service.service import Service

router = APIRouter(responses=ERROR_RESPONSES)
public = APIRouter()


@public.get("/health", responses=NOT_READY)
async def health(http: HTTPRequest):
    """Every catalogued model with its state and memory (a loaded one with its contexts), and
    the memory budget: `budget`, `reserved` (counted against it now), `process` (this
    process's resident memory) and `base` (its memory before any model was loaded); the prefix
    cache's RAM and disk tiers (entries, bytes, limits, hits, tokens restored, restore time)."""
    svc: Service | None = getattr(http.app.state, "service", None)
    if svc is None or svc.catalog is None:
        return JSONResponse({"status": "loading", "models": {}}, status_code=503)
    if http.app.state.drain.draining:   # a load balancer stops routing here
        return JSONResponse({"status": "draining", "models": {}}, status_code=503)
    models = {}
    for name, entry in svc.catalog.entries.items():
        lm = svc.loaded.get(name)
        about = {"loaded": lm is not None, "state": entry.state, "pinned": entry.pinned,
                 "keep_alive": entry.keep_alive, "in_use": entry.users,
                 "memory": entry.memory(), "loads": entry.loads, "unloads": entry.unloads,
                 "load_seconds": entry.load_seconds, "unload_seconds": entry.unload_seconds,
                 "error": entry.error}
        if lm is not None:
            about |= {"on_gpu": lm.model.on_gpu,
                      "flash_attn": lm.workers[0].config.flash_attn,
                      "attention": lm.workers[0].context.attention or "plain",
                      "step_target_ms": lm.workers[0].config.step_target_ms,
                      "prefill_chunk": lm.workers[0].config.prefill_chunk,
                      "max_batch_tokens": lm.workers[0].config.max_batch_tokens,
                      "kv_type": lm.spec.engine.kv_type, "kv_unified": lm.spec.engine.kv_unified,
                      "cache_seqs": lm.workers[0].config.n_seq_max - lm.spec.engine.max_seqs,
                      "speculative": lm.workers[0].speculative_note,
                      "max_draft": lm.spec.engine.max_draft,
                      "contexts": [asdict(w.snapshot()) for w in lm.workers],
                      # steps with prompt work beside decoding streams, against the target
                      "step_beside_streams": [w.scheduler.watch.report() for w in lm.workers]}
        models[name] = about
    return {"status": "ok", "memory": svc.catalog.memory(), "models": models,
            "prefix_cache_tiers": svc.catalog.tiers.stats()}


@router.post("/generate_stream", response_class=EventStream, responses=STREAM_ONLY)
async def generate_stream(body: GenerateRequest, http: HTTPRequest):
    """SSE: one `token` event per piece of text ({"text": ...}), then one `done` event with the
    finish reason, token counts and timings (or an `error` event). The prompt is sent as a user
    message through the model's chat template when it has one, unless "raw": true."""
    check_fields(body, frozenset())
    if body.n != 1:
        raise unsupported("n", "above 1 is not supported")
    if "stream" in body.model_fields_set and not body.stream:
        raise unsupported("stream", "false is not supported: this route always streams (the "
                          "OpenAI routes answer without streaming)")
    if body.stream_options is not None:
        raise unsupported("stream_options", "is not supported: the done event carries the counts")
    svc: Service = http.app.state.service
    client = HTTPClient(http)
    lm = await svc.get(body.model or svc.default_model(), client, body.keep_alive)
    if lm.template is not None and not body.raw:   # an instruction, as a one-message chat
        prompt = await svc.chat_prompt(lm, [{"role": "user", "content": body.prompt}],
                                       body.max_tokens, client, param="prompt")
    else:
        prompt = await svc.text_prompt(lm, body.prompt, body.max_tokens, client)
    gen = svc.generate(lm, body.generation([prompt], body.max_tokens,
                                           grammar_for(body, lm.model)), client)
    return EventStream(_events(gen))


async def _events(gen: Generation) -> AsyncIterator[bytes]:
    async for event in gen.stream():
        if event.error:
            status, code = error_status(event)
            yield message(json.dumps(error_body(status, event.error, code)), "error")
            return
        if event.text:
            yield message(json_data({"text": event.text}), "token")
        if isinstance(event, Final):
            counts = event.usage
            yield message(json.dumps({
                "finish_reason": event.finish_reason, "prompt_tokens": counts.prompt_tokens,
                "completion_tokens": counts.completion_tokens,
                "cached_tokens": counts.cached_tokens, "ttft_s": event.ttft_s,
                "total_s": event.total_s}), "done")
