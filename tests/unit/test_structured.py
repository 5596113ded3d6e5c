"""The schema engine's front door: schemas become GBNF or a 400 naming what is wrong, and which
request fields are refused, ignored or served (no model loaded)."""
import pytest

from engine.grammar import GrammarError, schema_to_gbnf
from server.errors import APIError
from server.fields import UNSUPPORTED_CHAT, check_fields
from server.schemas import ChatCompletionRequest
from server.structured import compile_schema


def chat(**extra):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def test_a_schema_with_properties_compiles_to_a_grammar_with_a_root_rule():
    gbnf = schema_to_gbnf({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert "root ::=" in gbnf


def test_a_type_the_converter_does_not_know_is_a_grammar_error():
    with pytest.raises(GrammarError):
        schema_to_gbnf({"type": "frob"})


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


def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it_and_where():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}
    with pytest.raises(APIError) as exc:
        compile_schema(schema, "json_schema")
    assert "'maximum' at #/properties/n" in exc.value.message


def test_a_property_named_like_a_keyword_is_not_mistaken_for_one():
    compile_schema({"type": "object", "properties": {"minimum": {"type": "integer"}}}, "json_schema")
