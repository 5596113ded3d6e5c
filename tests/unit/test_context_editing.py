"""Anthropic's context editing (server/anthropic/context.py) without a server: `context_management`
parsed and its edits applied to a request's messages, with a fake token counter (JSON characters
// 4, plus an offset to stand for the system prompt and tools)."""
import copy
import json

import pytest

from server.anthropic.context import (
    CLEARED_RESULT,
    ClearThinking,
    ClearToolUses,
    apply_edits,
    parse_edits,
)
from server.http.errors import APIError

TOOLS = "clear_tool_uses_20250919"
THINKING = "clear_thinking_20251015"


class Tokens:
    """A fake count_tokens that remembers how often it was called."""

    def __init__(self, offset: int = 0):
        self.offset, self.calls = offset, 0

    def __call__(self, messages: list[dict]) -> int:
        self.calls += 1
        return self.offset + len(json.dumps(messages)) // 4


def tool_history(*names: str, size: int = 400) -> list[dict]:
    """A user asks, then one tool round (a call and its result) per name, oldest first."""
    messages = [{"role": "user", "content": "Look around."}]
    for n, name in enumerate(names):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {n}."},
            {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": {"path": f"f{n}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"{n}" * size}]})
    return messages


def thinking_history(turns: int, size: int = 400) -> list[dict]:
    """`turns` question-and-answer turns, each answer with a thinking block, then a question."""
    messages = []
    for n in range(turns):
        messages.append({"role": "user", "content": f"Question {n}?"})
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"{n}" * size, "signature": f"sig{n}"},
            {"type": "text", "text": f"Answer {n}."}]})
    return messages + [{"role": "user", "content": "Last question?"}]


def edits(*items: dict):
    return parse_edits({"edits": list(items)})


def apply(items: list[dict], messages: list[dict], tokens: Tokens | None = None):
    return apply_edits(edits(*items), messages, tokens or Tokens())


def results(messages: list[dict]) -> list:
    return [b["content"] for m in messages if isinstance(m["content"], list)
            for b in m["content"] if b["type"] == "tool_result"]


def inputs(messages: list[dict]) -> list:
    return [b["input"] for m in messages if isinstance(m["content"], list)
            for b in m["content"] if b["type"] == "tool_use"]


def thoughts(messages: list[dict]) -> list[str]:
    return [b.get("thinking", "(redacted)") for m in messages if isinstance(m["content"], list)
            for b in m["content"] if b["type"] in ("thinking", "redacted_thinking")]


def low_trigger(**kw) -> dict:
    return {"type": TOOLS, "trigger": {"type": "input_tokens", "value": 10}, **kw}


def refused(value) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_edits(value)
    assert caught.value.status == 400
    return caught.value


# ---- parsing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, {}, {"edits": None}, {"edits": []}])
def test_absent_null_or_empty_context_management_asks_for_no_edit(value):
    assert parse_edits(value) is None


def test_a_bare_clear_tool_uses_edit_takes_anthropics_defaults():
    (edit,) = edits({"type": TOOLS}).edits
    assert edit == ClearToolUses(trigger="input_tokens", threshold=100_000, keep=3,
                                 clear_at_least=0, exclude_tools=frozenset(), clear_inputs=False)


def test_a_bare_clear_thinking_edit_keeps_one_thinking_turn():
    assert edits({"type": THINKING}).edits == (ClearThinking(keep=1),)


@pytest.mark.parametrize("keep", ["all", {"type": "all"}])
def test_clear_thinking_keep_all_is_read_in_both_of_its_spellings(keep):
    assert edits({"type": THINKING, "keep": keep}).edits == (ClearThinking(keep=None),)


def test_clear_thinking_must_be_listed_first_when_edits_are_combined():
    err = refused({"edits": [{"type": TOOLS}, {"type": THINKING}]})
    assert err.param == "context_management.edits" and THINKING in err.message
    assert len(edits({"type": THINKING}, {"type": TOOLS}).edits) == 2


def test_each_type_of_edit_may_be_given_once():
    assert refused({"edits": [{"type": TOOLS}, {"type": TOOLS}]}).param == \
        "context_management.edits.1.type"


def test_an_unknown_edit_type_is_a_400_naming_its_type_field():
    err = refused({"edits": [{"type": THINKING}, {"type": "clear_everything"}]})
    assert err.param == "context_management.edits.1.type"


def test_compaction_is_a_known_edit_refused_as_unsupported():
    err = refused({"edits": [{"type": "compact_20260112"}]})
    assert err.param == "context_management.edits.0.type" and err.code == "unsupported_parameter"


@pytest.mark.parametrize("value, param", [
    ("clear", "context_management"),
    ({"edits": {"type": TOOLS}}, "context_management.edits"),
    ({"edits": [], "strategy": "x"}, "context_management.strategy"),
    ({"edits": ["clear"]}, "context_management.edits.0"),
    ({"edits": [{"keep": "all"}]}, "context_management.edits.0.type"),
    ({"edits": [{"type": TOOLS, "trigger": 1000}]}, "context_management.edits.0.trigger"),
    ({"edits": [{"type": TOOLS, "trigger": {"type": "messages", "value": 5}}]},
     "context_management.edits.0.trigger.type"),
    ({"edits": [{"type": TOOLS, "trigger": {"type": "input_tokens", "value": "5"}}]},
     "context_management.edits.0.trigger.value"),
    ({"edits": [{"type": TOOLS, "trigger": {"type": "input_tokens", "value": 5.0}}]},
     "context_management.edits.0.trigger.value"),
    ({"edits": [{"type": TOOLS, "trigger": {"type": "input_tokens", "value": True}}]},
     "context_management.edits.0.trigger.value"),
    ({"edits": [{"type": TOOLS, "keep": {"type": "tool_uses", "value": -1}}]},
     "context_management.edits.0.keep.value"),
    ({"edits": [{"type": TOOLS, "keep": {"type": "input_tokens", "value": 3}}]},
     "context_management.edits.0.keep.type"),
    ({"edits": [{"type": TOOLS, "keep": {"type": "tool_uses", "value": 3, "x": 1}}]},
     "context_management.edits.0.keep.x"),
    ({"edits": [{"type": TOOLS, "clear_at_least": {"type": "tool_uses", "value": 3}}]},
     "context_management.edits.0.clear_at_least.type"),
    ({"edits": [{"type": TOOLS, "exclude_tools": "web_search"}]},
     "context_management.edits.0.exclude_tools"),
    ({"edits": [{"type": TOOLS, "exclude_tools": [1]}]},
     "context_management.edits.0.exclude_tools"),
    ({"edits": [{"type": TOOLS, "clear_tool_inputs": "yes"}]},
     "context_management.edits.0.clear_tool_inputs"),
    ({"edits": [{"type": TOOLS, "keep_recent": 3}]}, "context_management.edits.0.keep_recent"),
    ({"edits": [{"type": THINKING, "keep": {"type": "thinking_turns", "value": 0}}]},
     "context_management.edits.0.keep.value"),
    ({"edits": [{"type": THINKING, "keep": "none"}]}, "context_management.edits.0.keep"),
    ({"edits": [{"type": THINKING, "keep": {"type": "turns", "value": 2}}]},
     "context_management.edits.0.keep.type"),
    ({"edits": [{"type": THINKING, "trigger": {"type": "input_tokens", "value": 5}}]},
     "context_management.edits.0.trigger"),
])
def test_a_malformed_value_is_a_400_naming_its_field(value, param):
    assert refused(value).param == param


# ---- clearing tool uses ------------------------------------------------------------------------
def test_tool_results_stay_while_the_prompt_is_at_or_below_the_trigger():
    messages = tool_history("read", "read", "read", "read", "read")
    at = Tokens()(messages)
    out, applied = apply([low_trigger(trigger={"type": "input_tokens", "value": at})], messages)
    assert out == messages and applied == []


def test_above_the_trigger_all_but_the_three_most_recent_tool_results_are_cleared():
    messages = tool_history("read", "read", "read", "read", "read")
    out, applied = apply([low_trigger()], messages)
    assert results(out) == [CLEARED_RESULT] * 2 + ["2" * 400, "3" * 400, "4" * 400]
    assert applied[0]["cleared_tool_uses"] == 2


def test_the_default_trigger_is_100000_input_tokens():
    messages = tool_history("read", "read", "read", "read")
    size = Tokens()(messages)
    out, applied = apply([{"type": TOOLS}], messages, Tokens(offset=100_000 - size))
    assert out == messages and applied == []
    out, applied = apply([{"type": TOOLS}], messages, Tokens(offset=100_001 - size))
    assert results(out)[0] == CLEARED_RESULT and applied[0]["cleared_tool_uses"] == 1


def test_keep_n_leaves_the_n_most_recent_tool_uses_whole():
    messages = tool_history("read", "read", "read", "read", "read")
    out, _ = apply([low_trigger(keep={"type": "tool_uses", "value": 1})], messages)
    assert results(out) == [CLEARED_RESULT] * 4 + ["4" * 400]
    out, _ = apply([low_trigger(keep={"type": "tool_uses", "value": 0})], messages)
    assert results(out) == [CLEARED_RESULT] * 5


def test_keeping_more_tool_uses_than_the_history_holds_clears_nothing():
    messages = tool_history("read", "read")
    out, applied = apply([low_trigger(keep={"type": "tool_uses", "value": 7})], messages)
    assert out == messages and applied == []


def test_a_tool_uses_trigger_counts_tool_uses_and_needs_no_token_count():
    messages = tool_history("read", "read", "read", "read")
    tokens = Tokens()
    out, applied = apply([{"type": TOOLS, "trigger": {"type": "tool_uses", "value": 4}}],
                         messages, tokens)
    assert out == messages and applied == [] and tokens.calls == 0
    out, applied = apply([{"type": TOOLS, "trigger": {"type": "tool_uses", "value": 3}}],
                         messages)
    assert applied[0]["cleared_tool_uses"] == 1


def test_uses_of_excluded_tools_are_never_cleared():
    messages = tool_history("web_search", "read", "web_search", "read", "read", "read")
    out, applied = apply([low_trigger(exclude_tools=["web_search"])], messages)
    assert results(out) == ["0" * 400, CLEARED_RESULT, "2" * 400, "3" * 400, "4" * 400,
                            "5" * 400]
    assert applied[0]["cleared_tool_uses"] == 1


def test_tool_inputs_stay_unless_clear_tool_inputs_asks():
    messages = tool_history("read", "read", "read", "read")
    out, _ = apply([low_trigger()], messages)
    assert inputs(out) == inputs(messages)


def test_clear_tool_inputs_true_empties_the_inputs_of_the_cleared_uses():
    messages = tool_history("read", "grep", "read", "read", "read")
    out, applied = apply([low_trigger(clear_tool_inputs=True)], messages)
    assert inputs(out) == [{}, {}] + inputs(messages)[2:]
    assert applied[0]["cleared_tool_uses"] == 2


def test_clear_tool_inputs_as_a_list_empties_only_those_tools_inputs():
    messages = tool_history("read", "grep", "read", "read", "read")
    out, _ = apply([low_trigger(clear_tool_inputs=["grep"])], messages)
    assert inputs(out) == [{"path": "f0.py"}, {}] + inputs(messages)[2:]
    assert results(out)[:2] == [CLEARED_RESULT] * 2


def test_a_cleared_result_reads_the_placeholder_and_is_no_longer_an_error():
    messages = tool_history("read", "read", "read", "read")
    messages[2]["content"][0]["is_error"] = True
    out, _ = apply([low_trigger()], messages)
    assert out[2]["content"][0] == {"type": "tool_result", "tool_use_id": "toolu_0",
                                    "content": CLEARED_RESULT}


def test_an_edit_that_cannot_free_clear_at_least_tokens_is_not_applied():
    messages = tool_history("read", "read", "read", "read")   # one result of ~100 tokens to clear
    least = {"type": "input_tokens", "value": 500}
    out, applied = apply([low_trigger(clear_at_least=least)], messages)
    assert out == messages and applied == []


def test_an_edit_that_frees_clear_at_least_tokens_is_applied():
    messages = tool_history("read", "read", "read", "read")
    least = {"type": "input_tokens", "value": 50}
    out, applied = apply([low_trigger(clear_at_least=least)], messages)
    assert applied[0]["cleared_input_tokens"] >= 50 and results(out)[0] == CLEARED_RESULT


def test_clearing_results_shorter_than_the_placeholder_is_not_applied():
    messages = tool_history("read", "read", "read", "read", size=2)
    out, applied = apply([low_trigger()], messages)
    assert out == messages and applied == []


# ---- clearing thinking -------------------------------------------------------------------------
def test_clear_thinking_keep_all_leaves_the_history_as_it_is_and_counts_nothing():
    messages = thinking_history(4)
    tokens = Tokens()
    out, applied = apply([{"type": THINKING, "keep": "all"}], messages, tokens)
    assert out == messages and applied == [] and tokens.calls == 0


def test_clear_thinking_by_default_keeps_only_the_last_thinking_turn():
    out, applied = apply([{"type": THINKING}], thinking_history(4))
    assert thoughts(out) == ["3" * 400]
    assert [m["content"][-1]["text"] for m in out if m["role"] == "assistant"] == \
        ["Answer 0.", "Answer 1.", "Answer 2.", "Answer 3."]
    assert applied[0]["cleared_thinking_turns"] == 3


def test_clear_thinking_keep_n_keeps_the_last_n_thinking_turns():
    keep = {"type": "thinking_turns", "value": 2}
    out, applied = apply([{"type": THINKING, "keep": keep}], thinking_history(4))
    assert thoughts(out) == ["2" * 400, "3" * 400]
    assert applied[0]["cleared_thinking_turns"] == 2


def test_turns_without_thinking_do_not_count_toward_keep():
    messages = thinking_history(3)
    messages[5]["content"] = [{"type": "text", "text": "Answer 2."}]   # the last turn did not think
    out, _ = apply([{"type": THINKING}], messages)
    assert thoughts(out) == ["1" * 400]


def test_a_tool_use_loop_is_one_assistant_turn():
    messages = thinking_history(1) + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "a" * 400, "signature": "s"},
            {"type": "tool_use", "id": "toolu_9", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "data"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "b" * 400, "signature": "s"},
            {"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Thanks."}]
    out, applied = apply([{"type": THINKING}], messages)
    assert thoughts(out) == ["a" * 400, "b" * 400]
    assert applied[0]["cleared_thinking_turns"] == 1


def test_redacted_thinking_is_cleared_and_a_message_left_empty_is_dropped():
    messages = [
        {"role": "user", "content": "Q0?"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x" * 400}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A0."}]},
        {"role": "user", "content": "Q1?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t" * 400, "signature": "s"},
            {"type": "text", "text": "A1."}]},
        {"role": "user", "content": "Q2?"}]
    out, applied = apply([{"type": THINKING}], messages)
    assert out == messages[:1] + messages[2:]
    assert applied[0]["cleared_thinking_turns"] == 1


def test_fewer_thinking_turns_than_keep_clears_nothing():
    out, applied = apply([{"type": THINKING, "keep": {"type": "thinking_turns", "value": 5}}],
                         thinking_history(3))
    assert applied == [] and out == thinking_history(3)


# ---- both, and what is reported ----------------------------------------------------------------
def mixed_history() -> list[dict]:
    """Two finished turns that thought, then a tool loop that thinks and has four tool rounds."""
    messages = thinking_history(2)
    for n in range(4):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"loop{n}" * 50, "signature": "s"},
            {"type": "tool_use", "id": f"toolu_{n}", "name": "read", "input": {"n": n}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"{n}" * 400}]})
    return messages


def test_applied_edits_report_what_each_edit_cleared_in_the_order_run():
    messages = mixed_history()
    tokens = Tokens()
    original = Tokens()(messages)
    out, applied = apply([{"type": THINKING}, low_trigger()], messages, tokens)
    assert [a["type"] for a in applied] == [THINKING, TOOLS]
    assert applied[0]["cleared_thinking_turns"] == 2 and applied[1]["cleared_tool_uses"] == 1
    assert all(a["cleared_input_tokens"] > 0 for a in applied)
    assert original - sum(a["cleared_input_tokens"] for a in applied) == Tokens()(out)
    assert tokens.calls == 3   # once before, once after each edit


def test_the_tool_trigger_is_measured_after_thinking_was_cleared():
    messages = mixed_history()
    tokens = Tokens()
    _, applied = apply([{"type": THINKING}], messages, tokens)
    after_thinking = Tokens()(messages) - applied[0]["cleared_input_tokens"]
    trigger = {"type": "input_tokens", "value": after_thinking}
    out, applied = apply([{"type": THINKING}, {"type": TOOLS, "trigger": trigger}], messages)
    assert [a["type"] for a in applied] == [THINKING] and results(out) == results(messages)


def test_an_edit_that_changes_nothing_is_not_listed():
    messages = thinking_history(1)   # one thinking turn, no tool use
    tokens = Tokens()
    out, applied = apply([{"type": THINKING}, low_trigger()], messages, tokens)
    assert out == messages and applied == [] and tokens.calls == 1


def test_the_request_messages_are_never_changed():
    messages = mixed_history()
    messages[6]["content"][0]["is_error"] = False
    before = copy.deepcopy(messages)
    out, _ = apply([{"type": THINKING}, low_trigger(clear_tool_inputs=True)], messages)
    assert messages == before and out != before
