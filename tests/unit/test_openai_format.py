"""OpenAI response shaping (server/openai_format.py), with a stand-in engine request."""
import json
from types import SimpleNamespace

from scheduler import FinishReason
from server.openai_format import OpenAIFormat

REQ = SimpleNamespace(prompt=[1, 2, 3], num_output=4, num_cached=0)
CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def fmt(**kw):
    return OpenAIFormat(kw.pop("kind", "chat"), "m", "chatcmpl-1", 0, **kw)


def data(chunk):
    return json.loads(chunk["data"])


def test_a_timeout_is_reported_as_length():
    body = fmt().response("hi", FinishReason.TIMEOUT, REQ)
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_tool_call_becomes_message_tool_calls_with_finish_reason_tool_calls():
    choice = fmt(tools=True).response(CALL, FinishReason.STOP, REQ)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_without_tools_a_tagged_call_stays_text():
    choice = fmt().response(CALL, FinishReason.STOP, REQ)["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]


def test_streamed_tool_calls_are_a_name_delta_then_an_arguments_delta_then_the_finish():
    chunks = [data(c)["choices"][0] for c in fmt(tools=True).closing_chunks(CALL, FinishReason.STOP)]
    head, args, end = chunks
    call = head["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["function"]["name"] == "f"
    assert args["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert end["finish_reason"] == "tool_calls"


def test_usage_counts_prompt_and_completion_tokens():
    usage = fmt().response("x", FinishReason.STOP, REQ)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 4, 7)


def test_completions_echo_puts_the_prompt_before_the_text():
    body = fmt(kind="completion", echo="Q: ").response("A", FinishReason.STOP, REQ)
    assert body["choices"][0]["text"] == "Q: A" and body["object"] == "text_completion"
