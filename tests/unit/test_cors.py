"""CORS: configured origins get preflights answered and headers added; none configured, none."""
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.config import cors_origins
from server.http import cors


def app_with(origins: list[str]) -> TestClient:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {"ok": True}

    cors.install(app, origins)
    return TestClient(app)


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_origins_are_read_comma_separated_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLAMA_CORS_ORIGINS", " http://a.test , http://b.test,")
    assert cors_origins() == ["http://a.test", "http://b.test"]


def test_no_origins_configured_means_no_cors_headers(monkeypatch):
    monkeypatch.delenv("PAGEDLLAMA_CORS_ORIGINS", raising=False)
    client = app_with(cors_origins())
    resp = client.post("/v1/chat/completions", headers={"Origin": "http://localhost:3000"})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_a_preflight_from_an_allowed_origin_is_answered():
    resp = app_with(["http://localhost:3000"]).options("/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()


def test_a_preflight_from_another_origin_gets_no_allow_origin():
    resp = app_with(["http://localhost:3000"]).options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in resp.headers


def test_a_wildcard_allows_any_origin_on_a_simple_request():
    resp = app_with(["*"]).post("/v1/chat/completions", headers={"Origin": "http://x.test"})
    assert resp.headers["access-control-allow-origin"] == "*"
