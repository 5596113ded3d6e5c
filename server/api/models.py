"""Routes about one model and its vocabulary: GET /v1/models/{id} (OpenAI's model object, with
the model's state and memory), POST /models/{id}/load and /models/{id}/unload, POST /tokenize
and POST /detokenize (llama-server's shapes; `model` optional, default the first loaded model,
else the first catalogued)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from server.http.client import HTTPClient
from server.http.errors import APIError
from server.http.openapi import ERROR_RESPONSES, UNLOAD
from server.openai.bodies import Body, Bool, Int
from server.openai.fields import check_fields
from server.service.catalog import Entry, State
from server.service.loading import LoadedModel
from server.service.service import Service

router = APIRouter(responses=ERROR_RESPONSES)


class TokenizeRequest(Body):
    # unknown fields: refused by name (server/openai/fields.py)
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    content: str
    add_special: Bool = False
    parse_special: Bool = True
    with_pieces: Bool = False


class DetokenizeRequest(Body):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Int] = Field(default_factory=list)


def model_object(entry: Entry) -> dict:
    """OpenAI's model object, and this server's fields: the state (loaded, loading, unloaded,
    unloading), memory (the estimate by part, what is counted against the budget now, and the
    process's memory change its last load measured), loads, and what its chat template does
    (tool_format, thinks)."""
    lm, spec = entry.loaded if entry.state is State.LOADED else None, entry.spec
    return {"id": entry.name, "object": "model",
            "created": lm.created if lm else int(spec.path.stat().st_mtime),
            "owned_by": "pagedllama", "state": entry.state, "pinned": entry.pinned,
            "keep_alive": entry.keep_alive, "memory": entry.memory(),
            "loads": entry.loads, "load_seconds": entry.load_seconds,
            "max_model_len": lm.max_seq_len if lm else spec.engine.n_ctx,
            "contexts": spec.contexts, "tool_format": entry.tool_format,
            "thinks": entry.thinks,
            "chat_template": "file" if spec.chat_template is not None else
            "gguf" if entry.facts.get("chat_template") else None,
            "gguf": entry.facts}


async def pick_model(http: HTTPRequest, name: str | None) -> LoadedModel:
    """The named model (loaded if need be), or the default one when no name is given."""
    svc: Service = http.app.state.service
    return await svc.get(name if name is not None else svc.default_model(), HTTPClient(http))


def _catalog(http: HTTPRequest):
    svc: Service = http.app.state.service
    assert svc.catalog is not None, "started"
    return svc.catalog


def check_tokens(lm: LoadedModel, tokens: list[int], param: str = "tokens") -> None:
    bad = [t for t in tokens if t < 0 or t >= lm.model.n_vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {lm.model.n_vocab}); got {bad[0]}",
                       "invalid_token", param)


def _piece(lm: LoadedModel, token: int) -> str | list[int]:
    """A token's text (a control token's too, as llama-server shows it); its bytes where they
    are not valid UTF-8 on their own (llama-server)."""
    data = lm.model.token_bytes(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, http: HTTPRequest) -> dict:
    return model_object(_catalog(http).entry(model_id))


@router.post("/models/{model_id:path}/load")
async def load_model(model_id: str, http: HTTPRequest) -> dict:
    """Load a catalogued model now (as its first request would), and answer once it is loaded:
    a 503 with Retry-After when the models that could make room are busy, a 400 when it alone
    exceeds the memory budget. It then unloads after its keep_alive like any other."""
    svc: Service = http.app.state.service
    await svc.get(model_id, HTTPClient(http), reason="POST /models/{id}/load")
    return model_object(_catalog(http).entry(model_id))


@router.post("/models/{model_id:path}/unload", responses=UNLOAD)
async def unload_model(model_id: str, http: HTTPRequest):
    """Unload a model: at once when no request uses it (200), else as soon as its requests
    have finished (202; new requests are still served meanwhile). A pinned model is a 409."""
    catalog = _catalog(http)
    entry = catalog.entry(model_id)
    now = catalog.unload(entry, "unload asked for (POST /models/{id}/unload)")
    if now and entry.task is not None:
        await asyncio.shield(entry.task)
    return JSONResponse(model_object(entry), status_code=200 if now else 202)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http: HTTPRequest) -> dict:
    check_fields(body, frozenset())
    lm = await pick_model(http, body.model)
    svc: Service = http.app.state.service
    tokens = await svc.prepare(lm, len(body.content), HTTPClient(http),
                               lambda: lm.model.tokenize(body.content, body.add_special,
                                                         body.parse_special))
    if body.with_pieces:
        return {"tokens": [{"id": t, "piece": _piece(lm, t)} for t in tokens]}
    return {"tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http: HTTPRequest) -> dict:
    check_fields(body, frozenset())
    lm = await pick_model(http, body.model)
    check_tokens(lm, body.tokens)
    # control tokens as their text, as llama-server does: /tokenize parses them back
    return {"content": await asyncio.to_thread(lm.model.detokenize, body.tokens, True)}
