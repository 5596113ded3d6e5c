"""The SSE messages every streaming route sends (server/sse.py)."""
import asyncio

from sse_starlette.event import ServerSentEvent

from server.sse import EventStream, message


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
