"""Ollama's options onto the service's request (server/ollama/options.py), its model names
(`name:latest`), its messages in and its answer objects out (server/ollama/shape.py), read back
with the official client's own types where it has them."""
import json
import time

import ollama
import pytest
from pydantic import ValidationError

from server.chat.answer import AnswerStream, Thinking
from server.errors import APIError
from server.ollama import options as opts
from server.ollama.bodies import OllamaChatRequest, OllamaEmbeddingsRequest, OllamaMessage
from server.ollama.options import OllamaOptions
from server.ollama.shape import (
    AnswerShape,
    Timing,
    expires_at,
    listed_name,
    resolve,
    statistics,
    to_chat,
)
from server.service.generation import Usage


def test_served_options_become_the_sampling_values():
    o = OllamaOptions(temperature=0.2, top_k=40, top_p=0.9, min_p=0.05, seed=3, stop=["\n\n"],
                      repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25)
    s = opts.sampling(o)
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.2, 40, 0.9, 0.05, 3)
    assert s.stop == ("\n\n",) and s.repetition_penalty == 1.1
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, 0.25)


def test_no_options_leave_every_value_to_the_model_or_engine():
    s = opts.sampling(None)
    assert s.temperature is s.top_k is s.seed is s.repetition_penalty is None and s.stop == ()


@pytest.mark.parametrize("num_predict, limit", [(None, None), (12, 12), (-1, None), (-2, None)])
def test_num_predict_is_the_token_limit(num_predict, limit):
    assert opts.max_tokens(OllamaOptions(num_predict=num_predict)) == limit


def test_num_ctx_bounds_the_prompt_and_its_answer_within_the_context():
    assert opts.within_context(OllamaOptions(num_ctx=100), 60, None, 2048) == 40
    assert opts.within_context(OllamaOptions(num_ctx=100), 60, 10, 2048) == 10
    assert opts.within_context(OllamaOptions(num_ctx=8192), 60, None, 2048) == 1988
    assert opts.within_context(None, 60, None, 2048) is None
    with pytest.raises(APIError) as err:
        opts.within_context(OllamaOptions(num_ctx=50), 60, None, 2048)
    assert err.value.status == 400 and err.value.param == "options.num_ctx"


@pytest.mark.parametrize("given", [
    {"mirostat": 0}, {"typical_p": 1.0}, {"tfs_z": 1.0}, {"num_gpu": 99}, {"num_thread": 8},
    {"use_mmap": False}, {"num_batch": 512}, {"mirostat_tau": 5.0}, {"repeat_last_n": 64},
    {"repeat_last_n": 128},                       # no penalty: the window changes nothing
    {"repeat_penalty": 1.1, "repeat_last_n": 64},
])
def test_neutral_and_runtime_options_are_accepted(given):
    opts.check(OllamaOptions(**given))


@pytest.mark.parametrize("given, name", [
    ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"), ({"tfs_z": 0.9}, "tfs_z"),
    ({"repeat_penalty": 1.2, "repeat_last_n": 256}, "repeat_last_n"),
    ({"presence_penalty": 0.5, "repeat_last_n": -1}, "repeat_last_n"),
    ({"num_predict": 0}, "num_predict"), ({"stop": [""]}, "stop"),
])
def test_options_that_would_change_the_answer_are_a_400_naming_them(given, name):
    with pytest.raises(APIError) as err:
        opts.check(OllamaOptions(**given))
    assert err.value.status == 400 and err.value.param == f"options.{name}"


@pytest.mark.parametrize("given", [{"temperature": 3.0}, {"top_p": 0}, {"no_such": 1},
                                   {"use_mmap": "yes"}, {"num_ctx": 0}, {"top_k": 1.5}])
def test_unknown_options_and_values_out_of_range_are_refused(given):
    with pytest.raises(ValidationError):
        OllamaOptions(**given)


def test_stream_absent_means_streamed():
    assert OllamaChatRequest(model="m").streamed
    assert not OllamaChatRequest(model="m", stream=False).streamed


# ---- names -------------------------------------------------------------------------------------
CATALOGUE = ["SmolLM2-135M-Instruct.Q4_1", "qwen3:0.6b"]


@pytest.mark.parametrize("asked, found", [
    ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1"),
    ("SmolLM2-135M-Instruct.Q4_1:latest", "SmolLM2-135M-Instruct.Q4_1"),
    ("smollm2-135m-instruct.q4_1:latest", "SmolLM2-135M-Instruct.Q4_1"),
    ("qwen3:0.6b", "qwen3:0.6b"), ("QWEN3:0.6B", "qwen3:0.6b"),
])
def test_names_as_ollama_clients_send_them(asked, found):
    assert resolve(asked, CATALOGUE) == found


@pytest.mark.parametrize("asked", ["qwen3", "qwen3:latest", "SmolLM2:latest", ""])
def test_an_unknown_name_is_a_404(asked):
    with pytest.raises(APIError) as err:
        resolve(asked, CATALOGUE)
    assert err.value.status == 404 and "SmolLM2-135M-Instruct.Q4_1:latest" in err.value.message


def test_listed_names_carry_a_tag():
    assert [listed_name(n) for n in CATALOGUE] == ["SmolLM2-135M-Instruct.Q4_1:latest",
                                                   "qwen3:0.6b"]


# ---- messages and answers ----------------------------------------------------------------------
def test_a_call_history_becomes_chat_messages_with_ids():
    messages = [OllamaMessage(**m) for m in [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "I should call it.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]]
    chat = to_chat(messages)
    call = chat[1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert chat[1]["reasoning_content"] == "I should call it."
    assert chat[2]["tool_call_id"] == call["id"] and chat[2]["name"] == "get_weather"


def test_images_are_refused_naming_the_message():
    with pytest.raises(APIError) as err:
        to_chat([OllamaMessage(role="user", content="x", images=["aGk="])])
    assert err.value.status == 400 and err.value.param == "messages[0].images"


def test_a_call_in_the_answer_is_an_ollama_tool_call_with_object_arguments():
    stream = AnswerStream(tools=True)
    pieces = stream.push('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                         "</tool_call>") + stream.end()
    last = AnswerShape("m:latest", chat=True).last(pieces, "stop", statistics(
        Timing(), Usage(30, 12, 8), 0.5, 1.5))
    parsed = ollama.ChatResponse.model_validate(last)
    (call,) = parsed.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert parsed.done and parsed.done_reason == "stop"
    assert parsed.prompt_eval_count == 22 and parsed.eval_count == 12    # cached ones not
    assert parsed.prompt_eval_duration == 500_000_000 and parsed.eval_duration == 1_000_000_000


def test_reasoning_comes_apart_as_thinking():
    stream = AnswerStream(thinking=Thinking.OPEN)
    shape = AnswerShape("m", chat=True)
    first = shape.pieces(stream.push("The user greets me.</think>\n\nHel"))
    last = ollama.ChatResponse.model_validate(shape.last(stream.push("lo") + stream.end(),
                                                         "stop", {}))
    assert first["message"]["thinking"] == "The user greets me."
    assert first["message"]["content"] + last.message.content == "Hello"
    generated = AnswerShape("m", chat=False).pieces(AnswerStream(thinking=Thinking.OPEN).push(
        "Hmm.</think>Hi"))
    assert (generated["thinking"], generated["response"]) == ("Hmm.", "Hi")


def test_generate_objects_carry_the_response_and_a_length_finish():
    shape = AnswerShape("m", chat=False)
    piece = shape.pieces(["Hel"])
    assert (piece["model"], piece["response"], piece["done"]) == ("m", "Hel", False)
    assert shape.pieces([]) is None
    last = ollama.GenerateResponse.model_validate(shape.last(["lo"], "length", {}))
    assert last.response == "lo" and last.done_reason == "length"


def test_a_model_kept_forever_never_expires_and_others_after_their_keep_alive():
    assert expires_at(-1, None) is None
    assert abs(expires_at(300, None) - (time.time() + 300)) < 1
    assert abs(expires_at(300, time.monotonic() - 100) - (time.time() + 200)) < 1


# ---- what Open WebUI sends ---------------------------------------------------------------------
def test_open_webuis_chat_body_is_read():
    body = OllamaChatRequest.model_validate({
        "model": "m", "stream": True, "metadata": {"chat_id": "c1", "message_id": "m1"},
        "num_predict": 64, "options": {"temperature": 0.7, "num_gpu": 1, "use_mmap": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "w", "arguments": {}}}]},
            {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}]})
    assert opts.max_tokens(body.options, body.num_predict) == 64
    assert to_chat(body.messages)[2]["tool_call_id"] == "call_1"


def test_options_num_predict_wins_over_the_bodys_own():
    assert opts.max_tokens(OllamaOptions(num_predict=8), 64) == 8
    assert opts.max_tokens(None, -1) is None
    with pytest.raises(APIError):
        opts.max_tokens(None, 0)


def test_the_older_embeddings_route_takes_open_webuis_input_beside_the_prompt():
    body = OllamaEmbeddingsRequest.model_validate({"model": "m", "prompt": "a\nb",
                                                    "input": ["a", "b"], "truncate": True})
    assert body.prompt == "a\nb"
