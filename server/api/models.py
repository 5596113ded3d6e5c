"""Routes about one model and its vocabulary: GET /v1/models/{id} (OpenAI's model object),
POST /tokenize and POST /detokenize (llama-server's shapes; `model` optional, default the first
served model)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import ConfigDict, Field

from server.http.errors import APIError
from server.http.openapi import ERROR_RESPONSES
from server.openai.fields import check_fields
from server.openai.schemas import Body, Bool, Int
from server.service.models import LoadedModel
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


def model_object(lm: LoadedModel) -> dict:
    return {"id": lm.name, "object": "model", "created": lm.created, "owned_by": "pagedllama",
            "max_model_len": lm.max_seq_len, "contexts": len(lm.workers),
            "tool_format": lm.tool_format,
            "thinks": lm.template is not None and lm.template.thinks,
            "chat_template": None if lm.template is None else
            "file" if lm.spec.chat_template is not None else "gguf",
            "gguf": lm.facts}


def pick_model(http: HTTPRequest, name: str | None) -> LoadedModel:
    """The named model, or the first served one when no name is given."""
    svc: Service = http.app.state.service
    return svc.get(name if name is not None else next(iter(svc.models)))


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
    return model_object(pick_model(http, model_id))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http: HTTPRequest) -> dict:
    check_fields(body, frozenset())
    lm = pick_model(http, body.model)
    svc: Service = http.app.state.service
    tokens = await svc.prepare(lm, len(body.content), http, lambda: lm.model.tokenize(
        body.content, body.add_special, body.parse_special))
    if body.with_pieces:
        return {"tokens": [{"id": t, "piece": _piece(lm, t)} for t in tokens]}
    return {"tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http: HTTPRequest) -> dict:
    check_fields(body, frozenset())
    lm = pick_model(http, body.model)
    check_tokens(lm, body.tokens)
    # control tokens as their text, as llama-server does: /tokenize parses them back
    return {"content": await asyncio.to_thread(lm.model.detokenize, body.tokens, True)}
