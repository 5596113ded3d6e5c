"""Request bodies recorded from real agent sessions (tests/fixtures/agents/: Claude Code 2.1.197,
Codex CLI 0.171.0, opencode 1.18.33, through `python -m benchmarks.agents --record`), posted as
they were sent to a real server with a context that holds them: accepted, answered in the shape
the agent reads, and later turns read from the prefix cache.

Claude Code's prompt is ~20,000 tokens, minutes of compute on this CPU, so its bodies go through
count_tokens (the same conversion, rendering and tokenization as /v1/messages, every field
checked); `make agents` runs Claude Code itself end to end. Codex's and opencode's are computed;
Codex's with its long texts (instructions, tool descriptions) cut short, every item and field
kept as sent (`shortened`): its 8,700 tokens took most of a minute here."""
import json
from pathlib import Path

import httpx
import pytest

from tests.server_proc import running_server

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
OUTPUT = 8      # PAGEDLLAMA_MAX_OUTPUT: every answer is cut here


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    with running_server({"PAGEDLLAMA_N_CTX": "32768", "PAGEDLLAMA_N_CTX_BEYOND_TRAINED": "1",
                         "PAGEDLLAMA_MAX_SEQS": "2", "PAGEDLLAMA_MAX_OUTPUT": str(OUTPUT),
                         "PAGEDLLAMA_STATE_DIR": str(tmp_path_factory.mktemp("state"))},
                        startup_timeout=180) as base:
        yield base


def sse(base: str, path: str, body: dict, headers: dict) -> tuple[httpx.Response, list[dict]]:
    """A streamed request's response and its JSON events."""
    events = []
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=600) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, events
        for line in resp.iter_lines():
            if line.startswith("data: ") and line[6:].startswith("{"):
                events.append(json.loads(line[6:]))
    return resp, events


def replay(base: str, name: str, body: dict | None = None) -> tuple[httpx.Response, list[dict]]:
    recorded = fixture(name)
    headers = {k: v for k, v in recorded["headers"].items() if k != "user-agent"}
    return sse(base, recorded["path"], body or recorded["body"], headers)


def shortened(body: dict, limit: int = 120) -> dict:
    """A recorded body with every string longer than `limit` characters cut to it (texts and
    descriptions, at any depth; schemas' names and types are short): the same items, fields
    and tools, a prompt a fraction as long."""
    def cut(value):
        if isinstance(value, str):
            return value[:limit]
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value
    return cut(body)


@pytest.mark.parametrize("name", ["claude-turn1-1", "claude-turn2-1"])
def test_claude_codes_requests_are_accepted_field_for_field(agent_server, name):
    recorded = fixture(name)
    body = {k: v for k, v in recorded["body"].items() if k not in ("max_tokens", "stream")}
    for field in ("thinking", "context_management", "output_config", "metadata"):
        assert field in body                       # what made these a 400 before
    resp = httpx.post(f"{agent_server}/v1/messages/count_tokens", json=body, timeout=120,
                      headers=recorded["headers"])
    assert resp.status_code == 200, resp.text
    counted = resp.json()
    assert counted["input_tokens"] > 18_000
    assert counted["context_management"] == {"original_input_tokens": counted["input_tokens"]}


def test_claude_codes_billing_header_is_left_out_of_the_prompt(agent_server):
    body = fixture("claude-turn1-1")["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    counts = []
    for system in (body["system"], body["system"][1:]):
        counts.append(httpx.post(f"{agent_server}/v1/messages/count_tokens", timeout=120, json={
            "model": body["model"], "system": system, "messages": body["messages"],
            "tools": body["tools"]}).json()["input_tokens"])
    assert counts[0] == counts[1]


def test_codexs_first_request_streams_a_response_without_its_hosted_tool(agent_server):
    resp, events = replay(agent_server, "codex-turn1-1",
                          shortened(fixture("codex-turn1-1")["body"]))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pagedllama-ignored-tools"] == "web_search"
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"        # cut at PAGEDLLAMA_MAX_OUTPUT
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] == OUTPUT and final["usage"]["input_tokens"] > 1_000
    assert "response.output_item.done" in kinds


def test_codexs_second_turn_reads_its_first_prompt_from_the_cache(agent_server):
    first = shortened(fixture("codex-turn1-1")["body"])
    first_prompt = httpx.post(f"{agent_server}/v1/responses", timeout=600, json={
        **first, "stream": False}).json()["usage"]["input_tokens"]
    resp, events = replay(agent_server, "codex-turn2-1",
                          shortened(fixture("codex-turn2-1")["body"]))
    assert resp.status_code == 200, resp.text
    usage = events[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= first_prompt - 64


def test_opencodes_requests_are_answered_with_max_tokens_capped(agent_server):
    """Its title request (its main one, ~7,600 tokens, takes the path Codex's does)."""
    for name in ("opencode-turn1-1",):
        resp, events = replay(agent_server, name)
        assert resp.status_code == 200, resp.text
        assert fixture(name)["body"]["max_tokens"] == 32000
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        assert usage["completion_tokens"] <= OUTPUT
        assert any(c.get("finish_reason") for e in events for c in e.get("choices", []))
