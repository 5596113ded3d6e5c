"""The FastAPI app: `uvicorn server.main:app`."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from server import (cors, embeddings, errors, model_routes, native, observability, openai_api,
                    responses, router_info)
from server.config import load_settings
from server.service import Service


def _setup_logging(level: str) -> None:
    level_no = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=level_no, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllama").setLevel(level_no)
    # llama.cpp's own log is DEBUG-level: shown only with PAGEDLLAMA_LOG_LEVEL=debug
    logging.getLogger("pagedllama.llama_cpp").setLevel(level_no)


def _observer():
    try:
        from server.metrics import MetricsObserver
    except ImportError:
        return None
    return MetricsObserver()


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings = load_settings()
    _setup_logging(settings.log_level)
    app.state.settings = settings
    service = Service(settings, _observer())
    service.start()
    app.state.service = service
    try:
        yield
    finally:
        service.stop()


async def require_api_key(request: Request) -> None:
    """With PAGEDLLAMA_API_KEY set, generation and model routes need `Authorization: Bearer KEY`.
    (A dependency, not an HTTP middleware: BaseHTTPMiddleware hides client disconnects.)"""
    key = request.app.state.settings.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise errors.APIError(401, "invalid or missing API key", "invalid_api_key")


app = FastAPI(title="pagedllama", lifespan=lifespan)
errors.install(app)
cors.install(app, cors.origins_from_env())
app.include_router(openai_api.router, dependencies=[Depends(require_api_key)])
app.include_router(responses.router, dependencies=[Depends(require_api_key)])
app.include_router(embeddings.router, dependencies=[Depends(require_api_key)])
app.include_router(model_routes.router, dependencies=[Depends(require_api_key)])
app.include_router(native.router, dependencies=[Depends(require_api_key)])
app.include_router(native.public)
app.include_router(observability.router)
app.include_router(router_info.router)   # what sglang-router probes on its workers


