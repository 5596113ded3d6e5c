"""Hostile input through a real server: lone surrogates, loose types, huge bodies, and prompts
built to be expensive to tokenize. Each is a 4xx in OpenAI's shape, and none slows others."""
import json
import statistics
import threading
import time

import httpx
import pytest
from openai import OpenAI

from tests.server_proc import SMOLLM2_NAME, running_server

M = SMOLLM2_NAME


def post(base, path, body, **kw):
    """POST a body given as a dict (lone surrogates escaped as \\udXXX) or as raw bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=raw, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def error(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---- lone surrogates -----------------------------------------------------------------------------
LONE = "a\ud800b"
CHAT = {"model": M, "max_tokens": 4}
SURROGATE_BODIES = {
    "completion prompt": ("/v1/completions", {"model": M, "prompt": LONE}, "prompt"),
    "completion prompt list": ("/v1/completions", {"model": M, "prompt": ["ok", LONE], "n": 2},
                               "prompt.1"),
    "streamed completion prompt": ("/v1/completions", {"model": M, "prompt": LONE,
                                                       "stream": True}, "prompt"),
    "chat content": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": LONE}]}, "messages.0.content"),
    "streamed chat content": ("/v1/chat/completions", {**CHAT, "stream": True, "messages": [
        {"role": "user", "content": LONE}]}, "messages.0.content"),
    "chat content part": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages.0.content.0.text"),
    "message name": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi", "name": "\udc00"}]}, "messages.0.name"),
    "unknown model": ("/v1/chat/completions", {"model": "no-such-\ud800", "messages": [
        {"role": "user", "content": "hi"}]}, "model"),
    "stop string": ("/v1/completions", {"model": M, "prompt": "hi", "stop": ["x\udfff"]},
                    "stop.0"),
    "native prompt": ("/generate_stream", {"prompt": LONE}, "prompt"),
    "ignored extra field": ("/v1/completions", {"model": M, "prompt": "hi", "user": "\ud834"},
                            "user"),
    "tool description": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
            "name": "f", "description": LONE}}]}, "tools.0.function.description"),
    "responses input": ("/v1/responses", {"model": M, "input": LONE}, "input"),
    "streamed responses instructions": ("/v1/responses", {
        "model": M, "input": "hi", "instructions": LONE, "stream": True}, "instructions"),
    "responses input item": ("/v1/responses", {"model": M, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": LONE}]}]},
        "input.0.content.0.text"),
    "embeddings input": ("/v1/embeddings", {"model": M, "input": ["ok", LONE]}, "input.1"),
    "tokenize content": ("/tokenize", {"content": LONE}, "content"),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_naming_where_it_is(server_url, case):
    path, body, where = SURROGATE_BODIES[case]
    err = error(post(server_url, path, body), 400)
    assert err["code"] == "invalid_unicode" and err["param"] == where
    assert "surrogate" in err["message"]


OLLAMA_BODIES = {
    "/api/chat": {"model": M, "stream": False, "messages": [{"role": "user", "content": LONE}]},
    "/api/generate": {"model": M, "prompt": LONE, "options": {"num_predict": 2}},
    "/api/embed": {"model": M, "input": ["ok", LONE]},
}


@pytest.mark.parametrize("path", list(OLLAMA_BODIES))
def test_a_lone_surrogate_on_ollamas_routes_is_a_400_in_its_shape(server_url, path):
    err = error(post(server_url, path, OLLAMA_BODIES[path]), 400)
    assert isinstance(err, str) and "surrogate" in err
    in_the_name = {**OLLAMA_BODIES[path], "model": "no-such-\ud800"}
    assert "model: " in error(post(server_url, path, in_the_name), 400)   # named, encodable


def test_a_model_id_that_is_not_utf8_is_a_404_that_still_encodes(server_url):
    resp = httpx.get(f"{server_url}/v1/models/no-such-%ED%A0%80", timeout=10)
    assert error(resp, 404)["code"] == "model_not_found"


def test_an_escaped_surrogate_pair_is_ordinary_text(server_url):
    head, tail = b'{"model": "%s", "prompt": "Smile ' % M.encode(), b'", "max_tokens": 2}'
    escaped = post(server_url, "/v1/completions", head + b"\\ud83d\\ude00" + tail)
    literal = post(server_url, "/v1/completions", head + "\U0001F600".encode() + tail)
    assert escaped.status_code == literal.status_code == 200, escaped.text
    assert escaped.json()["usage"]["prompt_tokens"] == literal.json()["usage"]["prompt_tokens"]


# ---- strict types --------------------------------------------------------------------------------
@pytest.mark.parametrize("field,raw", [
    ("max_tokens", "true"), ("max_tokens", '"16"'), ("priority", "false"), ("timeout", "1e400"),
    ("temperature", "NaN"), ("stream", '"true"'), ("ignore_eos", "1"), ("seed", "1.5"),
    ("max_tokens", "1e3"), ("top_k", str(2**40))])
def test_a_loosely_typed_field_is_a_400_naming_it(server_url, field, raw):
    body = b'{"model": "%s", "prompt": "hi", "%s": %s}' % (M.encode(), field.encode(),
                                                          raw.encode())
    err = error(post(server_url, "/v1/completions", body), 400)
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": "hi \xff\xfe"}',                 # not UTF-8
    b'[' * 50_000 + b']' * 50_000,                              # nested past the parser's limit
])
def test_a_body_that_cannot_be_parsed_is_a_400_invalid_json(server_url, body):
    assert error(post(server_url, "/v1/completions", body), 400)["code"] == "invalid_json"


def test_an_empty_body_and_a_wrong_prompt_type_name_the_request_not_pydantic(server_url):
    err = error(post(server_url, "/v1/completions", b""), 400)
    assert err["code"] == "invalid_json" and "missing" in err["message"] and err["param"] is None
    err = error(post(server_url, "/v1/completions", b'{"model": "%s", "prompt": 5, "stop": 7}'
                     % M.encode()), 400)
    assert err["param"] in ("prompt", "stop")       # not "prompt.str" or "stop.str"


# ---- seeds ----------------------------------------------------------------------------------------
def sampled(base, seed, prompt="Once upon a time"):
    body = {"model": M, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed}
    resp = post(base, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


@pytest.mark.parametrize("seed", [-7, -2**63 - 5, 2**64 + 3, 10**30])
def test_any_integer_is_a_seed_and_the_same_seed_gives_the_same_answer(server_url, seed):
    assert sampled(server_url, seed) == sampled(server_url, seed)


def test_seeds_map_into_the_generators_range_one_to_one_modulo_2_to_the_64(server_url):
    assert sampled(server_url, -7) == sampled(server_url, 2**64 - 7)
    assert sampled(server_url, 5) == sampled(server_url, 5 + 2**64)


def test_seed_minus_one_means_random_as_in_llama_server(server_url):
    answers = {sampled(server_url, -1, "Write one word:") for _ in range(6)}
    assert len(answers) > 1                          # 6 equal draws of 8 tokens: never seen
    health = httpx.get(f"{server_url}/health", timeout=10).json()
    assert all(c["outstanding"] == 0 and c["failed"] is None
               for c in health["models"][M]["contexts"])


# ---- the shape of a chat history ------------------------------------------------------------------
def chat_with(*messages):
    return {"model": M, "max_tokens": 4, "messages": [*messages, {"role": "user", "content": "hi"}]}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
HISTORIES = {
    "a call without its function": (
        {"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}, "messages.0.tool_calls.0.id"),
    "a call missing function": (
        {"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "type": "function"}]},
        "messages.0.tool_calls.0.function"),
    "a call of another type": (
        {"role": "assistant", "tool_calls": [{**CALL, "type": "web_search"}]},
        "messages.0.tool_calls.0.type"),
    "a function without a name": (
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
        "messages.0.tool_calls.0.function.name"),
    "arguments as an object": (
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                   "arguments": {"a": 1}}}]},
        "messages.0.tool_calls.0.function.arguments"),
    "arguments that are not JSON": (
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                   "arguments": "{a"}}]},
        "messages.0.tool_calls.0.function.arguments"),
    "tool_calls not a list": (
        {"role": "assistant", "tool_calls": {"id": "c"}}, "messages.0.tool_calls"),
    "a tool message without tool_call_id": (
        {"role": "tool", "content": "sunny"}, "messages.0.tool_call_id"),
    "a tool_call_id that is not a string": (
        {"role": "tool", "content": "sunny", "tool_call_id": 3}, "messages.0.tool_call_id"),
    "tool_calls on a user message": (
        {"role": "user", "content": "x", "tool_calls": [CALL]}, "messages.0.tool_calls"),
    "a name that is not a string": (
        {"role": "user", "content": "x", "name": ["a"]}, "messages.0.name"),
}


@pytest.mark.parametrize("case", list(HISTORIES))
def test_a_malformed_history_is_a_400_naming_the_field(server_url, case):
    message, where = HISTORIES[case]
    err = error(post(server_url, "/v1/chat/completions", chat_with(message)), 400)
    assert err["param"] == where, err
    assert where in err["message"] and "Value error" not in err["message"]


def test_a_well_formed_history_with_calls_and_results_is_answered(server_url):
    resp = post(server_url, "/v1/chat/completions", chat_with(
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}))
    assert resp.status_code == 200, resp.text


# ---- size -----------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server_url):
    not_json = b"{" * 400_000          # would be a 400 "not valid JSON" if it were parsed
    t0 = time.monotonic()
    err = error(post(server_url, "/v1/completions", not_json), 413)
    assert err["code"] == "request_too_large" and "PAGEDLLAMA_MAX_BODY_BYTES" in err["message"]
    assert time.monotonic() - t0 < 2.0


def test_a_chunked_body_over_the_limit_is_a_413(server_url):
    def chunks():                     # no Content-Length: the limit is checked while reading
        for _ in range(40):
            yield b" " * 10_000
    resp = httpx.post(f"{server_url}/v1/completions", content=chunks(), timeout=30,
                      headers={"content-type": "application/json"})
    assert error(resp, 413)["code"] == "request_too_large"


# 15,000 special tokens: llama.cpp takes ~1.2 s to tokenize these (quadratic in them)
LONG = "<|im_end|>" * 15_000


@pytest.mark.parametrize("path, body, says_bound", [
    ("/v1/completions", {"prompt": LONG}, True),
    ("/v1/completions", {"prompt": ["Hello", LONG], "n": 2}, True),   # one prompt of a list
    ("/v1/embeddings", {"input": LONG}, True),
    ("/v1/responses", {"input": LONG}, False)])
def test_an_input_that_cannot_fit_is_rejected_without_tokenizing_it(server_url, path, body,
                                                                     says_bound):
    t0 = time.monotonic()
    err = error(post(server_url, path, {"model": M, **body}), 400)
    assert err["code"] == "context_length_exceeded"
    assert not says_bound or "at least" in err["message"]
    assert time.monotonic() - t0 < 0.5


def test_a_chat_with_more_messages_than_tokens_is_rejected_before_rendering(server_url):
    messages = [{"role": "user", "content": "x"}] * 3000
    err = error(post(server_url, "/v1/chat/completions", {"model": M, "messages": messages}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


# ---- stall bound -----------------------------------------------------------------------------------
def hostile_bodies() -> list[bytes]:
    """Eight ~0.4 MB prompts of the kinds that were slow to tokenize or render."""
    text = "The quick brown fox jumps over the lazy dog. " * 9_000
    chat_turns = [{"role": r, "content": "<|im_start|>x<|im_end|>"} for r in ("user", "assistant")]
    kinds = [
        ("/v1/completions", {"model": M, "prompt": "<|im_end|>" * 40_000}),
        ("/v1/completions", {"model": M, "prompt": "<|im_start|>user\nx<|im_end|>\n" * 14_000}),
        ("/v1/completions", {"model": M, "prompt": " " * 400_000}),
        ("/v1/completions", {"model": M, "prompt": text}),
        ("/v1/chat/completions", {"model": M, "messages": chat_turns * 4_500}),
        ("/v1/chat/completions", {"model": M, "messages": [{"role": "user",
                                                            "content": "<|im_end|>" * 40_000}]}),
        ("/generate_stream", {"prompt": "<|im_start|>" * 33_000}),
        ("/v1/completions", {"model": M, "prompt": "é" * 200_000}),
    ]
    return [(path, json.dumps(body).encode()) for path, body in kinds]


def timed_request(client) -> float:
    t0 = time.monotonic()
    resp = client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0)
    assert resp.choices[0].message.content
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def open_body_server():
    """Bodies up to 4 MB, so hostile prompts get past the size limit to the prompt checks."""
    with running_server({"PAGEDLLAMA_MAX_BODY_BYTES": str(4 << 20)}) as base:
        yield base


def test_a_normal_request_waits_at_most_1s_more_while_8_hostile_prompts_arrive(open_body_server):
    base = open_body_server
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    bodies = hostile_bodies()
    assert all(len(raw) > 390_000 for _, raw in bodies)
    timed_request(client)                                   # warm-up
    idle = statistics.median(timed_request(client) for _ in range(3))
    statuses, stalled = [], []
    for _ in range(2):
        go = threading.Barrier(len(bodies) + 1)

        def attack(path, raw):
            go.wait()
            statuses.append(httpx.post(f"{base}{path}", content=raw, timeout=120,
                                       headers={"content-type": "application/json"}).status_code)
        threads = [threading.Thread(target=attack, args=b) for b in bodies]
        for t in threads:
            t.start()
        go.wait()
        time.sleep(0.05)                                    # the hostile bodies are on the way
        stalled.append(timed_request(client))
        for t in threads:
            t.join()
    print(f"normal request: idle {idle:.3f} s, under attack {stalled} s; hostile {statuses}")
    assert statuses and all(s == 400 for s in statuses), statuses
    assert max(stalled) <= idle + 1.0
