"""A real server next to a real busy process: its contexts give a thread up while the neighbour
runs and take it back when the neighbour leaves (the policy itself is unit-tested with recorded
figures in tests/unit/test_thread_governor.py). The server is pinned to two cores and the
neighbour to one of them, so that a machine with more cores is a 2-core one here."""
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_proc import SMOLLM2_NAME, running_server, two_cores

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")


def context(base: str) -> dict:
    health = httpx.get(f"{base}/health", timeout=10).json()
    return health["models"][SMOLLM2_NAME]["contexts"][0]


def keep_busy(base: str, stop: threading.Event) -> None:
    """Requests one after another, so the worker steps (the governor decides between steps)."""
    body = {"model": SMOLLM2_NAME, "prompt": "Once upon a time", "max_tokens": 32,
            "ignore_eos": True, "temperature": 0}
    while not stop.is_set():
        httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_a_busy_neighbour_takes_a_thread_away_until_it_leaves():
    env = {"PAGEDLLAMA_THREADS": "2", "PAGEDLLAMA_ADAPTIVE_THREADS": "1"}
    cores = two_cores()
    with running_server(env, cpus=cores) as base:
        assert context(base)["threads"] == 2
        stop = threading.Event()
        load = threading.Thread(target=keep_busy, args=(base, stop), daemon=True)
        load.start()
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=lambda: os.sched_setaffinity(0, {max(cores)}))
        try:
            assert wait_for(lambda: context(base)["threads"] == 1, 20), context(base)
        finally:
            neighbour.kill()
            neighbour.wait()
        try:
            assert wait_for(lambda: context(base)["threads"] == 2, 30), context(base)
            assert context(base)["thread_changes"] >= 2
        finally:
            stop.set()
            load.join(timeout=120)


def test_adaptive_threads_can_be_turned_off():
    env = {"PAGEDLLAMA_THREADS": "2", "PAGEDLLAMA_ADAPTIVE_THREADS": "0"}
    with running_server(env) as base:
        ctx = context(base)
        assert ctx["threads"] == 2 and ctx["other_cpu_cores"] is None
