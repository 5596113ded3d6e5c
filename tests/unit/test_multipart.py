"""The upload parser (server/http/multipart.py): the parts a client sends, by name; anything
malformed is a MultipartError (a 400), never another exception."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.http.multipart import MultipartError, parse

CT = "multipart/form-data; boundary=XyZ"


def body(*parts: bytes) -> bytes:
    return b"".join(b"--XyZ\r\n" + p + b"\r\n" for p in parts) + b"--XyZ--\r\n"


def test_the_file_and_the_purpose_are_read_by_name():
    got = parse(CT, body(b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch',
                         b'Content-Disposition: form-data; name="file"; filename="a \\"b\\".jsonl"'
                         b"\r\nContent-Type: application/jsonl\r\n\r\n{}\r\n{}\n"))
    assert got["purpose"].data == b"batch" and got["purpose"].filename is None
    assert got["file"].data == b"{}\r\n{}\n" and got["file"].filename == 'a "b".jsonl'
    assert got["file"].content_type == "application/jsonl"


@pytest.mark.parametrize("content_type,raw", [
    ("application/json", body()),
    ("multipart/form-data", body()),                                 # no boundary
    (CT, b"no boundary anywhere"),
    (CT, b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nunterminated"),
    (CT, b"--XyZ\r\nno headers end"),
    (CT, body(b"Content-Type: text/plain\r\n\r\nx")),                 # no name
    (CT, b"--XyZjunk"),
])
def test_a_malformed_upload_is_a_multipart_error(content_type, raw):
    with pytest.raises(MultipartError):
        parse(content_type, raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([CT, "multipart/form-data; boundary=\"a\"",
                                                 "text/plain"]))
def test_any_bytes_parse_or_are_a_multipart_error(raw, content_type):
    try:
        parse(content_type, b"--XyZ\r\n" + raw if content_type == CT else raw)
    except MultipartError:
        pass
