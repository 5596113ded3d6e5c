"""Incremental detokenization: whole characters only, stop strings never leak."""
from engine.detok import TextStream

PIECES = {1: b"h", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b" world",
          5: "😀".encode()[:2], 6: "😀".encode()[2:], 7: b"END", 8: b"E", 9: b"ND", 10: b"x"}


def feed(stream, tokens):
    out, stopped = [], False
    for t in tokens:
        text, stopped = stream.push(t)
        out.append(text)
        if stopped:
            break
    return out, stopped


def test_a_character_split_across_tokens_is_emitted_whole():
    out, _ = feed(TextStream(PIECES.get), [1, 2, 3, 5, 6])
    assert out == ["h", "", "é", "", "😀"]


def test_text_before_a_stop_string_is_emitted_and_the_stop_is_not():
    out, stopped = feed(TextStream(PIECES.get, ["END"]), [1, 4, 7, 10])
    assert stopped and "".join(out) == "h world"


def test_a_stop_string_split_across_tokens_is_held_back_then_dropped():
    out, stopped = feed(TextStream(PIECES.get, ["END"]), [1, 8, 9])
    assert out == ["h", "", ""] and stopped


def test_held_back_text_is_released_when_it_is_not_a_stop():
    stream = TextStream(PIECES.get, ["END"])
    out, stopped = feed(stream, [8, 10])
    assert out == ["", "Ex"] and not stopped


def test_flush_returns_held_text_at_the_end():
    stream = TextStream(PIECES.get, ["END"])
    assert stream.push(8) == ("", False)
    assert stream.flush() == "E"
