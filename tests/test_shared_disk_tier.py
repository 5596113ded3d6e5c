"""Replicas sharing one disk tier directory (PAGEDLLAMA_CACHE_DIR), as real server processes: a
prompt computed on one is restored from disk on another that was already running, with the same
answer; two that compute the same prompt at once write one good file that a third restores; and a
finished request's prefix reaches the disk while another stream still decodes (no idle second),
so a fresh process restores it."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.server_proc import SMOLLM2_NAME, ServerProcess, server_process
from tests.test_engine import SYSTEM

QUESTIONS = ["Summarise the rules above in one line.", "Which rule matters most?",
             "Give an example of the second rule."]


def env_for(directory: Path) -> dict[str, str]:
    return {"PAGEDLLAMA_CACHE_DIR": str(directory), "PAGEDLLAMA_CACHE_MIN_TOKENS": "64",
            "PAGEDLLAMA_N_CTX": "1024", "PAGEDLLAMA_MAX_SEQS": "2"}


def body(i: int, **extra) -> dict:
    return {"model": SMOLLM2_NAME, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": f"Topic {i}. {SYSTEM * 3}"},
                         {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], **extra}


def chat(server: ServerProcess, payload: dict) -> dict:
    r = httpx.post(f"{server.base}/v1/chat/completions", json=payload, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def tiers(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base}/health", timeout=10).json()["prefix_cache_tiers"]


def wait_written(server: ServerProcess, n: int, timeout: float = 60.0) -> float:
    """Until the server wrote n snapshot files; returns when (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while tiers(server)["disk"]["written"] < n:
        assert time.monotonic() < deadline, f"{server.base} wrote no snapshot: {tiers(server)}"
        time.sleep(0.05)
    return time.monotonic()


def assert_restored_from_disk(server: ServerProcess, answer: dict, cold: dict) -> None:
    assert answer["choices"][0]["message"] == cold["choices"][0]["message"]
    assert cached(cold) < 16   # (a chat template's first tokens may be another prompt's)
    assert cached(answer) > answer["usage"]["prompt_tokens"] - 16
    assert tiers(server)["disk"]["hits"] == 1
    assert f"cached={cached(answer)} cached_from=disk" in server.log()


def test_a_prompt_computed_on_one_replica_is_restored_from_disk_on_another(tmp_path):
    env = env_for(tmp_path)
    with server_process(env) as a, server_process(env) as b:   # b runs before a writes
        cold = chat(a, body(0))
        wait_written(a, 1)
        warm = chat(b, body(0))
        assert_restored_from_disk(b, warm, cold)
        assert tiers(a)["disk"]["bad"] == tiers(b)["disk"]["bad"] == 0


def test_replicas_writing_the_same_prefix_at_once_leave_one_good_file(tmp_path):
    env = env_for(tmp_path)
    with server_process(env) as a, server_process(env) as b:
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(lambda s: chat(s, body(1)), (a, b))
        wait_written(a, 1)
        wait_written(b, 1)
        assert first["choices"][0]["message"] == second["choices"][0]["message"]
        assert cached(first) < 16 and cached(second) < 16
        assert tiers(a)["disk"]["bad"] == tiers(b)["disk"]["bad"] == 0
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) == 1 and not list(tmp_path.glob("*/.*.tmp"))   # one name, no leftovers
    with server_process(env) as c:
        assert_restored_from_disk(c, chat(c, body(1)), first)
        assert tiers(c)["disk"]["bad"] == 0


def test_a_prefix_is_written_while_another_stream_decodes(tmp_path):
    """The turn's prefix is saved between steps of the long stream, not after an idle second:
    its file is on disk while that stream still runs."""
    env = env_for(tmp_path)
    long_body = {"model": SMOLLM2_NAME, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                 "stream": True, "messages": [{"role": "user", "content": "Count to ten."}]}
    started, ended = threading.Event(), threading.Event()

    def long_stream(server: ServerProcess) -> None:
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=long_body,
                          timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    started.set()
        ended.set()

    with server_process(env) as a:
        streaming = threading.Thread(target=long_stream, args=(a,), daemon=True)
        streaming.start()
        assert started.wait(120)
        cold = chat(a, body(2))
        assert not ended.is_set(), "the long stream must outlast the turn"
        wait_written(a, 1, timeout=30)
        assert not ended.is_set(), "written while the long stream decodes"
        streaming.join(timeout=300)
    with server_process(env) as fresh:
        assert_restored_from_disk(fresh, chat(fresh, body(2)), cold)
