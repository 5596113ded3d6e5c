"""POST /v1/embeddings: OpenAI's embeddings, computed in an embedding context of the model
(engine.embedding.Embedder). Inputs are embedded one after another on the model's own
single-thread executor, so the event loop never waits on llama.cpp and one embedding context
never runs twice at once. The Batch API answers an embeddings batch line with the route itself
(`embeddings`: a body in, the answer out)."""
from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import ConfigDict, Field

from server.api.models import check_tokens
from server.http.client import HTTPClient
from server.http.errors import APIError
from server.http.openapi import ERROR_RESPONSES
from server.openai.bodies import Body, Int, KeepAlive
from server.openai.fields import check_fields
from server.service.client import Client
from server.service.loading import LoadedModel
from server.service.service import Service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
MAX_INPUTS = 2048


class EmbeddingRequest(Body):
    # unknown fields are kept so that server/openai/fields.py can refuse them by name (vLLM's
    # `truncate_prompt_tokens` or `normalize` would change the vectors)
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[Int] | list[list[Int]]
    keep_alive: KeepAlive = None   # Ollama's field: seconds the model stays loaded once idle
    encoding_format: Literal["float", "base64"] | None = None   # None: float
    dimensions: Int | None = Field(None, ge=1)


async def _inputs(svc: Service, lm: LoadedModel, raw, client: Client) -> list[list[int]]:
    """Every input as token ids (text is tokenized with the model's BOS, as for a prompt, on
    the bounded prompt pool; a text whose token bound already exceeds the embedding context is
    refused without tokenizing)."""
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise APIError(400, "input is empty", "empty_input", "input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request", "invalid_value", "input")
    texts = [item for item in items if isinstance(item, str)]
    for text in texts:
        if not text:
            raise APIError(400, "an input string is empty", "empty_input", "input")
        at_least = lm.bound.at_least(text)
        if at_least > lm.embedder.n_ctx:
            raise APIError(400, f"each input must have 1 to {lm.embedder.n_ctx} tokens; one has "
                           f"at least {at_least}", "context_length_exceeded", "input")
    if texts:
        tokenized = iter(await svc.prepare(lm, sum(len(t) for t in texts), client,
                                           lambda: [lm.model.tokenize(t, True) for t in texts]))
        items = [next(tokenized) if isinstance(item, str) else item for item in items]
    out = []
    for item in items:
        check_tokens(lm, item, "input")
        if not 0 < len(item) <= lm.embedder.n_ctx:
            raise APIError(400, f"each input must have 1 to {lm.embedder.n_ctx} tokens; one has "
                           f"{len(item)}", "context_length_exceeded", "input")
        out.append(item)
    return out


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":   # little-endian float32, as OpenAI sends (the SDK's default)
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, http: HTTPRequest) -> dict:
    return await embed(http.app.state.service, body, HTTPClient(http))


async def embed(svc: Service, body: EmbeddingRequest, client: Client) -> dict:
    """The route's answer (a Batch API line's too)."""
    check_fields(body, frozenset())
    lm = await svc.get(body.model, client, body.keep_alive)
    if body.dimensions is not None and body.dimensions != lm.embedder.n_embd:
        raise APIError(400, f"dimensions must be {lm.embedder.n_embd} for '{lm.name}' (vectors "
                       "are not truncated)", "unsupported_parameter", "dimensions")
    inputs = await _inputs(svc, lm, body.input, client)
    await svc.reserve_embedding(lm)   # its context counts against the memory budget
    loop = asyncio.get_running_loop()
    vectors = await loop.run_in_executor(lm.embed_executor,
                                         lambda: [lm.embedder.embed(t) for t in inputs])
    n_tokens = sum(len(t) for t in inputs)
    fmt = body.encoding_format or "float"
    return {"object": "list", "model": lm.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
