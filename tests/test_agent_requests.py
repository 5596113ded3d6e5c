"""Request bodies recorded from real agent sessions (tests/fixtures/agents/: Claude Code 2.1.197,
Codex CLI 0.171.0, opencode 1.18.33, through `python -m benchmarks.agents --record`), and later
turns built from their shape (tests/agent_turns.py: histories with thinking, tool calls and
their results), posted as the agents send them to a real server with a context that holds them:
accepted, answered in the shape the agent reads, context edits applied, and later turns read
from the prefix cache.

Claude Code's prompt is ~20,000 tokens, minutes of compute on this CPU: its whole bodies go
through count_tokens (the same conversion, rendering and tokenization as /v1/messages, every
field checked), and are streamed with their long texts cut short, every item and field kept as
sent (`shortened`: ~4,200 tokens, the tool schemas are most of them); `make agents` runs Claude
Code itself end to end. Codex's and opencode's are streamed shortened the same way (Codex's
8,700 tokens took most of a minute here)."""
import json
from pathlib import Path

import httpx
import pytest

from server.anthropic.context import CLEARED_RESULT
from server.openai import sealing
from tests import agent_turns
from tests.server_proc import running_server

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
OUTPUT = 8      # PAGEDLLAMA_MAX_OUTPUT: every answer is cut here


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    with running_server({"PAGEDLLAMA_N_CTX": "32768", "PAGEDLLAMA_N_CTX_BEYOND_TRAINED": "1",
                         "PAGEDLLAMA_MAX_SEQS": "2", "PAGEDLLAMA_MAX_OUTPUT": str(OUTPUT),
                         "PAGEDLLAMA_STATE_DIR": str(tmp_path_factory.mktemp("state")),
                         "PAGEDLLAMA_REASONING_KEY": agent_turns.REASONING_KEY},
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


OPAQUE = frozenset({"encrypted_content", "signature"})   # tokens a server opens or checks


def shortened(body: dict, limit: int = 120) -> dict:
    """A body with every string longer than `limit` characters cut to it (texts and
    descriptions, at any depth; schemas' names and types are short): the same items, fields
    and tools, a prompt a fraction as long. Opaque tokens (sealed reasoning, signatures) are
    kept whole: they are not text, and one cut short no longer opens."""
    def cut(value, key=None):
        if isinstance(value, str):
            return value if key in OPAQUE else value[:limit]
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: cut(v, k) for k, v in value.items()}
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
    assert codex_usage(events)["input_tokens"] > 1_000
    assert "response.output_item.done" in kinds


def codex_usage(events: list[dict]) -> dict:
    """The usage of a streamed response that ended as it may: cut at PAGEDLLAMA_MAX_OUTPUT
    (incomplete), or ended by the model (Codex sends no temperature: sampled at 1.0, unseeded)."""
    kind, final = events[-1]["type"], events[-1]["response"]
    assert kind in ("response.incomplete", "response.completed")
    output = final["usage"]["output_tokens"]
    assert 0 <= output <= OUTPUT
    if kind == "response.incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert output == OUTPUT
    else:
        assert final["incomplete_details"] is None
    return final["usage"]


def test_codexs_second_turn_reads_its_first_prompt_from_the_cache(agent_server):
    first = shortened(fixture("codex-turn1-1")["body"])
    first_prompt = httpx.post(f"{agent_server}/v1/responses", timeout=600, json={
        **first, "stream": False}).json()["usage"]["input_tokens"]
    resp, events = replay(agent_server, "codex-turn2-1",
                          shortened(fixture("codex-turn2-1")["body"]))
    assert resp.status_code == 200, resp.text
    usage = events[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= first_prompt - 64


def test_opencodes_title_request_is_answered_with_max_tokens_capped(agent_server):
    resp, events = replay(agent_server, "opencode-turn1-1")
    chat_stream(resp, events)
    assert fixture("opencode-turn1-1")["body"]["max_tokens"] == 32000
    assert "tools" not in fixture("opencode-turn1-1")["body"]


def test_opencodes_main_requests_stream_with_its_tools_and_its_second_turn_is_cached(
        agent_server):
    first = shortened(fixture("opencode-turn1-2")["body"])
    assert len(first["tools"]) == 10 and first["tool_choice"] == "auto"
    resp, events = replay(agent_server, "opencode-turn1-2", first)
    usage = chat_stream(resp, events)
    assert usage["prompt_tokens"] > 1_000
    resp, events = replay(agent_server, "opencode-turn2-1",
                          shortened(fixture("opencode-turn2-1")["body"]))
    again = chat_stream(resp, events)
    assert again["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64


def chat_stream(resp: httpx.Response, events: list[dict]) -> dict:
    """A streamed chat completion as opencode reads it (chunks, a finish reason, the usage chunk
    `stream_options.include_usage` asks for last, with no choices); its usage."""
    assert resp.status_code == 200, resp.text
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert any(c.get("finish_reason") for e in events for c in e["choices"])
    assert events[-1]["choices"] == []
    usage = events[-1]["usage"]
    assert 0 < usage["completion_tokens"] <= OUTPUT
    return usage


# ---- Claude Code, streamed as it asks ----------------------------------------------------------
CLAUDE_PATH = "/v1/messages?beta=true"   # Claude Code's route (the recorder kept the path only)
CLAUDE_LIMIT = 40    # its texts cut to this: ~4,200 tokens, most of them its 24 tools' schemas


def claude(base: str, name: str) -> tuple[dict, list[dict]]:
    """A Claude Code body, shortened, streamed to its route with its headers: the body sent and
    the events."""
    recorded = fixture(name)
    assert recorded["path"].split("?")[0] == "/v1/messages" and recorded["body"]["stream"]
    body = shortened(recorded["body"], CLAUDE_LIMIT)
    resp, events = sse(base, CLAUDE_PATH, body,
                       {k: v for k, v in recorded["headers"].items() if k != "user-agent"})
    assert resp.status_code == 200, resp.text
    return body, events


def claude_events(events: list[dict]) -> dict:
    """Check the events are in the order Claude Code reads them: message_start, each content
    block (content_block_start, its deltas, content_block_stop; indexes 0, 1, ...), pings while
    it waits, message_delta (stop reason, usage), message_stop. The message_delta."""
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    opened, index = False, -1
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert not opened and event["index"] == index + 1
            opened, index = True, index + 1
        elif event["type"] != "ping":
            assert opened and event["index"] == index
            assert event["type"] in ("content_block_delta", "content_block_stop")
            opened = event["type"] == "content_block_delta"
    assert not opened and index >= 0
    delta = events[-2]
    # Claude Code sends no temperature: the answer is sampled at 1.0, unseeded, and may end
    # itself before PAGEDLLAMA_MAX_OUTPUT cuts it.
    reason, output = delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]
    assert reason in ("max_tokens", "end_turn", "tool_use")
    assert 0 <= output <= OUTPUT and (reason != "max_tokens" or output == OUTPUT)
    return delta


def count(base: str, body: dict) -> dict:
    """count_tokens of a Messages body."""
    resp = httpx.post(f"{base}/v1/messages/count_tokens", timeout=120, json={
        k: v for k, v in body.items() if k not in ("max_tokens", "stream")})
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt_of(usage: dict) -> int:
    return (usage["input_tokens"] + usage["cache_creation_input_tokens"]
            + usage["cache_read_input_tokens"])


def test_claude_codes_first_request_streams_the_events_it_reads(agent_server):
    body, events = claude(agent_server, "claude-turn1-1")
    delta = claude_events(events)
    prompt = count(agent_server, body)["input_tokens"]
    assert prompt > 3_000
    assert prompt_of(events[0]["message"]["usage"]) == prompt == prompt_of(delta["usage"])
    assert delta["context_management"] == {"applied_edits": []}   # it asks to keep all thinking


def test_claude_codes_second_turn_reads_its_first_prompt_from_the_cache(agent_server):
    first, _ = claude(agent_server, "claude-turn1-1")
    _, events = claude(agent_server, "claude-turn2-1")
    claude_events(events)
    read = events[0]["message"]["usage"]["cache_read_input_tokens"]
    assert read >= count(agent_server, first)["input_tokens"] - 64


# ---- later turns built from the recordings' shape ----------------------------------------------
@pytest.mark.parametrize("name", sorted(agent_turns.BUILT))
def test_the_built_turns_are_what_tests_agent_turns_builds(name, tmp_path):
    sealing.configure(agent_turns.REASONING_KEY, tmp_path)

    def opened(turn: dict) -> dict:       # sealed tokens differ on every build: their texts
        for item in turn["body"].get("input", []):
            if "encrypted_content" in item:
                item["encrypted_content"] = sealing.unseal(item["encrypted_content"])
        return turn
    try:
        on_file, built = opened(fixture(name)), opened(agent_turns.BUILT[name]())
    finally:
        sealing.configure(None, None)
    assert on_file == built
    source = fixture(name.replace("turn3-built", "turn2-1"))
    grown = "messages" if "messages" in source["body"] else "input"
    assert {k: v for k, v in on_file["body"].items() if k not in (grown, "context_management")} \
        == {k: v for k, v in source["body"].items() if k not in (grown, "context_management")}
    assert on_file["body"][grown][:2] == source["body"][grown][:2]


def _blocks(message: dict) -> list[dict]:
    return message["content"] if isinstance(message["content"], list) else []


def cleared_by_hand(body: dict, thinking: bool, results: bool) -> dict:
    """The built Claude Code turn as its edits leave it, without edits: the thinking of every
    turn but the last one that thought (a turn ends at a user message with no tool_result), and
    every tool result but the last, cleared."""
    messages = json.loads(json.dumps(body["messages"]))
    asks = [i for i, m in enumerate(messages) if m["role"] == "user"
            and not any(b.get("type") == "tool_result" for b in _blocks(m))]
    if results:
        for block in [b for m in messages for b in _blocks(m) if b["type"] == "tool_result"][:-1]:
            block["content"] = CLEARED_RESULT
    if thinking:
        kept = []
        for i, m in enumerate(messages):
            if i < asks[-2] and m["role"] == "assistant":
                m["content"] = [b for b in _blocks(m) if b["type"] != "thinking"]
                if not m["content"]:
                    continue
            kept.append(m)
        messages = kept
    return {**body, "messages": messages, "context_management": None}


def test_a_later_claude_code_turn_has_its_old_thinking_and_tool_results_cleared(agent_server):
    """The whole built body, counted: the prompt it renders is the history with the first
    turn's thinking and the Bash result cleared, as if the client had cleared them."""
    body = fixture("claude-turn3-built")["body"]
    kinds = {b["type"] for m in body["messages"] for b in _blocks(m)}
    assert {"thinking", "tool_use", "tool_result"} <= kinds
    edited = count(agent_server, body)
    unedited = count(agent_server, {**body, "context_management": None})["input_tokens"]
    cleared = count(agent_server, cleared_by_hand(body, True, True))["input_tokens"]
    assert edited == {"input_tokens": cleared,
                      "context_management": {"original_input_tokens": unedited}}
    assert cleared < unedited


def test_a_later_claude_code_turn_streams_with_its_edits_applied(agent_server):
    first, _ = claude(agent_server, "claude-turn1-1")
    body, events = claude(agent_server, "claude-turn3-built")
    delta = claude_events(events)
    counts = [count(agent_server, cleared_by_hand(body, thinking, results))["input_tokens"]
              for thinking, results in ((False, False), (True, False), (True, True))]
    assert delta["context_management"]["applied_edits"] == [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 1,
         "cleared_input_tokens": counts[0] - counts[1]},   # 0 here: SmolLM2 shows no thinking
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1,
         "cleared_input_tokens": counts[1] - counts[2]}]
    assert counts[1] > counts[2]
    assert prompt_of(events[0]["message"]["usage"]) == counts[2]
    read = events[0]["message"]["usage"]["cache_read_input_tokens"]
    assert read >= count(agent_server, first)["input_tokens"] - 64


def responses_prompt(base: str, body: dict) -> int:
    resp = httpx.post(f"{base}/v1/responses", timeout=600, json={**body, "stream": False})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["input_tokens"]


def test_a_later_codex_turn_with_reasoning_and_a_tool_call_streams_from_the_cache(agent_server):
    before = responses_prompt(agent_server, shortened(fixture("codex-turn2-1")["body"]))
    body = shortened(fixture("codex-turn3-built")["body"])
    assert {"reasoning", "function_call", "function_call_output"} <= {
        item["type"] for item in body["input"]}
    resp, events = replay(agent_server, "codex-turn3-built", body)
    assert resp.status_code == 200, resp.text        # its sealed reasoning opened
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.done" in kinds
    usage = codex_usage(events)
    assert usage["input_tokens_details"]["cached_tokens"] >= before - 64
    # the call and its output are in the prompt: emptied, it is shorter
    for kind, field, empty in (("function_call", "arguments", "{}"),
                               ("function_call_output", "output", "")):
        emptied = json.loads(json.dumps(body))
        for item in emptied["input"]:
            if item["type"] == kind:
                item[field] = empty
        assert responses_prompt(agent_server, emptied) < usage["input_tokens"]
