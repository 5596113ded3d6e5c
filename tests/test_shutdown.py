"""SIGTERM drains a real server: it stops admitting, lets running requests finish for up to
PAGEDLLAMA_DRAIN_SECONDS, ends the rest cleanly (SSE error event + [DONE], or a 503), exits."""
import json
import signal
import threading
import time

import httpx
import openai
from openai import OpenAI

from tests.server_proc import SMOLLM2_NAME, server_process

M = SMOLLM2_NAME
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def sse(base: str, path: str, body: dict, out: dict, started: threading.Event) -> None:
    """Read one SSE stream to its end: its data lines, and how it ended."""
    out["data"], out["ended"] = [], "closed"
    try:
        with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True},
                          timeout=120) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    out["data"].append(line[5:].strip())
                    started.set()
    except httpx.HTTPError as exc:          # e.g. "incomplete chunked read"
        out["ended"] = f"{type(exc).__name__}: {exc}"
    out["t"] = time.monotonic()


def whole(base: str, body: dict, out: dict) -> None:
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    out.update(status=resp.status_code, body=resp.json(), t=time.monotonic())


def openai_stream(base: str, out: dict, started: threading.Event) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        for _ in client.chat.completions.create(
                model=M, messages=[{"role": "user", "content": "Tell a long story."}],
                stream=True, extra_body={**LONG, "max_tokens": 1400}):
            started.set()
        out["ended"] = "finished"
    except openai.APIError as exc:
        out["ended"], out["message"] = type(exc).__name__, str(exc)


def wait_running(base: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ctx = httpx.get(f"{base}/health").json()["models"][M]["contexts"][0]
        if ctx["running"] >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests never ran together")


def test_sigterm_lets_short_requests_finish_and_ends_long_ones_cleanly():
    with server_process({"PAGEDLLAMA_DRAIN_SECONDS": "4"}) as server:
        base = server.base
        long_chat, long_text, short, plain, client, resp = {}, {}, {}, {}, {}, {}
        forked, listed = {}, {}
        events = [threading.Event() for _ in range(6)]
        chat_body = {"model": M, "messages": [{"role": "user", "content": "Tell a story."}]}
        threads = [
            threading.Thread(target=sse, args=(base, "/v1/chat/completions",
                                               {**chat_body, **LONG}, long_chat, events[0])),
            threading.Thread(target=sse, args=(base, "/v1/completions",
                                               {"model": M, "prompt": "Once", **LONG}, long_text,
                                               events[1])),
            threading.Thread(target=openai_stream, args=(base, client, events[2])),
            threading.Thread(target=whole, args=(base, {"model": M, "prompt": "Twice", **LONG},
                                                 plain)),
            threading.Thread(target=sse, args=(base, "/v1/responses",
                                               {"model": M, "input": "Tell a story.", **LONG},
                                               resp, events[4])),
            # n > 1 and a list of prompts: every choice (forks too) is ended by the drain
            threading.Thread(target=sse, args=(base, "/v1/completions",
                                               {"model": M, "prompt": "Thrice", "n": 2, **LONG},
                                               forked, events[5])),
            threading.Thread(target=whole, args=(base, {"model": M, "prompt": ["Four", "Five"],
                                                        "n": 2, **LONG}, listed)),
        ]
        for t in threads:
            t.start()
        for e in events[:3] + events[4:]:   # events[3]: the short request, sent later
            assert e.wait(60)
        wait_running(base, 11)              # 5 requests, 2 choices, 2 prompts x 2 choices

        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        time.sleep(0.3)
        short_thread = threading.Thread(target=sse, args=(
            base, "/v1/chat/completions", {**chat_body, "max_tokens": 5}, short, events[3]))
        short_thread.start()                 # arrives while draining: refused
        health = httpx.get(f"{base}/health")
        refused = httpx.post(f"{base}/v1/completions", json={"model": M, "prompt": "hi"})
        for t in threads + [short_thread]:
            t.join(60)
        exit_code = server.proc.wait(30)
        t_exit = time.monotonic()
        log = server.log()

    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "4"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert short["status"] == 503

    for stream in (long_chat, long_text):       # ended at the deadline, as SSE streams end
        assert stream["ended"] == "closed", stream["ended"]
        assert stream["data"][-1] == "[DONE]"
        error = json.loads(stream["data"][-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        assert 3.5 < stream["t"] - t_term < 8
    assert client["ended"] == "APIError" and "shutting down" in client["message"]
    # a /v1/responses stream ends with its typed error event (no [DONE] in that API)
    assert resp["ended"] == "closed", resp["ended"]
    last = json.loads(resp["data"][-1])
    assert last["type"] == "error" and last["code"] == "server_shutting_down"
    assert json.loads(resp["data"][-2])["type"] == "response.output_text.delta"
    assert plain["status"] == 503 and plain["body"]["error"]["code"] == "server_shutting_down"
    assert listed["status"] == 503 and listed["body"]["error"]["code"] == "server_shutting_down"
    # the n = 2 stream: both choices streamed, then one final error event and [DONE]
    assert forked["ended"] == "closed", forked["ended"]
    assert forked["data"][-1] == "[DONE]"
    assert json.loads(forked["data"][-2])["error"]["code"] == "server_shutting_down"
    chunks = [json.loads(d) for d in forked["data"][:-2]]
    assert {c["choices"][0]["index"] for c in chunks if c.get("choices")} == {0, 1}
    assert 3.5 < forked["t"] - t_term < 8

    assert exit_code in (0, -signal.SIGTERM) and t_exit - t_term < 12
    assert "ASGI callable returned without completing response" not in log
    assert "ended 7 request(s) still running" in log


def test_sigterm_exits_as_soon_as_running_requests_finish():
    with server_process({"PAGEDLLAMA_DRAIN_SECONDS": "60"}) as server:
        out, started = {}, threading.Event()
        body = {"model": M, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True}
        thread = threading.Thread(target=sse, args=(server.base, "/v1/completions", body, out,
                                                    started))
        thread.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        thread.join(60)
        server.proc.wait(30)
        waited = time.monotonic() - t_term
    finish = json.loads(out["data"][-2])["choices"][0]["finish_reason"]
    assert out["data"][-1] == "[DONE]" and finish == "length"
    assert waited < 10
