"""OpenAI response shaping (server/openai/completion_format.py), with a stand-in engine request."""
import json
from types import SimpleNamespace

import pytest

from engine.logprobs import TokenLogprob
from scheduler import FinishReason
from server.openai.completion_format import OpenAIFormat, usage
from server.service.generation import Collected, Generation, Part, Usage

REQ = Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=0)
CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def fmt(**kw):
    return OpenAIFormat(kw.pop("kind", "chat"), "m", "chatcmpl-1", 0, **kw)


def answer(f, text, finish=FinishReason.STOP, **kw):
    return f.response([Collected(text, finish, [], **kw)], usage(REQ))


def data(chunk: bytes):
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2
    return json.loads(chunk[6:])


def test_a_timeout_is_reported_as_length():
    body = answer(fmt(), "hi", FinishReason.TIMEOUT)
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_tool_call_becomes_message_tool_calls_with_finish_reason_tool_calls():
    choice = answer(fmt(tools=True), CALL)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_without_tools_a_tagged_call_stays_text():
    choice = answer(fmt(), CALL)["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]


def test_streamed_tool_calls_are_a_name_delta_then_an_arguments_delta_then_the_finish():
    chunks = [data(c)["choices"][0] for c in fmt(tools=True).closing_chunks(CALL, FinishReason.STOP)]
    head, args, end = chunks
    call = head["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["function"]["name"] == "f"
    assert args["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert end["finish_reason"] == "tool_calls"


def test_usage_counts_prompt_and_completion_tokens():
    usage = answer(fmt(), "x")["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 4, 7)


def test_completions_echo_puts_the_prompt_before_the_text():
    body = answer(fmt(kind="completion", echo=["Q: "]), "A")
    assert body["choices"][0]["text"] == "Q: A" and body["object"] == "text_completion"


def piece(text, lp, top=()):
    return TokenLogprob(0, text.encode(), lp, top)


def test_echo_logprobs_put_the_prompt_tokens_first_and_the_first_one_has_none():
    f = fmt(kind="completion", echo=["Q: "])
    prompt = [piece("Q", None), piece(":", -1.0, ((0, b":", -1.0),)), piece(" ", -2.0)]
    lps = answer(f, "A", prompt_logprobs=prompt)["choices"][0]["logprobs"]
    lps_gen = f.response([Collected("A", FinishReason.STOP, [piece("A", -0.5)],
                                    prompt_logprobs=prompt)], usage(REQ))["choices"][0]["logprobs"]
    assert lps["tokens"] == ["Q", ":", " "] and lps["token_logprobs"] == [None, -1.0, -2.0]
    assert lps["top_logprobs"][:2] == [None, {":": -1.0}] and lps["text_offset"] == [0, 1, 2]
    assert lps_gen["tokens"][-1] == "A" and lps_gen["text_offset"][-1] == 3


def test_choices_are_indexed_and_each_gets_its_prompts_echo():
    f = fmt(kind="completion", echo=["a", "b"], n=2, num_choices=4)
    body = f.response([Collected(str(i), FinishReason.STOP, [], index=i) for i in range(4)],
                      usage(REQ))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b2"), (3, "b3")]


def test_streamed_chunks_carry_their_choice_index():
    f = fmt(n=2, num_choices=2, stream=True)
    assert [data(c)["choices"][0]["index"] for c in f.opening_chunks()] == [0, 1]
    assert data(f.text_chunk("x", index=1))["choices"][0]["index"] == 1
    end = data(f.closing_chunks("", FinishReason.LENGTH, 1)[-1])["choices"][0]
    assert end["index"] == 1 and end["finish_reason"] == "length"


def test_usage_counts_every_choice_and_each_prompt_once():
    a = SimpleNamespace(prompt=[1, 2], num_output=3, num_cached=0)
    b = SimpleNamespace(prompt=[1, 2], num_output=5, num_cached=0)
    first = SimpleNamespace(prompt=[1, 2], num_output=1, num_cached=2, group=None)
    first.group = [first, a, b]
    u = usage(Generation(None, [Part(None, first)], None, None).usage())
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (2, 9, 11)


# ---- a call cut off by max_tokens ------------------------------------------------------------
CUT = CALL + '\n<tool_call>\n{"name": "f", "argu'


def test_a_call_cut_off_by_the_limit_is_not_content_and_the_finish_says_length():
    choice = answer(fmt(tools=True), CUT, FinishReason.LENGTH)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]


def test_streamed_a_call_cut_off_by_the_limit_ends_with_length_and_no_markup():
    chunks = [data(c)["choices"][0] for c in
              fmt(tools=True).closing_chunks(CUT, FinishReason.LENGTH)]
    assert not any("<tool_call" in (c["delta"].get("content") or "") for c in chunks)
    assert len([c for c in chunks if "tool_calls" in c["delta"]]) == 2   # name, then arguments
    assert chunks[-1]["finish_reason"] == "length"


def test_an_answer_cut_inside_its_only_call_is_empty_with_length():
    choice = answer(fmt(tools=True), 'Sure. <tool_call>{"na', FinishReason.LENGTH)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sure."}
    assert choice["finish_reason"] == "length"


# ---- streamed completions logprobs: offsets run on across chunks ------------------------------
def test_streamed_text_offsets_continue_from_the_echo_and_across_chunks():
    f = fmt(kind="completion", echo=["Q: "], n=2, num_choices=2)
    offsets = {0: [], 1: []}
    for index, text in [(0, "ab"), (1, "x"), (0, "c"), (1, "yz")]:
        choice = data(f.text_chunk(text, [piece(text, -0.1)], index))["choices"][0]
        offsets[index] += choice["logprobs"]["text_offset"]
    assert offsets == {0: [3, 5], 1: [3, 4]}
    whole = f.response([Collected("abc", FinishReason.STOP, [piece("ab", -0.1), piece("c", -0.1)])],
                       usage(REQ))["choices"][0]["logprobs"]["text_offset"]
    assert whole == offsets[0]


def test_completions_top_logprobs_hold_the_chosen_token_too():
    """OpenAI's legacy completions: up to logprobs + 1 entries, the sampled token always in."""
    f = fmt(kind="completion")
    item = piece("b", -3.0, ((0, b"a", -0.1),))
    lps = f.response([Collected("b", FinishReason.STOP, [item])], usage(REQ))["choices"][0]
    assert lps["logprobs"]["top_logprobs"] == [{"a": -0.1, "b": -3.0}]


def test_a_streamed_text_chunk_is_the_message_the_dict_path_makes():
    """text_chunk's per-token frame (bytes around the quoted text and the usage) gives the same
    bytes as building the chunk's dict, for both kinds, any choice, with and without usage (at
    the end, or in every chunk), and for text that JSON escapes or that holds the frame's own
    markers."""
    tally = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}

    def usage_now():
        tally["completion_tokens"] += 1
        tally["total_tokens"] += 1
        return dict(tally)

    for kind in ("chat", "completion"):
        for usage_mode in ("none", "last", "continuous"):
            f = fmt(kind=kind, stream=True, include_usage=usage_mode != "none", n=2, num_choices=2,
                    continuous_usage=usage_mode == "continuous")
            if usage_mode == "continuous":
                f.usage_now = usage_now
            for text in ("hi", ' "q" \\ \n\t', "", "\ue000text\ue000", "\ue000usage\ue000", "é😀"):
                for i in (0, 1):
                    delta = {"content": text} if kind == "chat" else text
                    chunk = f.text_chunk(text, None, i)
                    n = tally["completion_tokens"]
                    if usage_mode == "continuous":
                        tally["completion_tokens"] -= 1   # the dict path counts this chunk again
                        tally["total_tokens"] -= 1
                    assert chunk == f._chunk(delta, None, None, i)
                    body = data(chunk)
                    choice = body["choices"][0]
                    assert choice["index"] == i
                    assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == text
                    assert ("usage" in body) == (usage_mode != "none")
                    if usage_mode == "continuous":
                        assert body["usage"]["completion_tokens"] == n
                    elif usage_mode == "last":
                        assert body["usage"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_call_that_breaks_its_functions_schema_is_a_call_unless_it_is_strict(stream):
    """As OpenAI returns one: a call to a function that is not strict is a call whatever its
    arguments (the client checks them); one that breaks a strict function's schema (written
    under tool_choice "auto", which no grammar holds) stays text, as on /v1/responses and
    /v1/messages."""
    from server.chat.tool_calls import Function
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    written = '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>'
    for strict in (False, True):
        fmt = OpenAIFormat("chat", "m", "chatcmpl-1", 0, tools=True,
                           functions=[Function("get_weather", "", schema, strict=strict)])
        if stream:
            deltas = [data(c)["choices"][0] for c in fmt.piece_chunks(written)
                      + fmt.closing_chunks("", FinishReason.STOP)]
            calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
            text = "".join(d["delta"].get("content") or "" for d in deltas)
            reason = deltas[-1]["finish_reason"]
            arguments = "".join(c["function"]["arguments"] for c in calls)
        else:
            message, reason = fmt._message(written, FinishReason.STOP)
            calls, text = message.get("tool_calls", []), message["content"]
            arguments = calls[0]["function"]["arguments"] if calls else None
        if strict:
            assert (calls, text, reason) == ([], written, "stop")
        else:
            assert calls[0]["function"]["name"] == "get_weather" and not text
            assert json.loads(arguments) == {"town": 1} and reason == "tool_calls"
