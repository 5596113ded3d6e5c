"""Request schemas: strict numbers and booleans, and no lone surrogates anywhere."""
import json

import pytest
from pydantic import ValidationError

from server.api.embeddings import EmbeddingRequest
from server.api.models import DetokenizeRequest, TokenizeRequest
from server.openai.bodies import ChatCompletionRequest, CompletionRequest, find_lone_surrogate
from server.openai.responses_body import ResponsesRequest


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def error_of(fields: dict) -> dict:
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    return exc.value.errors()[0]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", "16"), ("max_tokens", 16.0), ("priority", False),
    ("timeout", float("inf")), ("temperature", float("nan")), ("temperature", "0.5"),
    ("stream", "true"), ("ignore_eos", 1), ("seed", 1.5), ("top_k", 2**40),
    ("prompt", [1, True]), ("prompt", [[1], [2, False]]), ("prompt", [-1]),
    ("prompt", [[2**31]]), ("echo", 0), ("max_tokens", -1), ("n", 0), ("n", 2.0)])
def test_a_loosely_typed_value_is_rejected(field, value):
    assert error_of({field: value})["loc"][0] == field


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model,base,field,value", [
    (ChatCompletionRequest, CHAT, "logprobs", "true"),
    (ChatCompletionRequest, CHAT, "top_logprobs", True),
    (ChatCompletionRequest, CHAT, "add_generation_prompt", 1),
    (ChatCompletionRequest, CHAT, "continue_final_message", "false"),
    (ChatCompletionRequest, CHAT, "parallel_tool_calls", 0),
    (ChatCompletionRequest, CHAT, "n", True),
    (ChatCompletionRequest, CHAT, "logit_bias", {"1": "5"}),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, "logprobs", True),
    (ResponsesRequest, {"model": "m", "input": "hi"}, "max_output_tokens", "16"),
    (ResponsesRequest, {"model": "m", "input": "hi"}, "store", 0),
    (EmbeddingRequest, {"model": "m", "input": "hi"}, "dimensions", 8.0),
    (EmbeddingRequest, {"model": "m"}, "input", [1, True]),
    (TokenizeRequest, {"content": "hi"}, "add_special", 1),
    (DetokenizeRequest, {}, "tokens", [1.0]),
])
def test_main_surface_fields_are_strict_too(model, base, field, value):
    with pytest.raises(ValidationError) as exc:
        model.model_validate({**base, field: value})
    assert exc.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("model,body,where", [
    (ResponsesRequest, {"model": "m", "input": [{"role": "user", "content": "\ud800"}]},
     "input.0.content"),
    (EmbeddingRequest, {"model": "m", "input": ["a", "\udc00"]}, "input.1"),
    (TokenizeRequest, {"content": "x\udfff"}, "content"),
    (DetokenizeRequest, {"tokens": [1], "model": "\ud800"}, "model"),
])
def test_every_body_refuses_a_lone_surrogate(model, body, where):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    error = exc.value.errors()[0]
    assert error["type"] == "invalid_unicode" and error["ctx"]["where"] == where


def test_unknown_fields_are_kept_for_server_fields_to_refuse():
    body = ChatCompletionRequest.model_validate({**CHAT, "guided_json": {}, "n": 3})
    assert body.model_extra == {"guided_json": {}} and body.n == 3


def test_an_integer_is_still_a_valid_float():
    assert completion(temperature=1, timeout=2).temperature == 1.0


def test_a_lone_surrogate_is_found_with_its_path():
    body = json.loads('{"messages": [{"role": "user", "content": [{"type": "text", '
                      '"text": "ok"}, {"type": "text", "text": "a\\udfffb"}]}]}')
    assert find_lone_surrogate(body) == "messages.0.content.1.text"


def test_a_surrogate_pair_is_valid_text():
    assert find_lone_surrogate(json.loads('{"prompt": "\\ud83d\\ude00"}')) is None


def test_a_lone_surrogate_in_a_key_is_found_too():
    assert find_lone_surrogate({"extra": {"k\ud800": 1}}) == "extra.k\ud800"


def test_a_body_with_a_lone_surrogate_fails_validation_naming_the_field():
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": "\ud800"}]})
    error = exc.value.errors()[0]
    assert error["type"] == "invalid_unicode" and error["ctx"]["where"] == "messages.0.name"


def test_max_tokens_0_and_prompt_lists_are_valid():
    body = completion(max_tokens=0, echo=True, prompt=[[1, 2], [3]], n=2)
    assert body.max_tokens == 0 and body.prompt == [[1, 2], [3]] and body.n == 2
    assert completion(prompt=["a", "b"]).prompt == ["a", "b"]


def test_every_prompt_of_a_list_is_checked_for_lone_surrogates():
    error = error_of({"prompt": ["ok", "fine", "a\udc00"]})
    assert error["type"] == "invalid_unicode" and error["ctx"]["where"] == "prompt.2"


# ---- the OpenAPI schema states what is accepted ------------------------------------------------
from pathlib import Path  # noqa: E402

import jsonschema  # noqa: E402

from server.anthropic.messages_body import (  # noqa: E402
    CountTokensRequest,
    MessagesRequest,
)
from server.anthropic.messages_body import check_fields as check_messages  # noqa: E402
from server.http.errors import APIError  # noqa: E402
from server.main import app  # noqa: E402
from server.openai.bodies import GenerateRequest  # noqa: E402
from server.openai.fields import check_fields  # noqa: E402
from server.openai.responses_body import reject_unsupported  # noqa: E402

DOC = app.openapi()
BODIES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
          "/v1/responses": "ResponsesRequest", "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest", "/v1/embeddings": "EmbeddingRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/generate_stream": "GenerateRequest"}
SCHEMAS = DOC["components"]["schemas"]


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator of one of the document's schemas (its $refs resolved in the document)."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": DOC["components"]})


@pytest.mark.parametrize("path,name", sorted(BODIES.items()))
def test_every_request_body_refuses_unknown_fields_in_its_schema(path, name):
    ref = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": f"#/components/schemas/{name}"}
    assert SCHEMAS[name]["additionalProperties"] is False
    assert SCHEMAS["StreamOptions"]["additionalProperties"] is False


@pytest.mark.parametrize("name,fields", [
    ("ChatCompletionRequest", {"user", "metadata", "store", "service_tier", "safety_identifier",
                               "prompt_cache_key", "prompt_cache_retention", "rid",
                               "skip_special_tokens", "min_tokens"}),
    ("CompletionRequest", {"user", "metadata", "prompt_cache_key", "best_of"}),
    ("ResponsesRequest", {"user", "metadata", "prompt_cache_key", "client_metadata", "include",
                          "reasoning", "truncation", "service_tier", "safety_identifier",
                          "prompt_cache_retention", "store", "text", "tools"}),
    ("MessagesRequest", {"metadata", "context_management", "output_config", "cache_control",
                         "service_tier", "inference_geo", "speed", "thinking"}),
    ("CountTokensRequest", {"metadata", "context_management", "output_config", "cache_control"}),
    ("EmbeddingRequest", {"user", "encoding_format", "dimensions"}),
])
def test_the_fields_agents_send_are_declared(name, fields):
    assert fields <= set(SCHEMAS[name]["properties"])


@pytest.mark.parametrize("name", ["ResponsesRequest", "GenerateRequest"])
def test_fields_a_route_refuses_whatever_their_value_are_not_declared(name):
    refused = {"ResponsesRequest": {"response_format", "json_schema", "grammar"},
               "GenerateRequest": {"stream_options"}}[name]
    assert not refused & set(SCHEMAS[name]["properties"])


def test_the_bodies_agents_really_send_are_valid_by_the_schema():
    """Claude Code's, Codex's and opencode's recorded requests (tests/fixtures/agents)."""
    fixtures = sorted((Path(__file__).parent.parent / "fixtures" / "agents").glob("*.json"))
    assert fixtures
    for f in fixtures:
        recorded = json.loads(f.read_text())
        errors = list(validator(BODIES[recorded["path"]]).iter_errors(recorded["body"]))
        assert not errors, (f.name, [e.message for e in errors][:3])


def _chat(body: dict) -> None:
    check_fields(ChatCompletionRequest.model_validate(body), frozenset())


CHECKED_BY = [
    (ChatCompletionRequest, CHAT, _chat),
    (ResponsesRequest, {"model": "m", "input": "hi"},
     lambda b: reject_unsupported(ResponsesRequest.model_validate(b))),
    (MessagesRequest, {"model": "m", "max_tokens": 8, "messages": [{"role": "user",
                                                                    "content": "hi"}]},
     lambda b: check_messages(MessagesRequest.model_validate(b))),
    (CountTokensRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
     lambda b: check_messages(CountTokensRequest.model_validate(b))),
    (GenerateRequest, {"prompt": "hi"},
     lambda b: check_fields(GenerateRequest.model_validate(b), frozenset())),
]


@pytest.mark.parametrize("model,body,check", CHECKED_BY, ids=lambda v: getattr(v, "__name__", ""))
def test_a_declared_extra_field_is_accepted_with_its_type_and_refused_with_another(model, body,
                                                                                  check):
    """Each field the schema declares beyond the model's own (kept as an extra at run time): a
    value the schema allows passes the route's check; null is the same as leaving it out; a
    value the schema does not allow is a 400 naming it."""
    valid = validator(model.__name__)
    assert model.EXTRAS
    for field, schema in model.EXTRAS.items():
        if field in model.model_fields:
            continue
        value = _example(schema)
        for ok in (value, None):
            assert valid.is_valid({**body, field: ok}), (field, ok)
            check({**body, field: ok})
        wrong = "x" if isinstance(value, (dict, list)) else {"x": 1}
        assert not valid.is_valid({**body, field: wrong}), field
        with pytest.raises(APIError) as exc:
            check({**body, field: wrong})
        assert exc.value.status == 400 and (exc.value.param or "").startswith(field), field


def _example(schema: dict):
    """A value other than null that the schema allows."""
    for branch in schema.get("anyOf", [schema]):
        if "enum" in branch and any(v is not None for v in branch["enum"]):
            return next(v for v in branch["enum"] if v is not None)
        kind = branch.get("type")
        kind = next(k for k in kind if k != "null") if isinstance(kind, list) else kind
        if kind in ("string", "boolean", "object", "array"):
            return {"string": "x", "boolean": True, "object": {}, "array": []}[kind]
    raise AssertionError(f"no example for {schema}")


@pytest.mark.parametrize("model,base,fields", [
    (ChatCompletionRequest, CHAT, ("n", "stream")),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, ("n", "stream", "echo")),
    (ResponsesRequest, {"model": "m", "input": "hi"}, ("n", "stream")),
    (GenerateRequest, {"prompt": "hi"}, ("n", "stream")),
    (MessagesRequest, {"model": "m", "max_tokens": 8, "messages": [{}]}, ("stream",)),
])
def test_a_null_the_schema_allows_is_the_default(model, base, fields):
    valid = validator(model.__name__)
    default = model.model_validate(base)
    for field in fields:
        assert valid.is_valid({**base, field: None}), field
        body = model.model_validate({**base, field: None})
        assert getattr(body, field) == getattr(default, field) and not body.model_extra


def test_streamed_answers_are_event_streams_whose_events_the_schema_describes():
    streamed = {"/v1/chat/completions": "message", "/v1/completions": "message",
                "/v1/responses": "response.output_text.delta", "/v1/messages": "message_start",
                "/generate_stream": "token"}
    for path, event in streamed.items():
        content = DOC["paths"][path]["post"]["responses"]["200"]["content"]
        schema = content["text/event-stream"]["schema"]
        check = jsonschema.Draft202012Validator(schema)
        assert check.is_valid({"event": event, "data": "{}"}), path
        assert not check.is_valid({"event": "bogus", "data": "{}"}), path
        assert not check.is_valid("data: {}"), path


@pytest.mark.parametrize("key", ["\u00b2", "-1", "x", ""])
def test_a_logit_bias_key_is_ascii_digits_as_the_schema_says(key):
    """"²" is a digit to str.isdigit but not to int(): it must be a 400, never a 500."""
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {key: 1}})
    assert exc.value.errors()[0]["loc"] == ("logit_bias",)
    assert not validator("ChatCompletionRequest").is_valid({**CHAT, "logit_bias": {key: 1}})
