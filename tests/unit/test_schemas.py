"""Request schemas: strict numbers and booleans, and no lone surrogates anywhere."""
import json

import pytest
from pydantic import ValidationError

from server.api.embeddings import EmbeddingRequest
from server.api.models import DetokenizeRequest, TokenizeRequest
from server.openai.bodies import ChatCompletionRequest, CompletionRequest, find_lone_surrogate
from server.openai.responses_api import ResponsesRequest


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
