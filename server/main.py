"""The FastAPI app: `uvicorn server.main:app`."""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from server.api import (
    anthropic,
    batches,
    completions,
    embeddings,
    models,
    native,
    observability,
    ollama,
    responses,
    router_info,
)
from server.batch.runner import BatchRunner
from server.config import cors_origins, load_settings
from server.http import cors, errors, exposure, openapi, protocol
from server.http.client import ModelLeases
from server.http.drain import Drain
from server.http.edge import Edge
from server.openai import sealing
from server.service.service import Service

log = logging.getLogger("pagedllama.server")


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
    sealing.configure(settings.reasoning_key, settings.state_dir)
    uvicorn_server = protocol.uvicorn_server()    # before the drain takes SIGTERM from uvicorn
    service = Service(settings, _observer())
    service.start()
    service.catalog.start_reaper()   # unloads models idle past their keep_alive
    app.state.service = service
    drain = app.state.drain = Drain(settings.edge.drain_seconds, service.end_all)
    if protocol.install(settings.edge):       # before the drain takes SIGTERM from uvicorn
        log.info("HTTP limits: body %d bytes, header %d bytes, read timeout %g s, keep-alive "
                 "%g s", settings.edge.max_body_bytes, settings.edge.max_header_bytes,
                 settings.edge.read_timeout, settings.edge.keepalive_timeout)
    drain.install()
    # the Batch API's lines run in the background (server/batch/runner.py); unfinished batches
    # resume here
    runner = app.state.batches = BatchRunner(settings.batch, service, drain,
                                             partial(batches.answer_line, service))
    watch = getattr(service.observer, "watch_batches", None)
    if watch is not None:
        watch(runner.stats)
    await runner.start()
    # where uvicorn listens is known once it has bound its sockets, after this startup: a
    # WARNING then if that is beyond this machine without an API key (server/http/exposure.py)
    listening = asyncio.get_running_loop().create_task(
        exposure.report_when_listening(uvicorn_server, settings.api_key))
    try:
        yield
    finally:
        listening.cancel()
        drain.uninstall()
        await runner.stop()
        service.stop()


bearer = HTTPBearer(auto_error=False, description="PAGEDLLAMA_API_KEY, when it is set")
x_api_key = APIKeyHeader(name="x-api-key", auto_error=False,
                         description="PAGEDLLAMA_API_KEY, when it is set (Anthropic's clients)")


async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Security(bearer),
                          api_key: str | None = Security(x_api_key)):
    """With PAGEDLLAMA_API_KEY set, generation and model routes need `Authorization: Bearer KEY`
    or `x-api-key: KEY`. Declares both schemes in the OpenAPI schema. The check that matters
    runs earlier, in server/http/edge.py, before the body is read; this one repeats it
    (constant time)."""
    key = request.app.state.settings.api_key
    if not key:
        return
    bearer_ok = hmac.compare_digest(credentials.credentials.encode() if credentials else b"",
                                    key.encode())
    header_ok = hmac.compare_digest((api_key or "").encode(), key.encode())
    if not (bearer_ok or header_ok):
        raise errors.APIError(401, "invalid or missing API key", "invalid_api_key")


app = FastAPI(title="pagedllama", lifespan=lifespan)
errors.install(app)
openapi.install(app)
# Middleware: the last added runs first. CORS is outermost, so a preflight OPTIONS is answered
# before the edge asks for an API key, and the edge's own 401/413/503 answers get CORS headers;
# the edge then refuses (draining, key, body size) before any body is read or parsed; inside
# it, the models a request uses stay held until its answer has been sent.
app.add_middleware(ModelLeases)   # a request holds its models until its exchange ends
app.add_middleware(Edge)
cors.install(app, cors_origins())
app.include_router(completions.router, dependencies=[Depends(require_api_key)])
app.include_router(responses.router, dependencies=[Depends(require_api_key)])
app.include_router(anthropic.router, dependencies=[Depends(require_api_key)])
app.include_router(embeddings.router, dependencies=[Depends(require_api_key)])
app.include_router(batches.router, dependencies=[Depends(require_api_key)])
app.include_router(models.router, dependencies=[Depends(require_api_key)])
app.include_router(native.router, dependencies=[Depends(require_api_key)])
app.include_router(ollama.router, dependencies=[Depends(require_api_key)])
app.include_router(native.public)
app.include_router(observability.router)
app.include_router(router_info.router)   # what sglang-router probes on its workers
