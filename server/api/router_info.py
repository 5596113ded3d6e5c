"""What some routers in front of several replicas ask each of them (sglang-router's and smg's
names; `make cluster`'s HAProxy reads /health only):

- GET /server_info (and its older name /get_server_info): `served_model_name`, which the router
  uses as the worker's model id, plus batch limits. Served only when the server serves exactly
  one model: with several, the router keeps the worker's model "unknown" and forwards every
  request, and our own routing by `model` applies.
- GET /model_info (/get_model_info): model path, type and architecture, read from the GGUF.
- GET /get_load: one entry per llama.cpp context, `num_tokens` = KV cells in use (the
  router's power_of_two policy compares it between workers).

All answer from plain reads, like /health; none is behind PAGEDLLAMA_API_KEY.
"""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from server.service.loading import LoadedModel
from server.service.service import Service

router = APIRouter(include_in_schema=False)


def _service(http: HTTPRequest) -> Service | None:
    svc = getattr(http.app.state, "service", None)
    return svc if svc is not None and svc.loaded else None


def _loading() -> JSONResponse:
    return JSONResponse({"error": "loading"}, status_code=503)


def _only_model(svc: Service) -> LoadedModel | None:
    return next(iter(svc.loaded.values())) if len(svc.loaded) == 1 else None


def server_info(svc: Service) -> dict:
    info: dict = {"max_running_requests": sum(w.config.max_seqs for lm in svc.loaded.values()
                                              for w in lm.workers),
                  "models": list(svc.loaded)}
    lm = _only_model(svc)
    if lm is not None:
        info.update(served_model_name=lm.name, model_path=str(lm.spec.path))
    return info


def model_info(svc: Service) -> dict:
    lm = _only_model(svc)
    if lm is None:
        return {"is_generation": True}
    arch = lm.facts.get("architecture")
    return {"model_path": str(lm.spec.path), "tokenizer_path": None, "is_generation": True,
            "model_type": arch, "architectures": [arch] if arch else None}


def loads(svc: Service) -> list[dict]:
    out = []
    for lm in svc.loaded.values():
        for w in lm.workers:
            stats = w.snapshot()
            out.append({"dp_rank": len(out), "num_reqs": stats.running + stats.waiting,
                        "num_waiting_reqs": stats.waiting,
                        "num_tokens": stats.kv_used_blocks * w.config.block_size})
    return out


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(http: HTTPRequest):
    svc = _service(http)
    return server_info(svc) if svc else _loading()


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(http: HTTPRequest):
    svc = _service(http)
    return model_info(svc) if svc else _loading()


@router.get("/get_load")
async def get_load(http: HTTPRequest):
    svc = _service(http)
    return loads(svc) if svc else _loading()
