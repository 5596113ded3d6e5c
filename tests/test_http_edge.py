"""The HTTP edge of a real `uvicorn server.main:app`: timeouts, header limit, API key, and an
OpenAPI schema that says what the server does."""
import socket
import time

import httpx
import pytest

from tests.server_proc import SMOLLM2_NAME, running_server

KEY = "s3cret-key"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def edge_server():
    """Short timeouts (1 s) so the tests can wait them out."""
    with running_server({"PAGEDLLAMA_READ_TIMEOUT": "1", "PAGEDLLAMA_KEEPALIVE_TIMEOUT": "1"}) as base:
        yield base


@pytest.fixture(scope="module")
def key_server():
    with running_server({"PAGEDLLAMA_API_KEY": KEY, "PAGEDLLAMA_PROTECT_METRICS": "1",
                         "PAGEDLLAMA_CORS_ORIGINS": ORIGIN}) as base:
        yield base


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    t0, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


# ---- timeouts ----------------------------------------------------------------------------------------
def test_a_connection_that_sends_nothing_is_closed_after_the_keepalive_timeout(edge_server):
    with connect(edge_server) as sock:
        data, waited = read_until_closed(sock)
    assert data == b"" and 0.8 < waited < 3


def test_a_request_head_that_trickles_in_gets_408_after_the_read_timeout(edge_server):
    with connect(edge_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        time.sleep(0.6)
        sock.sendall(b"x-slow: 1\r\n")             # progress does not reset the deadline
        data, waited = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and waited < 2.5


def test_a_body_shorter_than_its_content_length_gets_408(edge_server):
    with connect(edge_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100\r\n\r\n{\"model\": ")
        data, waited = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and waited < 3


def test_a_keepalive_connection_serves_requests_within_the_timeout(edge_server):
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with connect(edge_server) as sock:
        for _ in range(3):
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.5)                        # idle, but less than the 1 s timeout


def test_a_1mb_header_gets_431_not_a_reset(server_url):
    resp = httpx.get(f"{server_url}/health", headers={"x-big": "a" * 1_000_000}, timeout=10)
    assert resp.status_code == 431


def test_the_server_serves_normally_after_edge_errors(edge_server):
    for _ in range(2):
        with connect(edge_server) as sock:
            sock.sendall(b"GET /hea")
            read_until_closed(sock)
    assert httpx.get(f"{edge_server}/health").status_code == 200


# ---- API key ----------------------------------------------------------------------------------------
def test_a_wrong_key_is_a_401_and_the_right_one_answers(key_server):
    body = {"model": SMOLLM2_NAME, "prompt": "Hi", "max_tokens": 2}
    wrong = httpx.post(f"{key_server}/v1/completions", json=body,
                       headers={"authorization": f"Bearer {KEY}x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert wrong.headers["www-authenticate"] == "Bearer"
    right = httpx.post(f"{key_server}/v1/completions", json=body,
                       headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert right.status_code == 200, right.text


def test_the_key_may_come_as_x_api_key_and_a_wrong_one_is_a_401(key_server):
    body = {"model": SMOLLM2_NAME, "prompt": "Hi", "max_tokens": 2}
    wrong = httpx.post(f"{key_server}/v1/completions", json=body, headers={"x-api-key": "no"})
    right = httpx.post(f"{key_server}/v1/completions", json=body, headers={"x-api-key": KEY},
                       timeout=60)
    assert wrong.status_code == 401 and right.status_code == 200, right.text


def test_401_comes_before_the_body_is_read(key_server):
    with connect(key_server) as sock:              # announces 1 MB, sends none of it
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                     b"1000000\r\ncontent-type: application/json\r\n\r\n")
        t0 = time.monotonic()
        response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", f"/v1/models/{SMOLLM2_NAME}"), ("GET", "/v1/models"),
    ("POST", "/generate_stream")])
def test_every_api_route_needs_the_key_before_its_body_is_parsed(key_server, method, path):
    resp = httpx.request(method, f"{key_server}{path}", content=b"{not json")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_tokenize_answers_with_the_key(key_server):
    resp = httpx.post(f"{key_server}/tokenize", json={"content": "Hello"},
                      headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200 and resp.json()["tokens"]


@pytest.mark.parametrize("value,status", [(f"bearer {KEY}", 200), (f"BEARER {KEY}", 200),
                                          (f"Basic {KEY}", 401), (f"Bearer {KEY}x", 401)])
def test_the_auth_scheme_is_case_insensitive_and_the_key_is_not(key_server, value, status):
    resp = httpx.post(f"{key_server}/tokenize", json={"content": "Hello"},
                      headers={"authorization": value})
    assert resp.status_code == status


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/model_info", "/get_load"])
def test_the_router_probes_stay_open_with_a_key(key_server, path):
    assert httpx.get(f"{key_server}{path}").status_code == 200


def test_a_cors_preflight_is_answered_before_the_key_is_asked_for(key_server):
    resp = httpx.options(f"{key_server}/v1/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == ORIGIN


def test_the_edge_refusals_carry_cors_headers(key_server):
    resp = httpx.post(f"{key_server}/v1/chat/completions", json={}, headers={"origin": ORIGIN})
    assert resp.status_code == 401
    assert resp.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("path", ["/metrics", "/stats", "/dashboard", "/docs", "/openapi.json"])
def test_protect_metrics_puts_observability_behind_the_key(key_server, path):
    assert httpx.get(f"{key_server}{path}").status_code == 401
    assert httpx.get(f"{key_server}{path}",
                     headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_health_stays_open_with_a_key(key_server):
    assert httpx.get(f"{key_server}/health").status_code == 200


def test_observability_is_open_without_protect_metrics(server_url):
    assert httpx.get(f"{server_url}/metrics").status_code == 200


# ---- OpenAPI ----------------------------------------------------------------------------------------
def operations(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            yield path, method, op


def test_openapi_documents_400_errors_and_never_422(server_url):
    schema = httpx.get(f"{server_url}/openapi.json").json()
    posts = [(p, op) for p, m, op in operations(schema) if m == "post"]
    assert posts and all("422" not in op["responses"] for _, _, op in operations(schema))
    for path, op in posts:   # each route's errors in the shape of its API
        error = op["responses"]["400"]["content"]["application/json"]["schema"]
        shape = ("AnthropicErrorResponse" if path.startswith("/v1/messages") else
                 "OllamaErrorResponse" if path.startswith("/api/") else "ErrorResponse")
        assert error == {"$ref": f"#/components/schemas/{shape}"}, path
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_openapi_documents_event_streams(server_url):
    paths = httpx.get(f"{server_url}/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/generate_stream", "/v1/responses"):
        assert "text/event-stream" in paths[path]["post"]["responses"]["200"]["content"], path
    for path in ("/api/chat", "/api/generate"):   # Ollama's: NDJSON
        assert "application/x-ndjson" in paths[path]["post"]["responses"]["200"]["content"]


def test_openapi_declares_the_bearer_scheme_only_where_a_key_is_required(server_url, key_server):
    open_schema = httpx.get(f"{server_url}/openapi.json").json()
    assert "securitySchemes" not in open_schema["components"]
    keyed = httpx.get(f"{key_server}/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()
    assert keyed["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert keyed["components"]["securitySchemes"]["APIKeyHeader"]["name"] == "x-api-key"
    secured = {p for p, _, op in operations(keyed) if op.get("security")}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/generate_stream",
            "/v1/responses", "/v1/embeddings", "/v1/models/{model_id}", "/tokenize",
            "/detokenize", "/api/chat", "/api/generate", "/api/tags", "/api/ps"} <= secured
    assert "/health" not in secured


def test_ollamas_routes_need_the_key_and_refuse_in_ollamas_shape(key_server):
    refused = httpx.post(f"{key_server}/api/chat", json={"model": "x", "messages": []})
    assert refused.status_code == 401 and list(refused.json()) == ["error"]
    listed = httpx.get(f"{key_server}/api/tags", headers={"authorization": f"Bearer {KEY}"})
    assert listed.status_code == 200 and listed.json()["models"]
    assert httpx.get(f"{key_server}/").text == "Ollama is running"   # the probe stays open
