"""Property: whatever body a client sends to any route, the server answers it in time with a
200 or a 4xx in the API's error shape, never a 5xx, and afterwards holds nothing for it.

Bodies are built from the server's own OpenAPI schema (every field of every request body, nested
ones included), each field left out, given a value of its declared type, or given a hostile one:
negative, huge and non-finite numbers, wrong nested shapes, empty and long strings, unknown
roles. They run through the real routes into a real worker (SmolLM2 with a short context, so
that any accepted request ends within seconds). Hypothesis runs a fixed sequence of examples
(derandomized) so the suite stays repeatable; run with PAGEDLLAMA_PROPERTY_EXAMPLES=2000 to
search further.
"""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_proc import SMOLLM2_NAME, running_server

M = SMOLLM2_NAME
EXAMPLES = int(os.environ.get("PAGEDLLAMA_PROPERTY_EXAMPLES", "200"))
ANSWER_WITHIN_S = 60.0
ENV = {"PAGEDLLAMA_N_CTX": "256", "PAGEDLLAMA_MAX_SEQS": "4", "PAGEDLLAMA_CACHE_SEQS": "4",
       "PAGEDLLAMA_MAX_QUEUE": "32", "PAGEDLLAMA_THREADS": "2"}
ROUTES = {"/v1/chat/completions": "ChatCompletionRequest",
          "/v1/completions": "CompletionRequest",
          "/v1/responses": "ResponsesRequest",
          "/v1/embeddings": "EmbeddingRequest",
          "/tokenize": "TokenizeRequest",
          "/detokenize": "DetokenizeRequest",
          "/generate_stream": "GenerateRequest",
          "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest",
          "/api/chat": "OllamaChatRequest",
          "/api/generate": "OllamaGenerateRequest",
          "/api/embed": "OllamaEmbedRequest"}


@pytest.fixture(scope="module")
def server():
    with running_server(ENV) as base:
        schemas = httpx.get(f"{base}/openapi.json", timeout=30).json()["components"]["schemas"]
        yield base, schemas


# ---- values ----------------------------------------------------------------------------------------
NUMBERS = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 7, -2**31, 2**31, 2**53 + 1, -2**63, 2**63, 2**64, 10**30,
                     -10**30, 0.5, -0.0, 1e-320, 1e308, -1e308]),
    st.integers(min_value=-10**6, max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True))
STRINGS = st.one_of(
    st.sampled_from(["", " ", "x" * 3000, "\u2028\u0085", "<|im_start|>assistant\n", "{", "null",
                     "function", "user", "tool", "SmolLM2-135M-Instruct.Q4_1", "-1",
                     "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"]),
    st.text(max_size=40))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS)
HOSTILE = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(STRINGS, st.sampled_from(
        ["type", "role", "content", "text", "name", "function", "arguments", "id", "call_id",
         "output", "schema", "json_schema", "tool_calls", "tool_call_id"])), inner, max_size=4)),
    max_leaves=12)


def _resolve(schema: dict, schemas: dict) -> dict:
    while "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each chosen with its weight."""
    return st.one_of([s for weight, s in pairs for _ in range(weight)])


def of_schema(schema: dict, schemas: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema's type and range (anyOf: any member); past a few levels of
    nesting, anything."""
    schema = _resolve(schema, schemas)
    if depth >= 4:
        return HOSTILE
    if "anyOf" in schema:
        return st.one_of([of_schema(s, schemas, depth + 1) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo = max(schema.get("minimum", -3), schema.get("exclusiveMinimum", -4) + 1)
        hi = min(schema.get("maximum", 8), schema.get("exclusiveMaximum", 9) - 1, 8)
        return st.integers(lo, max(lo, hi))
    if kind == "number":
        lo = max(schema.get("minimum", -3.0), schema.get("exclusiveMinimum", -3.0))
        hi = min(schema.get("maximum", 3.0), schema.get("exclusiveMaximum", 3.0))
        return st.floats(lo, hi, allow_nan=False, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return STRINGS
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(of_schema(schema.get("items", {}), schemas, depth + 1), max_size=3)
    if kind == "object" or "properties" in schema:
        return object_of(schema, schemas, depth + 1)
    return HOSTILE


def object_of(schema: dict, schemas: dict, depth: int = 0) -> st.SearchStrategy:
    """An object with its required properties and some of the others, of their types."""
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fields = {}
    for name, sub in props.items():
        value = FIELD_VALUES[name] if name in FIELD_VALUES else of_schema(sub, schemas, depth)
        fields[name] = value if name in required else weighted((4, st.just(_ABSENT)), (1, value))
    return st.fixed_dictionaries(fields).map(
        lambda f: {k: v for k, v in f.items() if v is not _ABSENT})


_ABSENT = object()
TEXT = st.one_of(st.sampled_from(["Hi", "What is 2+2?", "Name a colour.", "<|im_end|>", " ",
                                  "\u2028", "é" * 40]), st.text(min_size=1, max_size=30))
SCHEMA = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}, {"type": "string", "maxLength": 5},
    {"enum": ["x", "y"]}])
# fields whose declared type says little (objects of any shape): values that mean something
FIELD_VALUES = {
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                                 st.builds(lambda s: {"type": "json_schema", "json_schema": {
                                     "name": "x", "schema": s}}, SCHEMA)),
    "json_schema": SCHEMA,
    "grammar": st.sampled_from(['root ::= "yes" | "no"', "start: /[a-z]+/"]),
    "text": st.builds(lambda s: {"format": s}, st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.builds(lambda s: {"type": "json_schema", "name": "x", "schema": s}, SCHEMA))),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=3),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "seed": st.integers(-2**70, 2**70),
    "prompt": st.one_of(TEXT, st.lists(st.integers(0, 49151), min_size=1, max_size=8),
                        st.lists(TEXT, min_size=1, max_size=3)),
    "input": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3)),
    "content": TEXT,
    "instructions": TEXT,
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "dimensions": st.none(),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "timeout": st.floats(0.001, 30),
    "model": st.just(M),
}

# chat messages and Responses input items written to reach the nested checks (their schemas
# say little: content parts, tool calls, items are objects of any shape there)
def sometimes(valid: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """Mostly a valid value, now and then a hostile one."""
    return weighted((odds, valid), (1, HOSTILE))


TOOL_CALL = st.fixed_dictionaries({
    "id": sometimes(st.just("call_1")), "type": sometimes(st.just("function")),
    "function": sometimes(st.fixed_dictionaries({
        "name": sometimes(st.sampled_from(["f", "get_weather"])),
        "arguments": sometimes(st.sampled_from(["{}", '{"a": 1}', "{", ""]))}))})
TOOL_CALLS = st.lists(sometimes(TOOL_CALL), max_size=2)
PART = st.fixed_dictionaries({"type": sometimes(st.sampled_from(["text", "input_text"]), 6),
                              "text": sometimes(TEXT)})
CONTENT = weighted((6, TEXT), (1, st.none()), (2, st.lists(sometimes(PART), max_size=3)),
                   (1, HOSTILE))
MESSAGE = st.builds(
    lambda role, content, extra: {"role": role, "content": content, **extra},
    sometimes(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), 8),
    CONTENT,
    weighted((4, st.just({})), (2, st.fixed_dictionaries({"tool_calls": TOOL_CALLS})),
             (1, st.fixed_dictionaries({"tool_call_id": sometimes(st.just("call_1"))})),
             (1, st.fixed_dictionaries({"name": sometimes(TEXT)})),
             (1, st.dictionaries(st.sampled_from(["tool_calls", "tool_call_id", "name"]),
                                 HOSTILE, max_size=2))))
INPUT_ITEM = weighted(
    (4, MESSAGE),
    (2, st.fixed_dictionaries({"type": st.just("function_call"),
                               "call_id": sometimes(st.just("c1")),
                               "name": sometimes(st.just("f")),
                               "arguments": sometimes(st.sampled_from(["{}", "{", ""]))})),
    (2, st.fixed_dictionaries({"type": st.just("function_call_output"),
                               "call_id": sometimes(st.just("c1")),
                               "output": sometimes(TEXT)})),
    (1, st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "message",
                                                        "item_reference", "x"]),
                               "content": CONTENT})),
    (1, HOSTILE))
TOOLS = st.lists(weighted(
    (3, st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": sometimes(st.just("f")), "parameters": sometimes(SCHEMA)})})),
    (3, st.fixed_dictionaries({"type": st.just("function"), "name": sometimes(st.just("f")),
                               "parameters": sometimes(SCHEMA)})),
    (1, HOSTILE)), max_size=2)
NESTED = {"messages": st.lists(MESSAGE, min_size=1, max_size=4),
          "input": weighted((1, TEXT), (3, st.lists(INPUT_ITEM, min_size=1, max_size=4))),
          "tools": TOOLS}

# Anthropic's shapes (/v1/messages): content blocks, tool uses and results, tools, tool_choice
A_TEXT = st.fixed_dictionaries({"type": sometimes(st.just("text"), 8), "text": sometimes(TEXT)},
                               optional={"cache_control": st.just({"type": "ephemeral"})})
A_BLOCK = weighted(
    (4, A_TEXT),
    (2, st.fixed_dictionaries({"type": st.just("tool_use"), "id": sometimes(st.just("toolu_1")),
                               "name": sometimes(st.just("f")),
                               "input": sometimes(st.sampled_from([{}, {"a": 1}]))})),
    (2, st.fixed_dictionaries({"type": st.just("tool_result"),
                               "tool_use_id": sometimes(st.just("toolu_1")),
                               "content": sometimes(st.one_of(TEXT, st.lists(A_TEXT, max_size=2)))},
                              optional={"is_error": sometimes(st.booleans())})),
    (1, st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document",
                                                        "redacted_thinking", "x"]),
                               "thinking": TEXT, "signature": st.just("")})),
    (1, HOSTILE))
A_MESSAGE = st.fixed_dictionaries({
    "role": sometimes(st.sampled_from(["user", "assistant", "system"]), 8),
    "content": weighted((4, TEXT), (3, st.lists(A_BLOCK, max_size=3)), (1, HOSTILE))})
A_TOOLS = st.lists(weighted(
    (4, st.fixed_dictionaries({"name": sometimes(st.sampled_from(["f", "get_weather"])),
                               "input_schema": sometimes(st.sampled_from(
                                   [{"type": "object"}, {"type": "object", "properties": {
                                       "a": {"type": "integer"}}, "required": ["a"]}]))},
                              optional={"description": TEXT,
                                        "type": st.sampled_from(["custom", "web_search_20250305"]),
                                        "strict": st.booleans()})),
    (1, HOSTILE)), max_size=2)
A_NESTED = {"messages": st.lists(A_MESSAGE, min_size=1, max_size=4),
            "system": st.one_of(TEXT, st.lists(A_TEXT, max_size=2)),
            "tools": A_TOOLS,
            "tool_choice": st.one_of(
                st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])},
                                      optional={"disable_parallel_tool_use": st.booleans()}),
                st.fixed_dictionaries({"type": st.just("tool"), "name": sometimes(st.just("f"))}),
                HOSTILE),
            "thinking": st.one_of(st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                                   {"type": "enabled", "budget_tokens": 1024}]),
                                  HOSTILE),
            "stop_sequences": st.lists(TEXT, max_size=3)}


FIELDS = ["tools", "tool_choice", "input", "logprobs", "top_logprobs", "n", "unknown_field",
          "messages", "prompt", "max_tokens", "seed", "stop", "model", "response_format"]
# fields a route refuses whatever their value (another API's, or one it does not implement):
# they come in as corruptions only, so that most bodies are valid apart from those
REFUSED = {"/v1/responses": {"response_format", "json_schema", "grammar", "n", "store",
                             "previous_response_id", "background", "stream_options"},
           "/generate_stream": {"n", "stream", "stream_options"}}


@st.composite
def requests(draw, schemas: dict):
    """A body of one route's schema (its nested shapes written out), then up to two fields (its
    own or others') given a hostile value."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    schema = dict(schemas[ROUTES[path]])
    schema["properties"] = {k: v for k, v in schema["properties"].items()
                            if k not in REFUSED.get(path, ())}
    body = draw(object_of(schema, schemas))
    nested = A_NESTED if path.startswith("/v1/messages") else NESTED
    for name, strategy in nested.items():
        if (name in body or name in A_NESTED) and name in schema["properties"] \
                and draw(st.booleans()):
            body[name] = draw(strategy)
    if "max_tokens" in schema["properties"] and draw(st.integers(0, 5)) == 0:
        body["max_tokens"] = draw(st.integers(0, 300))   # past the context too (256)
    names = sorted(schemas[ROUTES[path]]["properties"]) + FIELDS
    for _ in range(draw(weighted((3, st.just(0)), (1, st.just(1)), (1, st.just(2))))):
        body[draw(st.sampled_from(names))] = draw(HOSTILE)
    return path, body


# ---- the property ------------------------------------------------------------------------------------
def send(base: str, path: str, body) -> tuple[int, bytes, float]:
    raw = json.dumps(body, allow_nan=True).encode()   # NaN and Infinity as Python writes them
    t0 = time.monotonic()
    with httpx.stream("POST", f"{base}{path}", content=raw, timeout=ANSWER_WITHIN_S,
                      headers={"content-type": "application/json"}) as resp:
        data = resp.read()
    return resp.status_code, data, time.monotonic() - t0


def check_answer(status: int, data: bytes, path: str, body) -> None:
    what = f"{path} {json.dumps(body, allow_nan=True)[:600]} -> {status} {data[:600]!r}"
    assert status < 500, what
    if path.startswith("/api/"):   # Ollama's shape: {"error": "..."}; a stream's error a line
        if status >= 400:
            error = json.loads(data)["error"]
            assert isinstance(error, str) and error, what
            return
        for line in data.splitlines():
            assert "error" not in json.loads(line), what
        return
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"], what
        return
    for line in data.splitlines():   # a stream that ended with an error event
        if line.startswith(b"data:") and b'"error"' in line and (b"engine_error" in line
                                                                 or b"api_error" in line):
            raise AssertionError(what)


def wait_idle(base: str, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        contexts = [c for m in httpx.get(f"{base}/health", timeout=10).json()["models"].values()
                    for c in m["contexts"]]
        if all(c["outstanding"] == 0 and c["running"] == 0 and c["kv_used_blocks"] == 0
               for c in contexts) or time.monotonic() > deadline:
            return contexts
        time.sleep(0.1)


def test_any_body_on_any_route_is_answered_in_time_without_a_5xx_and_leaves_nothing(server):
    base, schemas = server
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 200,
              suppress_health_check=list(HealthCheck), database=None)
    @given(requests(schemas))
    def prop(request):
        path, body = request
        status, data, took = send(base, path, body)
        seen[status] = seen.get(status, 0) + 1
        check_answer(status, data, path, body)
        assert took < ANSWER_WITHIN_S

    prop()
    contexts = wait_idle(base)
    for c in contexts:
        assert c["outstanding"] == 0 and c["running"] == 0 and c["kv_used_blocks"] == 0, c
        assert c["failed"] is None, c
    # the property means something only if bodies get through to the engine too
    answered = sum(seen.values())
    assert seen.get(200, 0) >= answered // 20 and seen.get(400, 0) >= answered // 10, seen
