"""Fault injection: a llama_decode error in one of two contexts fails only that context's
requests; the other context's stream goes on, and afterwards both serve correct answers.
The fault comes from the test app tests/faults.py (PAGEDLLAMA_TEST_FAIL_DECODE)."""
import json
import threading
import time

import httpx
from openai import OpenAI

from tests.server_proc import SMOLLM2_NAME, running_server

FAULTY_APP = "tests.faults:app"

M = SMOLLM2_NAME
FAILING = f"{M}/1"
QUESTION = "What is the capital of France?"


def stream(base: str, prompt: str, out: dict) -> None:
    out["data"] = []
    body = {"model": M, "prompt": prompt, "max_tokens": 120, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                out["data"].append(line[5:].strip())


def contexts(base: str) -> list[dict]:
    return httpx.get(f"{base}/health").json()["models"][M]["contexts"]


def wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def answer(client: OpenAI) -> str:
    return client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
        temperature=0).choices[0].message.content


def test_a_decode_error_in_one_context_fails_only_its_requests():
    # without prefix caching, routing goes by load alone: both idle, context 0; else the idler
    env = {"PAGEDLLAMA_CONTEXTS": "2", "PAGEDLLAMA_THREADS": "2", "PAGEDLLAMA_PREFIX_CACHING": "0",
           "PAGEDLLAMA_TEST_FAIL_DECODE": f"{FAILING}:40"}
    with running_server(env, app=FAULTY_APP) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        reference = answer(client)                               # computed on context 0
        healthy, failing, later = {}, {}, {}
        a = threading.Thread(target=stream, args=(base, "Once upon a time", healthy))
        a.start()
        wait_for(lambda: contexts(base)[0]["running"] == 1)
        b = threading.Thread(target=stream, args=(base, "In a galaxy far away", failing))
        b.start()                                                # on context 1: fails
        a.join(120)
        b.join(120)

        steps_before = contexts(base)[1]["steps"]
        c = threading.Thread(target=stream, args=(base, "Once upon a time", later))
        c.start()                                                # keeps context 0 busy
        wait_for(lambda: contexts(base)[0]["running"] == 1)
        again = answer(client)                                   # so this runs on context 1
        steps_after = contexts(base)[1]["steps"]
        c.join(120)
        wait_for(lambda: all(c["running"] == 0 and c["kv_used_blocks"] == 0
                             for c in contexts(base)))

    assert failing["data"][-1] == "[DONE]"
    error = json.loads(failing["data"][-2])["error"]
    assert error["code"] == "engine_error" and "llama_decode returned -1" in error["message"]
    for ok in (healthy, later):
        assert ok["data"][-1] == "[DONE]"
        assert json.loads(ok["data"][-2])["choices"][0]["finish_reason"] == "length"
    assert steps_after > steps_before              # context 1 served again after its fault...
    assert again == reference                      # ...and its answer is still right
