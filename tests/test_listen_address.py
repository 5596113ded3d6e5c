"""A real `uvicorn server.main:app` says at start where it listens, and warns when that is
beyond this machine without an API key (server/http/exposure.py; the decision itself:
tests/unit/test_exposure.py)."""
from __future__ import annotations

import time

from tests.server_proc import server_process

WARNING = "PAGEDLLAMA_API_KEY is not set"


def log_line(server, text: str, timeout: float = 10.0) -> str:
    """The server's log once it holds `text` (the check runs just after uvicorn binds)."""
    deadline = time.monotonic() + timeout
    while True:
        log = server.log()
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_on_loopback_there_is_no_warning():
    with server_process() as server:
        log = log_line(server, "this machine only")
    assert f"listening on 127.0.0.1:{server.port}: this machine only" in log
    assert WARNING not in log


def test_on_every_interface_with_a_key_there_is_no_warning():
    with server_process({"PAGEDLLAMA_API_KEY": "a-test-key"}, host="0.0.0.0") as server:
        log = log_line(server, "PAGEDLLAMA_API_KEY required")
    assert f"listening on 0.0.0.0:{server.port}: beyond this machine, PAGEDLLAMA_API_KEY " \
           "required" in log
    assert WARNING not in log
