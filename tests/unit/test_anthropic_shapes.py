"""Anthropic's Messages API without a server: a request's messages as chat messages
(server/anthropic/convert.py), and answers as blocks, stop reasons, usage and stream events
(server/anthropic/message_shape.py)."""
import json

import pytest

from scheduler import FinishReason
from server.anthropic.convert import to_chat, tools_of
from server.anthropic.message_shape import MessageShape, stop_reason, usage
from server.anthropic.messages_body import MessagesRequest
from server.chat.answer import Reasoning
from server.chat.tool_calls import ToolCall
from server.http.errors import APIError, anthropic_error
from server.service.generation import Usage

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}


def body(**kw) -> MessagesRequest:
    return MessagesRequest(**{"model": "m", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "Hi"}], **kw})


# ---- requests ----------------------------------------------------------------------------------
def test_a_tool_round_trip_becomes_chat_tool_calls_and_a_tool_message():
    messages, prefill = to_chat(body(system="Be brief.", messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And tomorrow?"}]}]))
    assert not prefill
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    call = messages[2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}


def test_consecutive_messages_of_one_role_are_one_turn():
    messages, _ = to_chat(body(messages=[{"role": "user", "content": "a"},
                                         {"role": "user", "content": [{"type": "text",
                                                                       "text": "b"}]}]))
    assert messages == [{"role": "user", "content": "a\n\nb"}]


def test_an_error_result_says_so_in_the_prompt():
    messages, _ = to_chat(body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "no such file", "is_error": True}]}]))
    assert messages[0]["content"] == "Error: no such file"


def test_an_assistant_message_last_is_a_prefill():
    _, prefill = to_chat(body(messages=[{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello,"}]))
    assert prefill


@pytest.mark.parametrize("choice,mapped,parallel", [
    ({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "get_weather"}, "get_weather", True),
    ({"type": "none"}, "none", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False)])
def test_tool_choice_maps_to_the_chat_choice(choice, mapped, parallel):
    use = tools_of(body(tools=[WEATHER], tool_choice=choice)).use
    assert (use.choice, use.parallel) == (mapped, parallel)


def test_a_tool_choice_naming_no_given_tool_is_a_400():
    with pytest.raises(APIError) as exc:
        tools_of(body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}))
    assert exc.value.param == "tool_choice.name"


# ---- answers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("finish,calls,stop,full,expected", [
    (FinishReason.STOP, False, None, False, ("end_turn", None)),
    (FinishReason.STOP, False, "END", False, ("stop_sequence", "END")),
    (FinishReason.STOP, True, None, False, ("tool_use", None)),
    (FinishReason.LENGTH, True, None, False, ("max_tokens", None)),
    (FinishReason.TIMEOUT, False, None, False, ("max_tokens", None)),
    (FinishReason.LENGTH, False, None, True, ("model_context_window_exceeded", None)),
])
def test_stop_reasons(finish, calls, stop, full, expected):
    assert stop_reason(finish, calls, stop, full) == expected


def test_usage_adds_up_to_the_prompt_and_the_cache_writes_whole_blocks():
    req = Usage(prompt_tokens=100, cached_tokens=40, completion_tokens=5)
    u = usage(req, block_size=8, caching=True)
    assert u == {"input_tokens": 4, "cache_creation_input_tokens": 56,
                 "cache_read_input_tokens": 40, "output_tokens": 5}
    assert usage(req, 8, caching=False)["cache_creation_input_tokens"] == 0


def events(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]


def test_blocks_follow_the_pieces_and_their_events_index_them():
    shape = MessageShape("m")
    call = ToolCall("get_weather", '{"city": "Oslo"}')
    out = events(shape.add([Reasoning("hm"), "Sure.", call]) + shape.close())
    assert [b["type"] for b in shape.blocks] == ["thinking", "text", "tool_use"]
    assert shape.blocks[2]["input"] == {"city": "Oslo"} and shape.blocks[2]["id"].startswith("toolu_")
    starts = [e["index"] for e in out if e["type"] == "content_block_start"]
    stops = [e["index"] for e in out if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    deltas = [e["delta"]["type"] for e in out if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]


def test_a_call_whose_arguments_are_not_an_object_stays_text():
    shape = MessageShape("m")
    shape.add([ToolCall("f", '"just a string"')])
    assert [b["type"] for b in shape.blocks] == ["text"] and "<tool_call>" in shape.blocks[0]["text"]


@pytest.mark.parametrize("strict", [False, True])
def test_a_call_that_breaks_its_tools_schema_is_a_tool_use_unless_the_tool_is_strict(strict):
    """As Anthropic returns one: only `strict` promises the input_schema; the client checks the
    input of any other call."""
    tool = tools_of(body(tools=[{**WEATHER, "strict": strict}],
                         tool_choice={"type": "any"})).use.functions
    shape = MessageShape("m", tools=tool)
    events(shape.add([ToolCall("get_weather", '{"town": 1}')]) + shape.close())
    if strict:
        assert shape.blocks == [{"type": "text", "text": '<tool_call>{"name": "get_weather", '
                                 '"arguments": {"town": 1}}</tool_call>'}]
    else:
        [block] = shape.blocks
        assert (block["type"], block["input"]) == ("tool_use", {"town": 1})


def test_an_empty_answer_is_one_empty_text_block():
    shape = MessageShape("m")
    shape.close()
    assert shape.blocks == [{"type": "text", "text": ""}]


@pytest.mark.parametrize("ours,status,kind", [
    (400, 400, "invalid_request_error"), (401, 401, "authentication_error"),
    (404, 404, "not_found_error"), (413, 413, "request_too_large"),
    (429, 429, "rate_limit_error"), (500, 500, "api_error"), (503, 529, "overloaded_error"),
    (408, 408, "invalid_request_error")])
def test_each_status_has_anthropics_error_type(ours, status, kind):
    got_status, payload = anthropic_error(ours, "why", "field")
    assert got_status == status and payload == {"type": "error", "error": {
        "type": kind, "message": "field: why"}}
