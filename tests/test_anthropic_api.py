"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK against a real server: messages, streams, tools, token counts, every error type
in Anthropic's shape, and the fields the server refuses rather than ignores.

This SDK version has no `temperature` argument on messages.create, so greedy decoding is asked
for through `extra_body`, as a client would send Anthropic's field."""
import json
import signal
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from tests.devices import cpu_timing
from tests.faults import ENV as FAIL_DECODE
from tests.server_proc import SMOLLM2_NAME, running_server, server_process

M = SMOLLM2_NAME
GREEDY = {"extra_body": {"temperature": 0}}
KEY = "anthropic-test-key"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True, "temperature": 0}}


def client_for(base: str, key: str = "unused", **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120, **kw)


@pytest.fixture()
def claude(server_url):
    return client_for(server_url)


def sse_events(base: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A raw stream of /v1/messages as (event name, data) pairs."""
    events, name = [], None
    with httpx.stream("POST", f"{base}/v1/messages", json={**body, "stream": True},
                      headers=headers or {}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


# ---- messages.create ---------------------------------------------------------------------------
def test_a_message_is_an_assistant_message_with_a_text_block(claude):
    msg = claude.messages.create(model=M, max_tokens=16, messages=COUNT, **GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == M
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.startswith("1, 2")


def test_a_stop_sequence_ends_the_answer_and_is_named(claude):
    msg = claude.messages.create(model=M, max_tokens=30, messages=COUNT, stop_sequences=["5"],
                                 **GREEDY)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "5")
    assert msg.content[0].text == "1, 2, 3, 4, "


def test_max_tokens_ends_the_answer_with_stop_reason_max_tokens(claude):
    msg = claude.messages.create(model=M, max_tokens=3, messages=COUNT, **GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_a_natural_end_is_end_turn(claude):
    msg = claude.messages.create(model=M, max_tokens=64, messages=COUNT, **GREEDY)
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None


def test_usage_adds_up_to_the_counted_prompt(claude):
    system = "You answer in one short sentence."
    msg = claude.messages.create(model=M, max_tokens=4, system=system, messages=ASK, **GREEDY)
    counted = claude.messages.count_tokens(model=M, system=system, messages=ASK).input_tokens
    u = msg.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == counted


def test_a_repeated_prompt_is_read_from_the_prefix_cache(claude):
    system = [{"type": "text", "text": "You are a careful assistant. " * 20,
               "cache_control": {"type": "ephemeral"}}]
    first = claude.messages.create(model=M, max_tokens=2, system=system, messages=COUNT, **GREEDY)
    again = claude.messages.create(model=M, max_tokens=2, system=system, messages=COUNT, **GREEDY)
    total = first.usage.input_tokens + first.usage.cache_creation_input_tokens + \
        first.usage.cache_read_input_tokens
    assert first.usage.cache_creation_input_tokens > 0
    assert again.usage.cache_read_input_tokens >= 0.9 * total


def test_an_assistant_prefill_is_continued(claude):
    msg = claude.messages.create(model=M, max_tokens=8, messages=COUNT + [
        {"role": "assistant", "content": "1, 2, 3,"}], **GREEDY)
    assert msg.content[0].text.startswith(" 4")


def test_a_system_prompt_of_text_blocks_is_one_system_message(claude):
    blocks = claude.messages.count_tokens(model=M, messages=ASK, system=[
        {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}])
    text = claude.messages.count_tokens(model=M, messages=ASK, system="Be brief.\n\nBe kind.")
    assert blocks.input_tokens == text.input_tokens


def test_metadata_and_cache_control_are_accepted(claude):
    msg = claude.messages.create(model=M, max_tokens=2, metadata={"user_id": "u-1"},
                                 cache_control={"type": "ephemeral"}, messages=[
                                     {"role": "user", "content": [{
                                         "type": "text", "text": "Hi",
                                         "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
                                 **GREEDY)
    assert msg.content[0].type == "text"


# ---- streams ------------------------------------------------------------------------------------
def test_a_stream_delivers_text_deltas_that_make_the_final_message(claude):
    with claude.messages.stream(model=M, max_tokens=12, messages=COUNT, **GREEDY) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    # several deltas, not one per token: speculation may accept a few tokens in one step
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_stream_events_come_in_anthropics_order(server_url):
    events = sse_events(server_url, {"model": M, "max_tokens": 4, "messages": COUNT,
                                     "temperature": 0})
    names = [n for n, _ in events if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


@cpu_timing
def test_pings_arrive_while_a_long_prompt_computes(server_url):
    # about 1,900 tokens, never sent before: several seconds of prompt on a 2-core machine
    long_text = " ".join(f"item{i} costs {i * 7 % 101} coins;" for i in range(180))
    events = sse_events(server_url, {"model": M, "max_tokens": 1, "temperature": 0,
                                     "messages": [{"role": "user", "content": long_text}]})
    names = [n for n, _ in events]
    first_delta = names.index("content_block_delta")
    assert names[0] == "message_start" and "ping" in names[1:first_delta]


def test_a_forced_tool_streams_its_input_as_a_json_delta(claude):
    with claude.messages.stream(model=M, max_tokens=60, tools=[WEATHER], messages=ASK,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    (block,) = final.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and json.loads("".join(partial)) == block.input
    assert isinstance(block.input["city"], str) and final.stop_reason == "tool_use"


def test_text_streams_before_a_call_is_told_apart(server_url):
    """With tools offered and the model free to answer, its text streams as it comes."""
    events = sse_events(server_url, {"model": M, "max_tokens": 24, "temperature": 0,
                                     "tools": [WEATHER], "messages": COUNT})
    deltas = [d["delta"]["text"] for n, d in events
              if n == "content_block_delta" and d["delta"]["type"] == "text_delta"]
    # held back, the whole text would come as one delta at the end
    assert len(deltas) > 1 and len(deltas[0]) < len("".join(deltas)) / 2


# ---- tools --------------------------------------------------------------------------------------
def test_a_tool_use_round_trip_ends_in_an_answer(claude):
    call = claude.messages.create(model=M, max_tokens=60, tools=[WEATHER], messages=ASK,
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  **GREEDY)
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
    use = call.content[0]
    answer = claude.messages.create(model=M, max_tokens=40, tools=[WEATHER], messages=ASK + [
        call.to_param(),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}],
        **GREEDY)
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    assert "sunny" in answer.content[0].text


def test_a_tool_result_is_part_of_the_counted_prompt(claude):
    history = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny", "is_error": False}]}]
    short = claude.messages.count_tokens(model=M, tools=[WEATHER], messages=history)
    longer = claude.messages.count_tokens(model=M, tools=[WEATHER], messages=history[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny, with a light breeze from the west"}]}])
    assert longer.input_tokens > short.input_tokens


def test_tools_are_part_of_the_counted_prompt(claude):
    bare = claude.messages.count_tokens(model=M, messages=ASK).input_tokens
    with_tools = claude.messages.count_tokens(model=M, messages=ASK, tools=[WEATHER]).input_tokens
    assert with_tools > bare + 20


def test_tool_choice_none_hides_the_tools(claude):
    bare = claude.messages.count_tokens(model=M, messages=ASK).input_tokens
    hidden = claude.messages.count_tokens(model=M, messages=ASK, tools=[WEATHER],
                                          tool_choice={"type": "none"}).input_tokens
    assert hidden == bare


# ---- errors, each type in Anthropic's shape ------------------------------------------------------
def error_type(exc: anthropic.APIStatusError) -> str:
    return exc.body["error"]["type"] if isinstance(exc.body, dict) else exc.body


def test_a_bad_value_is_an_invalid_request_error(claude):
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=M, max_tokens=4, messages=ASK,
                               extra_body={"temperature": 1.5})
    assert error_type(exc.value) == "invalid_request_error"
    assert exc.value.body["type"] == "error" and "temperature" in exc.value.message


def test_an_unknown_model_is_a_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert error_type(exc.value) == "not_found_error" and M in exc.value.message


def test_an_unknown_route_under_messages_is_a_not_found_error(server_url):
    resp = httpx.post(f"{server_url}/v1/messages/batches", json={})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_a_body_over_the_limit_is_a_request_too_large_error(server_url):
    resp = httpx.post(f"{server_url}/v1/messages", content=b"x" * 400_000,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert resp.json() == {"type": "error", "error": {
        "type": "request_too_large", "message": resp.json()["error"]["message"]}}


@pytest.fixture(scope="module")
def small_server():
    """A key, one sequence at a time and one waiting: room for two requests in flight."""
    with running_server({"PAGEDLLAMA_API_KEY": KEY, "PAGEDLLAMA_MAX_SEQS": "1",
                         "PAGEDLLAMA_MAX_QUEUE": "1"}) as base:
        yield base


def test_a_wrong_key_is_an_authentication_error(small_server):
    with pytest.raises(anthropic.AuthenticationError) as exc:
        client_for(small_server, "wrong").messages.create(model=M, max_tokens=2, messages=ASK)
    assert error_type(exc.value) == "authentication_error"


def test_the_key_is_taken_from_x_api_key_or_a_bearer_token(small_server):
    by_header = client_for(small_server, KEY).messages.create(model=M, max_tokens=2,
                                                               messages=ASK)
    bearer = httpx.post(f"{small_server}/v1/messages", timeout=60,
                        headers={"authorization": f"Bearer {KEY}"},
                        json={"model": M, "max_tokens": 2, "messages": ASK})
    assert by_header.type == "message" and bearer.status_code == 200, bearer.text


def test_more_requests_than_the_server_holds_is_a_rate_limit_error(small_server):
    claude = client_for(small_server, KEY)
    # each call returns once its request is in the engine: the first runs, the second waits
    streams = [claude.messages.create(model=M, messages=COUNT, stream=True, **LONG)
               for _ in range(2)]
    try:
        with pytest.raises(anthropic.RateLimitError) as exc:
            claude.messages.create(model=M, max_tokens=2, messages=ASK)
        assert error_type(exc.value) == "rate_limit_error"
        assert exc.value.response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.close()


FAULTY_APP = "tests.faults:app"


def test_an_engine_failure_is_an_api_error_and_after_the_start_an_error_event():
    # the 1st llama_decode call fails (a non-streamed request), then the 6th (a stream's)
    env = {FAIL_DECODE: f"{M}/0:1,6", "PAGEDLLAMA_PREFIX_CACHING": "0"}
    with running_server(env, app=FAULTY_APP) as base:
        claude = client_for(base)
        with pytest.raises(anthropic.InternalServerError) as exc:
            claude.messages.create(model=M, max_tokens=8, messages=COUNT, **GREEDY)
        assert exc.value.status_code == 500 and error_type(exc.value) == "api_error"
        events = sse_events(base, {"model": M, "max_tokens": 40, "temperature": 0,
                                   "messages": COUNT})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and "content_block_delta" in names
    assert names[-1] == "error" and events[-1][1]["error"]["type"] == "api_error"


def test_a_draining_server_answers_overloaded_and_ends_streams_with_an_error_event():
    with server_process({"PAGEDLLAMA_DRAIN_SECONDS": "2"}) as server:
        claude = client_for(server.base)
        out, started = {}, threading.Event()

        def long_stream():
            try:
                with claude.messages.stream(model=M, messages=COUNT, **LONG) as stream:
                    for _ in stream.text_stream:
                        started.set()
                out["ended"] = "finished"
            except anthropic.APIStatusError as exc:
                out["ended"], out["type"] = type(exc).__name__, error_type(exc)
        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(anthropic.OverloadedError) as exc:
            claude.messages.create(model=M, max_tokens=2, messages=ASK)
        t.join(60)
    assert exc.value.status_code == 529 and error_type(exc.value) == "overloaded_error"
    assert out.get("type") == "overloaded_error", out


# ---- the server never fails open ----------------------------------------------------------------
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
REFUSED = [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name"),
    ({"context_management": {"edits": [{"type": "compact_every_turn"}]}},
     "context_management.edits.0.type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools.0.strict"),
    ({"container": "container_123"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]},
     "mcp_servers"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [IMAGE]}]}]},
     "messages.0.content.0.content.0.type"),
    ({"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("fields,named", REFUSED, ids=[n for _, n in REFUSED])
def test_what_the_server_does_not_do_is_a_400_naming_it(server_url, fields, named):
    body = {"model": M, "max_tokens": 4, "messages": ASK, **fields}
    resp = httpx.post(f"{server_url}/v1/messages", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"]


def test_headers_of_anthropics_clients_are_accepted(server_url):
    resp = httpx.post(f"{server_url}/v1/messages", timeout=60, json={
        "model": M, "max_tokens": 2, "messages": ASK}, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"})
    assert resp.status_code == 200, resp.text


# ---- what agents send routinely is accepted and honoured ----------------------------------------
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=sdk-cli; cch={};"
AGENT_SYSTEM = "You are a careful assistant. Answer in one short line." * 20


def agent_body(cch: str, **kw) -> dict:
    """What Claude Code sends on every request, around a small question."""
    return {"model": M, "max_tokens": 32000, "stream": False, "temperature": 0,
            "system": [{"type": "text", "text": BILLING.format(cch)},
                       {"type": "text", "text": AGENT_SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
            "stop_sequences": ["5"], "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s-1"})}, **kw}


def test_claude_codes_routine_fields_are_accepted_and_answered(server_url):
    resp = httpx.post(f"{server_url}/v1/messages", json=agent_body("aaaa1"), timeout=120,
                      headers={"x-claude-code-session-id": "s-1", "anthropic-beta":
                               "context-management-2025-06-27,effort-2025-11-24"})
    assert resp.status_code == 200, resp.text
    msg = resp.json()
    assert msg["stop_reason"] == "stop_sequence" and msg["content"][0]["type"] == "text"
    assert msg["context_management"] == {"applied_edits": []}


def test_the_billing_header_block_is_not_part_of_the_prompt(server_url):
    """Its per-request hash would change the prompt's first tokens: left out, the second
    request reads its whole prompt but the last piece from the cache."""
    first = httpx.post(f"{server_url}/v1/messages", json=agent_body("bbbb1"), timeout=120).json()
    second = httpx.post(f"{server_url}/v1/messages", json=agent_body("cccc2"), timeout=120).json()
    count = httpx.post(f"{server_url}/v1/messages/count_tokens", timeout=60, json={
        "model": M, "system": [{"type": "text", "text": AGENT_SYSTEM}],
        "messages": agent_body("x")["messages"]}).json()["input_tokens"]
    usage = second["usage"]
    prompt = (usage["input_tokens"] + usage["cache_read_input_tokens"]
              + usage["cache_creation_input_tokens"])
    assert prompt == count == (first["usage"]["input_tokens"]
                               + first["usage"]["cache_read_input_tokens"]
                               + first["usage"]["cache_creation_input_tokens"])
    assert usage["cache_read_input_tokens"] >= prompt - 16


def test_a_max_tokens_beyond_the_context_is_capped_and_the_answer_ends_with_the_context(
        server_url):
    question = [{"role": "user", "content": "Say hello. " * 600}]
    n = httpx.post(f"{server_url}/v1/messages/count_tokens", timeout=60, json={
        "model": M, "messages": question}).json()["input_tokens"]
    resp = httpx.post(f"{server_url}/v1/messages", timeout=300, json={
        "model": M, "max_tokens": 32000, "messages": question, "ignore_eos": True,
        "temperature": 0})
    assert resp.status_code == 200, resp.text
    msg = resp.json()
    assert msg["stop_reason"] == "model_context_window_exceeded"
    assert n + msg["usage"]["output_tokens"] == 2048


def test_a_prompt_that_alone_does_not_fit_is_still_a_400(server_url):
    resp = httpx.post(f"{server_url}/v1/messages", timeout=60, json={
        "model": M, "max_tokens": 10, "messages": [{"role": "user", "content": "hi " * 3000}]})
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]


def test_a_server_tool_is_left_out_and_named_in_a_header(server_url):
    tools = [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
    with_server_tool = httpx.post(f"{server_url}/v1/messages/count_tokens", timeout=60, json={
        "model": M, "messages": ASK, "tools": tools}).json()["input_tokens"]
    without = httpx.post(f"{server_url}/v1/messages/count_tokens", timeout=60, json={
        "model": M, "messages": ASK, "tools": [WEATHER]}).json()["input_tokens"]
    resp = httpx.post(f"{server_url}/v1/messages", timeout=120, json={
        "model": M, "max_tokens": 4, "messages": ASK, "tools": tools})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pagedllama-ignored-tools"] == "web_search_20250305"
    assert with_server_tool == without


def test_a_free_tool_with_keywords_the_grammar_cannot_enforce_is_served(server_url):
    tool = {"name": "set_env", "description": "Set environment variables",
            "input_schema": {"type": "object", "properties": {"vars": {
                "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                "additionalProperties": {"type": "string"}}}, "required": ["vars"]}}
    ask = [{"role": "user", "content": "Set HOME to /root."}]
    resp = httpx.post(f"{server_url}/v1/messages", timeout=120, json={
        "model": M, "max_tokens": 48, "messages": ask, "tools": [tool],
        "tool_choice": {"type": "any"}, "temperature": 0})
    assert resp.status_code == 200, resp.text
    strict = httpx.post(f"{server_url}/v1/messages", timeout=60, json={
        "model": M, "max_tokens": 4, "messages": ask, "tools": [{**tool, "strict": True}],
        "tool_choice": {"type": "any"}})
    assert strict.status_code == 400 and "tools.0" in strict.json()["error"]["message"]


def test_a_call_that_breaks_a_schema_that_is_not_strict_is_a_tool_use_block(claude):
    """As Anthropic returns one: only `strict` promises the input_schema; the client checks."""
    schema = {**WEATHER["input_schema"], "not": {"required": ["city"]}}   # every call breaks it
    msg = claude.messages.create(model=M, max_tokens=48, messages=ASK,
                                 tools=[{**WEATHER, "input_schema": schema}],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 **GREEDY)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    (block,) = msg.content
    assert block.name == "get_weather" and isinstance(block.input["city"], str)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(block.input, schema)


def test_context_editing_clears_old_tool_results_and_says_so(server_url):
    history = []
    for i in range(4):
        history += [{"role": "user", "content": f"Question {i}?"} if i == 0 else
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i - 1}",
                                                  "content": "result text " * 40}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}",
                                                       "name": "get_weather",
                                                       "input": {"city": "Oslo"}}]}]
    history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3",
                                                 "content": "sunny"}]})
    edits = {"edits": [{"type": "clear_tool_uses_20250919",
                        "trigger": {"type": "input_tokens", "value": 100},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    body = {"model": M, "messages": history, "tools": [WEATHER]}
    plain = httpx.post(f"{server_url}/v1/messages/count_tokens", json=body, timeout=60).json()
    edited = httpx.post(f"{server_url}/v1/messages/count_tokens", timeout=60,
                        json={**body, "context_management": edits}).json()
    assert edited["input_tokens"] < plain["input_tokens"]
    assert edited["context_management"]["original_input_tokens"] == plain["input_tokens"]
    msg = httpx.post(f"{server_url}/v1/messages", timeout=120, json={
        **body, "max_tokens": 4, "context_management": edits}).json()
    (applied,) = msg["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 3
    assert applied["cleared_input_tokens"] == plain["input_tokens"] - edited["input_tokens"]


def test_the_base_url_answers_a_probe(server_url):
    assert httpx.head(f"{server_url}/", timeout=10).status_code == 200
    assert httpx.get(f"{server_url}/", headers={"accept": "application/json"},
                     timeout=10).json()["status"] == "ok"
