"""/v1/responses structured output (`text.format`) and function tools through the real server,
with the openai SDK's own calls (create, parse, stream) and types (the shared server fixture)."""
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": PARAMS, "strict": True}
WEATHER_Q = "What is the weather in Paris?"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


def respond(client, model_name, **kw):
    kw = {"input": "Describe a person as JSON.", "max_output_tokens": 64, "temperature": 0, **kw}
    return client.responses.create(model=model_name, **kw)


# ---- text.format ---------------------------------------------------------------------------------
def test_json_schema_output_validates(client, model_name):
    resp = respond(client, model_name, text={"format": {
        "type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), PERSON)


def test_parse_with_a_pydantic_text_format_returns_the_model(client, model_name):
    resp = client.responses.parse(model=model_name, input="Invent a person.", text_format=Person,
                                  max_output_tokens=64, temperature=0)
    assert isinstance(resp.output_parsed, Person)


def test_a_sampled_streamed_json_schema_output_validates(client, model_name):
    with client.responses.stream(model=model_name, input="Invent a person.", text_format=Person,
                                 max_output_tokens=64, temperature=1.0,
                                 extra_body={"seed": 7}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Person)


def test_streamed_json_object_output_parses(client, model_name):
    events = list(respond(client, model_name, stream=True, input='Repeat exactly: {"answer": "yes"}',
                          text={"format": {"type": "json_object"}}))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed"
    assert isinstance(json.loads(text), dict) and events[-1].response.output_text == text


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_text_format(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        respond(client, model_name, text={"format": {"type": "json_schema", "name": "n",
                                                     "schema": {"type": "array", "uniqueItems": True}}})
    assert exc.value.body["param"] == "text.format.schema"


# ---- function tools ------------------------------------------------------------------------------
def test_required_tool_choice_returns_a_function_call_whose_arguments_validate(client, model_name):
    resp = respond(client, model_name, input=WEATHER_Q, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False)
    assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMS)


def test_a_call_that_breaks_a_schema_that_is_not_strict_is_a_function_call_item(client,
                                                                               model_name):
    """As OpenAI returns one: only `strict: true` promises the schema; the client checks."""
    schema = {**PARAMS, "not": {"required": ["city"]}}   # every call breaks it
    tool = {**WEATHER, "parameters": schema, "strict": False}
    resp = respond(client, model_name, input=WEATHER_Q, tools=[tool], tool_choice="required",
                   parallel_tool_calls=False)
    (item,) = resp.output
    assert (item.type, item.name) == ("function_call", "get_weather")
    arguments = json.loads(item.arguments)
    assert isinstance(arguments["city"], str)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, schema)


def test_a_named_tool_choice_streams_the_call_events_the_sdk_assembles(client, model_name):
    with client.responses.stream(model=model_name, input=WEATHER_Q, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, max_output_tokens=64,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2], events[4]
    [call] = final.output
    assert added.item.type == call.type == "function_call" and added.item.arguments == ""
    assert added.item.call_id == call.call_id and done.item_id == call.id
    assert events[3].delta == done.arguments == call.arguments
    assert call.parsed_arguments == json.loads(call.arguments)   # strict: the SDK parses it
    jsonschema.validate(call.parsed_arguments, PARAMS)


def test_with_tools_offered_a_streamed_answer_sends_its_text_as_it_is_generated(client,
                                                                               model_name):
    events = list(client.responses.create(
        model=model_name, tools=[WEATHER], max_output_tokens=24, temperature=0, stream=True,
        input="Count from 1 to 10, separated by commas."))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    text = "".join(deltas)     # held back, it would come as one delta at the end
    assert len(deltas) > 1 and len(deltas[0]) < len(text) / 2 and text == done.item.content[0].text


def test_a_history_with_a_function_call_and_its_output_is_answered(client, model_name):
    resp = respond(client, model_name, max_output_tokens=8, tools=[WEATHER], input=[
        {"role": "user", "content": WEATHER_Q},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    assert resp.output and resp.usage.output_tokens > 0


def test_a_returned_call_item_is_accepted_back_as_input(client, model_name):
    question = {"role": "user", "content": WEATHER_Q}
    call = respond(client, model_name, input=[question], tools=[WEATHER],
                   tool_choice="required", parallel_tool_calls=False).output[0]
    history = [question, call, {"type": "function_call_output", "call_id": call.call_id,
                                "output": "sunny, 21 C"}]
    resp = respond(client, model_name, max_output_tokens=8, tools=[WEATHER], input=history)
    alone = respond(client, model_name, max_output_tokens=8, tools=[WEATHER], input=[question])
    assert resp.output and resp.usage.input_tokens > alone.usage.input_tokens


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER, {"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
])
def test_a_tool_request_this_server_cannot_serve_is_a_400_naming_it(client, model_name, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        respond(client, model_name, input=WEATHER_Q, **{"tools": [WEATHER], **kw})
    assert exc.value.body["param"] == param


def test_a_hosted_tool_is_left_out_and_named_in_a_header(server_url, model_name):
    body = {"model": model_name, "input": WEATHER_Q, "max_output_tokens": 4}
    resp = httpx.post(f"{server_url}/v1/responses", timeout=120, json={
        **body, "tools": [WEATHER, {"type": "web_search"}]})
    alone = httpx.post(f"{server_url}/v1/responses", timeout=120, json={**body, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pagedllama-ignored-tools"] == "web_search"
    assert resp.json()["usage"]["input_tokens"] == alone.json()["usage"]["input_tokens"]
