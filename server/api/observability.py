"""GET /metrics (Prometheus), GET /stats (JSON snapshot), GET /dashboard (live charts page).

All three answer from the event loop with plain reads of counters and worker snapshots: none
waits for the engine, so they stay fast while a long llama_decode runs.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.http.openapi import NOT_READY
from server.metrics import MetricsObserver

router = APIRouter()
DASHBOARD = Path(__file__).resolve().parent.parent / "static" / "dashboard.html"   # server/static


def _observer(http: HTTPRequest) -> MetricsObserver | None:
    svc = getattr(http.app.state, "service", None)
    obs = getattr(svc, "observer", None)
    if not isinstance(obs, MetricsObserver):
        return None
    obs.watch(lambda: svc.workers)
    obs.watch_catalog(lambda: svc.catalog)
    return obs


def _unavailable() -> JSONResponse:
    return JSONResponse({"error": "metrics are not available (server loading)"}, status_code=503)


@router.get("/metrics", include_in_schema=False)
async def metrics(http: HTTPRequest):
    obs = _observer(http)
    if obs is None:
        return _unavailable()
    # The classic text format (what Prometheus scrapes by default); prometheus_client 0.26's
    # OpenMetrics writer would rewrite our `pagedllama:` colons to underscores.
    return Response(generate_latest(obs.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats", responses=NOT_READY)
async def stats(http: HTTPRequest):
    obs = _observer(http)
    return obs.stats() if obs else _unavailable()


@router.get("/dashboard", include_in_schema=False)
async def dashboard():
    return FileResponse(DASHBOARD, media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root(http: HTTPRequest):
    """What a client probing the base URL gets (Claude Code sends `HEAD /` before its first
    request): 200; "Ollama is running" as Ollama answers (clients that find an Ollama server
    this way), or with `Accept: application/json` where to look next."""
    if "application/json" in http.headers.get("accept", ""):
        return {"name": "pagedllama", "status": "ok", "health": "/health",
                "models": "/v1/models", "docs": "/docs"}
    return PlainTextResponse("Ollama is running")
