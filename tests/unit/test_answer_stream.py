"""An answer told apart as it streams (server/chat/answer.py, server/chat/tool_calls.py): text goes out
at once, only what may start a tag is held, and streaming a text in any pieces gives what the
whole text gives."""
import json

import pytest

from server.chat.answer import AnswerStream, Reasoning, Thinking, split_answer
from server.chat.tool_calls import CallSplitter, ToolCall, parse_tool_calls

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def streamed(pieces, **kw):
    stream = AnswerStream(**kw)
    out = []
    for p in pieces:
        out.append(stream.push(p))
    out.append(stream.end())
    return out


def flat(steps):
    return [p for step in steps for p in step]


def test_text_before_a_call_goes_out_as_it_is_generated():
    steps = streamed(["Let", " me", " look", "."], tools=True)
    assert steps[:4] == [["Let"], [" me"], [" look"], ["."]]


def test_a_partial_call_tag_is_held_until_it_is_told_apart():
    steps = streamed(["Hi <tool", "_ca"], tools=True)
    assert steps[0] == ["Hi"] and steps[1] == []
    assert steps[2] == [" <tool_ca"]     # the answer ended: it was text after all


def test_a_call_goes_out_whole_when_its_closing_tag_arrives():
    steps = streamed(["<tool_call>", '{"name": "f", ', '"arguments": {"a": 1}}', "</tool_call>"],
                     tools=True)
    assert steps[:3] == [[], [], []]
    (call,) = steps[3]
    assert isinstance(call, ToolCall) and call.name == "f" and json.loads(call.arguments) == {"a": 1}


@pytest.mark.parametrize("text", [
    "Sure.\n" + CALL + "\nDone",
    "  " + CALL + CALL + "  ",
    "plain answer \n\n",
    "<tool_call>not json</tool_call> and more",
    "I will look. <tool_call>{\"na",
    "<think>\nhmm, a call?\n</think>\n\n" + CALL,
    "<thin",
])
@pytest.mark.parametrize("kw", [dict(tools=True), dict(tools=True, thinking=Thinking.MAYBE)])
def test_any_cut_of_a_text_into_pieces_gives_what_the_whole_text_gives(text, kw):
    whole = split_answer(text, **kw)
    for size in (1, 2, 3, 7):
        a = split_answer("", **kw)
        a.add(flat(streamed([text[i:i + size] for i in range(0, len(text), size)], **kw)))
        assert (a.text, a.reasoning, [(c.name, c.arguments) for c in a.calls]) == \
            (whole.text, whole.reasoning, [(c.name, c.arguments) for c in whole.calls]), size


def test_an_answer_without_calls_comes_out_exactly_as_written():
    text = "  two spaces, a tag-like <tool but no call \n"
    assert parse_tool_calls(text) == (text, [])


def test_text_after_a_call_keeps_its_separation_from_the_text_before():
    text, calls = parse_tool_calls("Sure.\n" + CALL + "\nDone")
    assert text == "Sure.\nDone" and len(calls) == 1


def test_with_first_only_a_second_call_is_dropped():
    splitter = CallSplitter(first_only=True)
    pieces = splitter.push(CALL + "\n" + CALL.replace('"f"', '"g"')) + splitter.end()
    assert [p.name for p in pieces if isinstance(p, ToolCall)] == ["f"]


def test_reasoning_the_model_opens_is_told_apart_from_the_answer():
    a = split_answer("<think>\nLet me think.\n</think>\n\nParis.", thinking=Thinking.MAYBE)
    assert (a.reasoning, a.text) == ("Let me think.", "Paris.")


def test_reasoning_the_prompt_opened_ends_at_the_closing_tag():
    a = split_answer("Hmm.\n</think>\n\nParis.", thinking=Thinking.OPEN)
    assert (a.reasoning, a.text) == ("Hmm.", "Paris.")


def test_a_thinking_model_that_does_not_think_answers_plain_text():
    a = split_answer("Paris, of course.", thinking=Thinking.MAYBE)
    assert (a.reasoning, a.text) == ("", "Paris, of course.")


def test_reasoning_streams_as_its_own_pieces_before_the_answer():
    steps = streamed(["<think>", "a b", " c</thi", "nk>", "Yes"], thinking=Thinking.MAYBE)
    kinds = [(type(p).__name__, str(p)) for p in flat(steps)]
    assert kinds == [("Reasoning", "a b"), ("Reasoning", " c"), ("str", "Yes")]


def test_an_answer_cut_off_while_thinking_is_all_reasoning():
    a = split_answer("<think>still thinking", thinking=Thinking.MAYBE)
    assert (a.reasoning, a.text) == ("still thinking", "")


def test_a_call_inside_the_reasoning_is_not_a_call():
    a = split_answer("<think>maybe " + CALL + "</think>No call.", tools=True,
                     thinking=Thinking.MAYBE)
    assert a.calls == [] and a.text == "No call." and "<tool_call>" in a.reasoning


def test_reasoning_pieces_are_strings_of_their_own_type():
    (piece,) = [p for p in flat(streamed(["<think>x</think>"], thinking=Thinking.MAYBE))]
    assert isinstance(piece, Reasoning) and piece == "x"
