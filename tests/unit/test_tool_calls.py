"""The tool-call fallback format: parsing calls back out of text, choices, history, grammar."""
import json

import pytest

from server.http.errors import APIError
from server.openai.tool_fields import calls_grammar, parse_tool_calls, parse_tools, render_messages
from tests.grammar_bytes import accepts

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}


def test_a_tagged_call_is_parsed_with_its_arguments_as_json_text():
    text, calls = parse_tool_calls('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert text == "" and calls[0].name == "weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_two_tagged_calls_are_two_calls_with_distinct_ids():
    one = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    _, calls = parse_tool_calls(one + "\n" + one.replace('"a"', '"b"'))
    assert [c.name for c in calls] == ["a", "b"] and calls[0].id != calls[1].id


def test_text_around_a_call_is_kept_as_content():
    text, calls = parse_tool_calls('Let me check. <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert text == "Let me check." and len(calls) == 1


def test_a_call_whose_json_does_not_parse_stays_text():
    raw = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(raw) == (raw, [])


def test_plain_text_has_no_calls():
    assert parse_tool_calls("Hello") == ("Hello", [])


def test_tool_choice_naming_an_unknown_function_is_a_400():
    with pytest.raises(APIError) as exc:
        parse_tools([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    assert exc.value.param == "tool_choice"


def test_an_invalid_parameters_schema_is_a_400_naming_the_tool():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
    with pytest.raises(APIError) as exc:
        parse_tools([bad], "auto", None)
    assert exc.value.param == "tools[0].function.parameters"


def test_tools_without_a_choice_mean_auto_and_no_grammar():
    use = parse_tools([WEATHER], None, None)
    assert use.choice == "auto" and use.grammar() is None


def test_required_constrains_to_one_tagged_call_with_valid_arguments():
    g = parse_tools([WEATHER], "required", False).grammar()
    assert accepts(g, '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert not accepts(g, 'Sure! <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
                          '</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "weather", "arguments": {"town": "Oslo"}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
                          '\n<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_parallel_calls_may_follow_one_another():
    g = parse_tools([WEATHER], "required", True).grammar()
    assert accepts(g, '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
                      '\n<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_a_named_function_is_called_once_even_with_parallel_calls_allowed():
    g = parse_tools([WEATHER], {"type": "function", "function": {"name": "weather"}}, True).grammar()
    one = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert accepts(g, one) and not accepts(g, one + "\n" + one)


def test_tools_go_into_the_system_message_and_results_become_user_turns():
    use = parse_tools([WEATHER], "auto", None)
    msgs = render_messages([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], use)
    assert msgs[0]["role"] == "system" and "weather" in msgs[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>sunny</tool_response>"}


def test_calls_grammar_names_every_allowed_function():
    fns = parse_tools([WEATHER], "required", None).functions
    assert "weather" in calls_grammar(fns, parallel=True)
    assert not accepts(calls_grammar(fns, parallel=True),
                       '<tool_call>{"name": "other", "arguments": {"city": "Oslo"}}</tool_call>')


def test_a_call_the_answer_ends_inside_is_left_out_of_the_text():
    text, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                                   '<tool_call>\n{"name": "f", "arguments": {"ci')
    assert text == "" and [c.name for c in calls] == ["f"]
    text, calls = parse_tool_calls('I will look. <tool_call>{"name"')
    assert text == "I will look." and calls == []
    # a complete block whose JSON does not parse is still text, as before
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


def test_a_tool_choice_whose_function_is_not_an_object_is_a_400_naming_tool_choice():
    for choice in ({"type": "function", "function": "weather"},
                   {"type": "function", "function": ["weather"]}):
        with pytest.raises(APIError) as exc:
            parse_tools([WEATHER], choice, True)
        assert exc.value.status == 400 and exc.value.param == "tool_choice"


ENV_PARAMS = {"type": "object", "properties": {"env": {
    "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
    "additionalProperties": {"type": "string"}}}, "required": ["env"]}


def _env(**fn):
    return {"type": "function", "function": {"name": "set_env", "parameters": ENV_PARAMS, **fn}}


def test_a_chat_function_that_is_not_strict_may_use_keywords_the_grammar_cannot_enforce():
    [fn] = parse_tools([_env()], "auto", None).functions
    assert fn.parameters == ENV_PARAMS and "propertyNames" not in json.dumps(fn.enforced)


def test_a_strict_chat_function_whose_schema_cannot_be_enforced_is_a_400_naming_it():
    with pytest.raises(APIError) as exc:
        parse_tools([_env(strict=True)], "auto", None)
    assert exc.value.param == "tools[0].function.parameters"


def test_a_forced_call_to_a_function_that_is_not_strict_is_held_to_what_can_be_enforced():
    g = parse_tools([_env()], "required", False).grammar()
    assert accepts(g, '<tool_call>{"name": "set_env", "arguments": {"env": {"A": "1"}}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "set_env", "arguments": {"env": 3}}</tool_call>')


def test_a_strict_flag_that_is_not_a_boolean_is_a_400_naming_it():
    with pytest.raises(APIError) as exc:
        parse_tools([_env(strict="yes")], "auto", None)
    assert exc.value.param == "tools[0].function.strict"
