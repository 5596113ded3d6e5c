"""The schema engine's front door: schemas become llguidance grammars or a 400 naming what is
wrong, and which request fields are refused, ignored or served (no model loaded)."""
import json

import pytest

from engine.grammar import GrammarError, check, from_gbnf, from_json_schema
from server.chat.tool_calls import validate_arguments
from server.http.errors import APIError
from server.openai.bodies import ChatCompletionRequest
from server.openai.fields import UNSUPPORTED_CHAT, check_fields
from server.openai.structured import compile_schema, enforceable_schema, grammar_for
from server.openai.tool_fields import parse_tools
from tests.grammar_bytes import accepts


def chat(**extra):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def test_a_schema_with_properties_compiles_to_a_valid_grammar():
    check(from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))


def test_a_type_the_compiler_does_not_know_is_a_grammar_error():
    with pytest.raises(GrammarError, match="frob"):
        check(from_json_schema({"type": "frob"}))


def test_json_output_has_one_layout_and_no_raw_control_characters():
    g = from_json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}},
                          "required": ["s"]})
    assert accepts(g, '{"s": "a b"}')
    assert not accepts(g, '{ "s" : "a b" }')          # json.dumps's layout only
    assert not accepts(g, '{"s": "a\nb"}')            # a raw newline inside a string is not JSON
    assert accepts(g, '{"s": "a\\nb"}')              # an escaped one is
    assert not accepts(g, '{"s": "' + "x" * 13 + '"}')


def test_an_object_with_properties_admits_no_other_keys_unless_it_says_so():
    props = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not accepts(from_json_schema(props), '{"a": 1, "b": 2}')
    assert accepts(from_json_schema({**props, "additionalProperties": True}), '{"a": 1, "b": 2}')
    nested = {"type": "array", "items": props}
    assert not accepts(from_json_schema(nested), '[{"a": 1, "b": 2}]')
    assert accepts(from_json_schema({"type": "object"}), '{"b": 2}')


def test_numeric_bounds_are_held():
    g = from_json_schema({"type": "integer", "minimum": 1, "maximum": 9})
    assert accepts(g, "9") and not accepts(g, "10") and not accepts(g, "0")


def test_gbnf_is_translated_and_a_broken_one_is_an_error():
    check(from_gbnf('root ::= "yes" | "no"'))
    with pytest.raises(GrammarError):
        check(from_gbnf("root ::= (("))


def test_an_invalid_schema_is_a_400_naming_the_param():
    with pytest.raises(APIError) as exc:
        compile_schema({"type": "object", "properties": {"a": {"type": 3}}}, "json_schema")
    assert exc.value.status == 400 and exc.value.param == "json_schema"


def test_a_schema_that_is_not_an_object_is_a_400():
    with pytest.raises(APIError) as exc:
        compile_schema(["not", "a", "schema"], "json_schema")
    assert exc.value.param == "json_schema"


def test_an_unresolvable_ref_is_a_400():
    with pytest.raises(APIError) as exc:
        compile_schema({"$ref": "#/defs/missing"}, "json_schema")
    assert exc.value.status == 400


def test_a_field_we_do_not_implement_is_refused_by_name():
    with pytest.raises(APIError) as exc:
        check_fields(chat(audio={"voice": "x"}), UNSUPPORTED_CHAT)
    assert (exc.value.code, exc.value.param) == ("unsupported_parameter", "audio")


def test_an_unknown_vendor_field_is_refused_by_name():
    with pytest.raises(APIError) as exc:
        check_fields(chat(guided_regex="a+"), UNSUPPORTED_CHAT)
    assert exc.value.param == "guided_regex"


def test_harmless_fields_are_accepted():
    check_fields(chat(user="u", metadata={}, store=True, service_tier="auto"), UNSUPPORTED_CHAT)


def test_a_neutral_value_of_an_unsupported_field_is_accepted():
    check_fields(chat(logprobs=False, best_of=None), UNSUPPORTED_CHAT)


@pytest.mark.parametrize("keyword", [{"uniqueItems": True}, {"contains": {"type": "string"}},
                                     {"not": {"type": "null"}}])
def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(keyword):
    schema = {"type": "object", "properties": {"n": {"type": "array", **keyword}}}
    with pytest.raises(APIError) as exc:
        compile_schema(schema, "json_schema")
    assert exc.value.param == "json_schema" and next(iter(keyword)) in exc.value.message


def test_numeric_bounds_and_patterns_are_enforced_not_refused():
    compile_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "s": {"type": "string", "pattern": "^[a-z]+$"}}}, "json_schema")


def test_a_property_named_like_a_keyword_is_not_mistaken_for_one():
    compile_schema({"type": "object", "properties": {"minimum": {"type": "integer"}}}, "json_schema")


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "shema": {"type": "object"}}},
     "response_format.json_schema.shema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
     "response_format.json_schema"),
    ({"type": "text", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
])
def test_a_misspelt_or_misplaced_response_format_field_is_a_400_naming_it(fmt, param):
    """A misspelt `schema` must not quietly turn a schema into any JSON."""
    with pytest.raises(APIError) as exc:
        grammar_for(chat(response_format=fmt), model=None)
    assert exc.value.param == param


def test_an_unknown_key_in_a_chat_tool_or_its_function_is_a_400_naming_it():
    fn = {"name": "f", "parameters": {"type": "object"}}
    for tool, param in [({"type": "function", "function": {**fn, "strcit": True}},
                         "tools[0].function.strcit"),
                        ({"type": "function", "function": fn, "extra": 1}, "tools[0].extra")]:
        with pytest.raises(APIError) as exc:
            parse_tools([tool], None, None)
        assert exc.value.param == param


# ---- tools that are not strict: what the grammar can hold, the rest checked afterwards --------
ENV = {"type": "object", "properties": {"env": {
    "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
    "additionalProperties": {"type": "string"}}}, "required": ["env"]}


def test_a_schema_with_property_names_compiles_when_not_strict():
    grammar = compile_schema(ENV, "tools[0].parameters", strict=False)
    assert accepts(grammar, '{"env": {"PATH": "/bin"}}')
    assert not accepts(grammar, '{"env": {"PATH": 1}}')   # the rest is still held


def test_a_schema_with_property_names_is_a_400_when_strict():
    with pytest.raises(APIError) as exc:
        compile_schema(ENV, "tools[0].parameters")
    assert exc.value.param == "tools[0].parameters" and "propertyNames" in exc.value.message


def test_unenforceable_keywords_are_dropped_wherever_a_subschema_holds_them():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "not": {"const": ""}},
                 "uniqueItems": True},
        "mode": {"anyOf": [{"type": "string", "format": "no-such-format"}, {"type": "null"}]},
        "propertyNames": {"type": "integer"},   # a property that is named like a keyword
        "x": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "object", "dependentRequired": {"a": ["b"]}}},
        "if": {"required": ["tags"]}, "then": {"required": ["mode"]}}
    kept = enforceable_schema(schema, "p", strict=False)
    text = json.dumps(kept)
    for keyword in ('"not"', "uniqueItems", "no-such-format", "dependentRequired", '"if"', '"then"'):
        assert keyword not in text
    assert kept["properties"]["propertyNames"] == {"type": "integer"}
    assert kept["properties"]["tags"]["items"] == {"type": "string"}
    assert schema["properties"]["tags"]["uniqueItems"] is True   # the schema itself is untouched


def test_an_enforceable_schema_is_kept_as_it_is_when_not_strict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert enforceable_schema(schema, "p", strict=False) is schema


def test_a_schema_sent_again_is_compiled_once_and_gives_the_same_answer(monkeypatch):
    import server.openai.structured as structured
    compiled = []
    real = structured._compile
    monkeypatch.setattr(structured, "_compile", lambda *a: compiled.append(a) or real(*a))
    schema = {"type": "object", "properties": {"env": {"type": "object",
              "propertyNames": {"pattern": "^[A-Z]+$"}}, "n": {"type": "integer"}}}
    first = enforceable_schema(schema, "tools[0].parameters", strict=False)
    again = json.loads(json.dumps(schema))           # an equal schema, another object
    second = enforceable_schema(again, "tools[3].parameters", strict=False)
    assert len(compiled) == 1 and first == second and first is not second
    second["properties"]["n"]["type"] = "string"     # a caller's copy is its own
    assert enforceable_schema(schema, "p", strict=False) == first
    assert compile_schema(again, "p", strict=False) == compile_schema(schema, "q", strict=False)
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    enforceable_schema(plain, "p", strict=False)
    other = dict(plain)
    assert enforceable_schema(other, "p", strict=False) is other   # whole: the caller's own
    with pytest.raises(APIError) as exc:             # strict is another key; errors name
        compile_schema(again, "tools[7].parameters")  # the parameter of the request at hand
    assert exc.value.param == "tools[7].parameters"
    with pytest.raises(APIError) as exc:
        compile_schema(again, "tools[8].parameters")
    assert exc.value.param == "tools[8].parameters"


def test_an_invalid_or_unsatisfiable_schema_is_a_400_even_when_not_strict():
    for schema in ({"type": "object", "properties": {"a": {"type": 3}}},
                   {"allOf": [{"type": "string"}, {"type": "integer"}]}):
        with pytest.raises(APIError):
            compile_schema(schema, "p", strict=False)


def test_arguments_that_keep_the_schema_are_valid():
    assert validate_arguments(ENV, '{"env": {"PATH": "/bin"}}') is None


@pytest.mark.parametrize("arguments,words", [
    ('{"env": {"path": "/bin"}}', ["env", "path"]),
    ('{"env": {"PATH": 1}}', ["env/PATH", "string"]),
    ("{}", ["env", "required"]),
    ("{not json", ["not JSON"]),
])
def test_arguments_that_break_the_schema_name_the_first_violation(arguments, words):
    message = validate_arguments(ENV, arguments)
    assert message is not None and all(w in message for w in words)
