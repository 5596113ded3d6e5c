"""The FastAPI app: `uvicorn server.main:app`."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server import errors, native, openai_api
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


app = FastAPI(title="pagedllama", lifespan=lifespan)
errors.install(app)
app.include_router(openai_api.router)
app.include_router(native.router)


@app.middleware("http")
async def api_key_auth(request: Request, call_next):
    settings = getattr(request.app.state, "settings", None)
    key = settings.api_key if settings else None
    if key and request.url.path.startswith("/v1") or key and request.url.path == "/generate_stream":
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse(errors.error_body(401, "invalid or missing API key",
                                                  "invalid_api_key"), status_code=401)
    return await call_next(request)
