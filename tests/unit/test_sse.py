"""The SSE messages every streaming route sends (server/http/sse.py)."""
import asyncio
import json

from sse_starlette.event import ServerSentEvent

from server.http.sse import EventStream, json_data, message
from server.openai.completion_format import OpenAIFormat


def test_a_message_is_what_sse_starlettes_encoder_writes():
    for data, event in [('{"a": "b\\nc"}', None), ("[DONE]", None), ('{"x": 1}', "token"),
                        ("two\nlines\r\nthree", "done"), ("", None), ("ünïcode ✓", "e")]:
        assert message(data, event) == ServerSentEvent(data, event=event, sep="\n").encode()


def test_the_stream_sends_each_message_as_it_is_then_ends():
    async def body():
        yield message("one")
        yield message('{"k": 2}', "token")

    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        await asyncio.sleep(3600)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    asyncio.run(EventStream(body())(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"text/event-stream", ) == tuple(v.split(b";")[0] for k, v in sent[0]["headers"]
                                             if k == b"content-type")
    assert [m.get("body") for m in sent[1:]] == [b"data: one\n\n",
                                                  b'event: token\ndata: {"k": 2}\n\n', b""]
    assert sent[-1]["more_body"] is False


def test_json_data_escapes_what_splitlines_takes_for_a_line_break_and_nothing_else():
    """NEL, LS and PS in generated text: httpx's line reader (guidellm's SSE parser) splits at
    them, so a chunk carrying one raw reached guidellm as two broken lines (a JSONDecodeError it
    counted as a failed request). Escaped, each data line stays one line and decodes to the same
    text; other non-ASCII stays UTF-8."""
    text = "a\x85b\u2028c\u2029d é😀 \x0b\x0c\x1c"
    encoded = json_data({"t": text})
    assert json.loads(encoded) == {"t": text}
    assert encoded.splitlines() == [encoded]
    assert "é😀" in encoded and "\\u2028" in encoded
    assert json_data({"t": "plain é"}) == json.dumps({"t": "plain é"}, ensure_ascii=False)
    fmt = OpenAIFormat("chat", "m", "chatcmpl-1", 0, stream=True)
    for chunk in (fmt.text_chunk(text), fmt.text_chunk(text, [], 0), fmt.opening_chunks()[0]):
        lines = chunk.decode().splitlines()
        assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(fmt.text_chunk(text).decode()[6:])["choices"][0]["delta"]["content"] == text
