"""/v1/responses input → chat messages, tools and text.format checks, output items and their
events (no model loaded), and the fields a stateless server refuses."""
import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from scheduler import FinishReason
from server.http.errors import APIError
from server.openai.responses_body import (
    ResponsesRequest,
    constraints,
    reject_unsupported,
    to_messages,
)
from server.openai.responses_format import ResponseState, output_items
from server.openai.tool_fields import parse_tools, render_messages
from server.service.generation import Usage
from tests.grammar_bytes import accepts

WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def body(**kw) -> ResponsesRequest:
    return ResponsesRequest(model="m", **{"input": "hi", **kw})


def test_a_string_input_is_one_user_message():
    assert to_messages(body(input="Hello")) == [{"role": "user", "content": "Hello"}]


def test_instructions_become_a_leading_system_message():
    msgs = to_messages(body(input="Hello", instructions="Be brief."))
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def test_items_keep_their_roles_and_join_their_text_parts():
    msgs = to_messages(body(input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "world"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "Again"}]))
    assert msgs == [{"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "Hello, world"},
                    {"role": "assistant", "content": "Bonjour"},
                    {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("item,param", [
    ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "input[0].arguments"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]},
     "input[0].output[0]"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0]"),
    ({"role": "robot", "content": "hi"}, "input[0].role"),
])
def test_an_item_that_is_not_text_is_a_400_naming_it(item, param):
    with pytest.raises(APIError) as exc:
        to_messages(body(input=[item]))
    assert exc.value.status == 400 and exc.value.param == param


def test_an_empty_input_list_is_a_400():
    with pytest.raises(APIError) as exc:
        to_messages(body(input=[]))
    assert exc.value.param == "input"


@pytest.mark.parametrize("fields,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
])
def test_stateful_or_unsupported_fields_are_a_400_unsupported_parameter(fields, param):
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(**fields))
    assert exc.value.code == "unsupported_parameter" and exc.value.param == param


def test_store_false_and_a_text_format_are_accepted():
    reject_unsupported(body(store=False, text={"format": {"type": "text"}}))
    assert constraints(body(text={"format": {"type": "text"}}), model=None).grammar is None


def test_an_unknown_field_is_refused_by_name_not_ignored():
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(top_logprobs=3))
    assert exc.value.code == "unsupported_parameter" and exc.value.param == "top_logprobs"


def test_harmless_fields_are_accepted():
    reject_unsupported(body(user="u", truncation="disabled", reasoning={"effort": None},
                            include=[], metadata={"k": "v"}))


@pytest.mark.parametrize("fields", [
    {"reasoning": {"effort": "high", "summary": "auto"}}, {"reasoning": {"generate_summary": "concise"}},
    {"text": {"verbosity": "low"}}, {"text": {"verbosity": "high"}},
    {"client_metadata": {"x-codex-installation-id": "abc"}}, {"prompt_cache_key": "thread-1"},
    {"include": ["reasoning.encrypted_content"]},
])
def test_hints_and_labels_agents_send_are_accepted(fields):
    reject_unsupported(body(**fields))


@pytest.mark.parametrize("fields,param,code", [
    ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ({"include": "reasoning.encrypted_content"}, "include", "invalid_value"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort", "invalid_value"),
    ({"reasoning": {"bogus": 1}}, "reasoning.bogus", "unsupported_parameter"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity", "invalid_value"),
    ({"text": {"bogus": 1}}, "text.bogus", "unsupported_parameter"),
    ({"truncation": "bogus"}, "truncation", "invalid_value"),
])
def test_fields_that_would_ask_for_more_are_refused_not_ignored(fields, param, code):
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(**fields))
    assert (exc.value.param, exc.value.code) == (param, code)


def test_truncation_auto_is_accepted_and_echoed():
    """An input too long for the context is refused either way (context_length_exceeded)."""
    b = body(truncation="auto", text={"verbosity": "medium"})
    reject_unsupported(b)
    state = ResponseState(b, "m", use=parse_tools(None, None, None, responses=True))
    assert state.response()["truncation"] == "auto"


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "name": "x", "shema": {"type": "object"}}, "text.format.shema"),
    ({"type": "json_object", "schema": {}}, "text.format.schema"),
    ({"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}, "text.format.strict"),
])
def test_a_misspelt_or_misplaced_format_field_is_refused(fmt, param):
    with pytest.raises(APIError) as exc:
        constraints(body(text={"format": fmt}), model=None)
    assert exc.value.param == param


def test_an_unknown_key_in_a_flat_function_tool_is_refused():
    with pytest.raises(APIError) as exc:
        parse_tools([{**WEATHER, "strcit": True}], None, None, responses=True)
    assert exc.value.param == "tools[0].strcit"


@pytest.mark.parametrize("name", ["response_format", "json_schema", "grammar"])
def test_chat_structured_output_fields_are_refused_not_ignored(name):
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(**{name: {"type": "json_object"} if name != "grammar" else "root ::= x"}))
    assert exc.value.param == name


# ---- function calls in the history ---------------------------------------------------------------
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"type": "function_call", "call_id": "call_1", "name": "weather",
            "arguments": '{"city": "Oslo"}'},
           {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]


def test_calls_and_their_outputs_become_chat_tool_calls_and_tool_messages():
    msgs = to_messages(body(input=HISTORY))
    assert msgs[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_assistant_text_and_the_calls_after_it_are_one_assistant_turn():
    second = {**HISTORY[1], "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    msgs = to_messages(body(input=[HISTORY[0], {"role": "assistant", "content": "Checking."},
                                   HISTORY[1], second]))
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["content"] == "Checking."
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["call_1", "call_2"]


def test_a_call_output_given_as_text_parts_is_joined():
    item = {"type": "function_call_output", "call_id": "c",
            "output": [{"type": "input_text", "text": "sun"}, {"type": "input_text", "text": "ny"}]}
    assert to_messages(body(input=[item]))[0]["content"] == "sunny"


def test_a_history_renders_in_the_tagged_format_chat_uses():
    use = parse_tools([WEATHER], None, None, responses=True)
    rendered = render_messages(to_messages(body(input=HISTORY)), use)
    assert rendered[0]["role"] == "system" and '"name": "weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content":
                           '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>sunny</tool_response>"}


# ---- tools and tool_choice, Responses shape ------------------------------------------------------
def test_flat_function_tools_are_parsed_with_their_parameters():
    c = constraints(body(tools=[WEATHER], tool_choice="required"), model=None)
    use, grammar = c.use, c.grammar
    assert [f.name for f in use.functions] == ["weather"] and use.choice == "required"
    assert accepts(grammar, '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')


def test_a_named_tool_choice_in_the_responses_shape_forces_that_function():
    use = constraints(body(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"},
                           parallel_tool_calls=False), model=None).use
    assert (use.choice, use.parallel) == ("weather", False)


def test_tools_without_a_choice_are_auto_and_leave_the_output_free():
    c = constraints(body(tools=[WEATHER]), model=None)
    use, grammar = c.use, c.grammar
    assert use.active and use.choice == "auto" and grammar is None


@pytest.mark.parametrize("fields,param,code", [
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0]", "invalid_value"),
    ({"tools": [{"name": "f"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{**WEATHER, "parameters": {"type": 3}}]}, "tools[0].parameters", "invalid_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
     "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
])
def test_a_tool_or_tool_choice_we_cannot_serve_is_a_400_naming_it(fields, param, code):
    with pytest.raises(APIError) as exc:
        constraints(body(**fields), model=None)
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, param, code)


# ---- text.format ---------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("fmt,param", [
    ({"type": "yaml"}, "text.format"),
    ({"type": "json_schema", "schema": PERSON}, "text.format.name"),
    ({"type": "json_schema", "name": "p"}, "text.format.schema"),
    ({"type": "json_schema", "name": "p", "schema": {"type": 3}}, "text.format.schema"),
    ({"type": "json_schema", "name": "p", "schema": {"type": "array", "uniqueItems": True}},
     "text.format.schema"),
    # the chat shape (schema nested under json_schema) is not the Responses one: its key is named
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
     "text.format.json_schema"),
])
def test_a_text_format_that_cannot_be_enforced_is_a_400_naming_it(fmt, param):
    with pytest.raises(APIError) as exc:
        constraints(body(text={"format": fmt}), model=None)
    assert exc.value.status == 400 and exc.value.param == param


# ---- output items and their events ---------------------------------------------------------------
def test_an_answer_that_is_a_call_is_one_function_call_item():
    use = parse_tools([WEATHER], "auto", None, responses=True)
    [item] = output_items(CALL, use, "msg_1")
    assert item["type"] == "function_call" and item["name"] == "weather"
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert json.loads(item["arguments"]) == {"city": "Oslo"} and item["status"] == "completed"


def test_text_before_calls_is_a_message_item_first():
    use = parse_tools([WEATHER], "auto", None, responses=True)
    items = output_items("Let me look. " + CALL + "\n" + CALL, use, "msg_1")
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me look."
    assert items[1]["call_id"] != items[2]["call_id"]


def test_without_active_tools_a_tagged_call_stays_text():
    use = parse_tools([WEATHER], "none", None, responses=True)
    [item] = output_items(CALL, use, "msg_1")
    assert item["type"] == "message" and item["content"][0]["text"] == CALL


def _data(message: bytes) -> str:
    event, data, blank = message.decode().split("\n", 2)
    assert event.startswith("event: ") and data.startswith("data: ") and blank == "\n"
    return data[6:]


USAGE = Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)   # the request's


def test_a_held_back_answer_sends_each_item_as_events_the_openai_sdk_parses():
    use = parse_tools([WEATHER], "auto", None, responses=True)
    state = ResponseState(body(tools=[WEATHER]), "m", use, USAGE, text="Hm. " + CALL)
    state.finish = FinishReason.STOP
    events = [e for i, item in enumerate(state.finish_output()) for e in state.item_events(i, item)]
    parsed = [pydantic.TypeAdapter(ResponseStreamEvent).validate_json(_data(e)) for e in events]
    assert [e.type for e in parsed] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    added, delta = parsed[6], parsed[7]
    assert added.item.arguments == "" and added.output_index == delta.output_index == 1
    assert delta.item_id == added.item.id and json.loads(delta.delta) == {"city": "Oslo"}
    # (usage aside: this SDK's type wants input_tokens_details.cache_write_tokens, a number
    # this server does not track; the SDK does not validate what it receives)
    final = Response.model_validate({**state.response(), "usage": None})
    assert final.status == "completed" and final.output[1].call_id == added.item.call_id
    assert final.tools[0].name == "weather" and final.tool_choice == "auto"
