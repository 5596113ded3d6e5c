"""CORS for browsers: the origins of PAGEDLLAMA_CORS_ORIGINS (server/config.py); none = no CORS
headers at all. Starlette's CORSMiddleware is a pure ASGI middleware (not BaseHTTPMiddleware), so
client disconnects still reach the routes and cancel their requests."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def install(app: FastAPI, origins: list[str]) -> None:
    """Answer preflight OPTIONS and add CORS headers for these origins (nothing when empty)."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
