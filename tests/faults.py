"""A test app: the server (`server.main:app`) with one llama_decode call of one context made to
fail, to test that an engine error fails only that context's requests. Run it as
`uvicorn tests.faults:app` (tests.server_proc.running_server(..., app=FAULTY_APP)) with

    PAGEDLLAMA_TEST_FAIL_DECODE=NAME:N    the Nth llama_decode call of context NAME (e.g.
                                          "SmolLM2-135M-Instruct.Q4_1/1:20") returns -1, once
                                          (NAME:N,M,…: each of those calls)

-1 is what llama_decode returns for a batch it rejects before touching the KV cache.
"""
from __future__ import annotations

import logging
import os

from engine import Worker
from server.main import app
from server.service.service import Service

__all__ = ["app"]
log = logging.getLogger("pagedllama.server")
ENV = "PAGEDLLAMA_TEST_FAIL_DECODE"


def inject(workers: list[Worker]) -> None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    name, _, nth = spec.rpartition(":")
    for worker in workers:
        if worker.name == name:
            _fail_once(worker, {int(n) for n in nth.split(",")})
            log.warning("TEST APP %s: llama_decode call %s of context %s will fail", ENV, nth,
                        name)


def _fail_once(worker: Worker, nth: set[int]) -> None:
    decode, calls = worker.context.decode, 0

    def decode_or_fail(pieces, stoppable=False):
        nonlocal calls
        calls += 1
        return -1 if calls in nth else decode(pieces, stoppable)
    worker.context.decode = decode_or_fail


def _start_then_inject(self: Service, start=Service.start) -> None:
    start(self)
    inject(self.workers)


Service.start = _start_then_inject
