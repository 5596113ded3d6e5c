"""/v1/responses input → chat messages, and the fields a stateless server refuses."""
import pytest

from server.errors import APIError
from server.responses import ResponsesRequest, reject_unsupported, to_messages


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
    ({"type": "function_call_output", "call_id": "c", "output": "{}"}, "input[0]"),
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
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_stateful_or_unsupported_fields_are_a_400_unsupported_parameter(fields, param):
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(**fields))
    assert exc.value.code == "unsupported_parameter" and exc.value.param == param


def test_store_false_and_a_text_format_are_accepted():
    reject_unsupported(body(store=False, text={"format": {"type": "text"}}))


def test_an_unknown_field_is_refused_by_name_not_ignored():
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(top_logprobs=3))
    assert exc.value.code == "unsupported_parameter" and exc.value.param == "top_logprobs"


def test_harmless_fields_are_accepted():
    reject_unsupported(body(user="u", truncation="disabled", reasoning={"effort": None},
                            include=[], metadata={"k": "v"}))


@pytest.mark.parametrize("name", ["response_format", "json_schema", "grammar"])
def test_chat_structured_output_fields_are_refused_not_ignored(name):
    with pytest.raises(APIError) as exc:
        reject_unsupported(body(**{name: {"type": "json_object"} if name != "grammar" else "root ::= x"}))
    assert exc.value.param == name
