"""The Batch API against a real server, through the official `openai` SDK: files uploaded, a
batch run to completed with every line's answer exactly once (the same answer the route gives
the same request), a bad line in the error file with the route's own error; and a server killed
with SIGKILL mid-batch and started again on the same state dir finishes the batch with each line
exactly once, running none again that was recorded before the kill."""
from __future__ import annotations

import json
import re
import signal
import sqlite3
import time
from datetime import datetime

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server_proc import SMOLLM2_NAME, server_process

# the body limit is then 96 KiB (64 KiB + 64 bytes a token of context); uploads get 256 KiB
ENV = {"PAGEDLLAMA_MAX_SEQS": "8", "PAGEDLLAMA_N_CTX": "512",
       "PAGEDLLAMA_BATCH_MAX_FILE_BYTES": "256KiB", "PAGEDLLAMA_BATCH_CONCURRENCY": "8"}


def chat_line(cid: str, content: str, **extra) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SMOLLM2_NAME, "max_tokens": 8, "temperature": 0,
                     "messages": [{"role": "user", "content": content}], **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def client_of(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for(client: OpenAI, batch_id: str, status: str = "completed", timeout: float = 60,
             until=None):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status == status or (until is not None and until(batch)):
            return batch
        assert batch.status not in ("failed", "expired", "cancelled"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def content_lines(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    with server_process({**ENV, "PAGEDLLAMA_STATE_DIR": str(state)}) as proc:
        yield proc


def test_a_batch_answers_every_line_once_as_its_route_would(server):
    client = client_of(server.base)
    questions = ["What is 2+2?", "Name a color.", "Say hello.", "What is the capital of Italy?",
                 "Count to three.", "Name an animal."]
    bad = chat_line("bad", "Hi", temperature=5)
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(questions)] + [bad]
    uploaded = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "questions.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    done = wait_for(client, batch.id)
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (7, 6, 1)
    assert done.usage.output_tokens > 0 and done.completed_at >= done.in_progress_at

    out = content_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"q{i}" for i in range(6)]
    with httpx.Client(base_url=server.base, timeout=60) as http:
        for line in out:   # the same request sent to the route gives the same (greedy) answer
            direct = http.post("/v1/chat/completions", json=lines[int(line["custom_id"][1:])][
                "body"]).json()
            got = line["response"]["body"]
            assert line["response"]["status_code"] == 200 and got["object"] == "chat.completion"
            assert got["choices"][0]["message"] == direct["choices"][0]["message"]
        route_error = http.post("/v1/chat/completions", json=bad["body"])
    err = content_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in err] == ["bad"]
    assert err[0]["response"]["status_code"] == route_error.status_code == 400
    assert err[0]["response"]["body"] == route_error.json()

    assert batch.id in [b.id for b in client.batches.list(limit=5).data]
    metrics = httpx.get(f"{server.base}/metrics").text
    assert re.search(r'pagedllama:batch_lines_total\{outcome="completed"\} [6-9]', metrics)
    stats = httpx.get(f"{server.base}/stats").json()["batch"]
    assert stats["lines_completed"] >= 6 and stats["lines_running"] == 0
    logged = re.findall(rf"batch={batch.id}#(\d+)\b", server.log())   # a log line per line
    assert sorted(map(int, logged)) == list(range(1, 8))


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* total=([0-9.]+)s .*"
                      r"batch=(batch_\w+)#(\d+)", re.M)


def line_starts(log: str, batch_id: str) -> dict[int, float]:
    """When each of the batch's lines started (its log line's time less its total time)."""
    return {int(n): datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp() - float(total)
            for ts, total, b, n in LOG_LINE.findall(log) if b == batch_id}


def test_no_batch_line_starts_while_an_interactive_request_runs(server):
    client = client_of(server.base)
    lines = [chat_line(f"r{i}", f"Tell me about the number {i}.", max_tokens=16, ignore_eos=True)
             for i in range(24)]    # three times the lines in flight at once (ENV)
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    t0 = time.time()
    chat = client.chat.completions.create(
        model=SMOLLM2_NAME, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    t1 = time.time()
    assert chat.usage.completion_tokens == 64
    done = wait_for(client, batch.id)
    assert done.request_counts.completed == 24
    starts = line_starts(server.log(), batch.id)
    assert len(starts) == 24
    during = [n for n, t in starts.items() if t0 + 0.5 < t < t1]   # a tick, a tokenization
    assert during == [], (t0, t1, sorted(starts.items(), key=lambda x: x[1]))
    assert any(t >= t1 for t in starts.values())   # the batch went on once the chat had ended


def test_batches_of_completions_embeddings_and_responses_run_through_their_routes(server):
    client = client_of(server.base)
    bodies = {
        "/v1/completions": {"model": SMOLLM2_NAME, "prompt": "Once upon a time",
                            "max_tokens": 6, "temperature": 0},
        "/v1/embeddings": {"model": SMOLLM2_NAME, "input": ["first text", "second text"]},
        "/v1/responses": {"model": SMOLLM2_NAME, "input": "Say hi.", "max_output_tokens": 6,
                          "temperature": 0}}
    started = {}
    for endpoint, body in bodies.items():
        f = client.files.create(file=("in.jsonl", jsonl([
            {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}])),
            purpose="batch")
        started[endpoint] = client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                                  completion_window="24h").id
    objects = {"/v1/completions": "text_completion", "/v1/embeddings": "list",
               "/v1/responses": "response"}
    for endpoint, batch_id in started.items():
        done = wait_for(client, batch_id)
        (line,) = content_lines(client, done.output_file_id)
        assert line["response"]["body"]["object"] == objects[endpoint], endpoint
    emb = content_lines(client, client.batches.retrieve(started["/v1/embeddings"]).output_file_id)
    assert len(emb[0]["response"]["body"]["data"]) == 2


def test_a_file_that_is_not_a_batch_file_is_refused(server):
    client = client_of(server.base)
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", b"\xff\xfe not utf-8"), purpose="batch")
    assert err.value.body["code"] == "invalid_file"
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", b'{"a": 1}\n'), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"


def big_file(size: int) -> bytes:
    line = json.dumps(chat_line("{}", "y" * 1000))
    return "".join(line.replace("{}", f"c{i}", 1) + "\n"
                   for i in range(size // (len(line) + 1) + 1)).encode()


def test_an_upload_has_the_batch_file_limit_not_the_body_limit(server):
    client = client_of(server.base)
    data = big_file(150_000)                       # over the 96 KiB body limit
    uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("bigger.jsonl", big_file(300_000)), purpose="batch")
    assert err.value.status_code == 413
    assert "PAGEDLLAMA_BATCH_MAX_FILE_BYTES" in err.value.body["message"]


def done_lines(state_dir, batch_id: str) -> set[int]:
    """The lines the store recorded as done (read while no server runs)."""
    db = sqlite3.connect(state_dir / "batch" / "batches.sqlite3")
    try:
        return {r[0] for r in db.execute("SELECT idx FROM lines WHERE batch_id = ? AND "
                                         "state = 2", (batch_id,))}
    finally:
        db.close()


def test_a_server_killed_mid_batch_finishes_it_after_a_restart_with_each_line_once(tmp_path):
    env = {**ENV, "PAGEDLLAMA_STATE_DIR": str(tmp_path)}
    lines = [chat_line(f"r{i}", f"Write a sentence about the number {i}.", max_tokens=24,
                       ignore_eos=True) for i in range(16)]
    with server_process(env) as first:
        client = client_of(first.base)
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 3)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
    recorded = done_lines(tmp_path, batch.id)
    assert 3 <= len(recorded) < 16
    with server_process(env) as second:
        client = client_of(second.base)
        done = wait_for(client, batch.id)
        out = content_lines(client, done.output_file_id)
        log = second.log()
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(16))
    assert (done.request_counts.completed, done.request_counts.failed) == (16, 0)
    assert all(len(x["response"]["body"]["choices"][0]["message"]["content"]) > 0 for x in out)
    rerun = {int(n) for n in re.findall(rf"batch={batch.id}#(\d+)", log)}
    assert rerun and not rerun & recorded      # nothing recorded before the kill ran again
    assert rerun | recorded == set(range(1, 17))
