"""CORS for browsers: PAGEDLLAMA_CORS_ORIGINS (comma-separated origins, or `*`); unset = no CORS
headers at all. Starlette's CORSMiddleware is a pure ASGI middleware (not BaseHTTPMiddleware), so
client disconnects still reach the routes and cancel their requests."""
from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def origins_from_env() -> list[str]:
    raw = os.environ.get("PAGEDLLAMA_CORS_ORIGINS", "")
    return [o.strip() for o in raw.split(",") if o.strip()]


def install(app: FastAPI, origins: list[str]) -> None:
    """Answer preflight OPTIONS and add CORS headers for these origins (nothing when empty)."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
