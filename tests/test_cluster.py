"""`make cluster`: two real replicas (tiny settings) behind the real router (HAProxy), through
the Makefile target a user runs; answers checked against a replica asked directly
(tests/test_cluster_routes.py checks every route and the routing by session)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from cluster.launch import ROUTING_KEY_HEADER, free_cluster_port
from tests.server_proc import ROOT, SMOLLM2_NAME

TINY = {"PAGEDLLAMA_N_CTX": "512", "PAGEDLLAMA_MAX_SEQS": "4", "PAGEDLLAMA_CACHE_SEQS": "4",
        "PAGEDLLAMA_LOG_LEVEL": "warning"}
SYSTEM = ("You are a terse assistant for a travel agency. Answer in one short sentence, "
          "name the country, and never add greetings. ") * 4


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"make cluster exited:\n{proc.stdout.read()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the cluster did not become ready")


@contextlib.contextmanager
def running_cluster(policy: str, dirs: Path):
    port = free_cluster_port(2)
    shared = {"PAGEDLLAMA_CACHE_DIR": str(dirs / "prefix"), "PAGEDLLAMA_STATE_DIR": str(dirs)}
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "cluster", "REPLICAS=2", f"ROUTER_POLICY={policy}",
         f"PORT={port}", "HOST=127.0.0.1"],
        cwd=ROOT, env={**os.environ, **TINY, **shared}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield {"port": port, "proc": proc, "url": f"http://127.0.0.1:{port}", "dirs": shared,
               "replicas": [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster("session", tmp_path_factory.mktemp("cluster")) as c:
        yield c


def server_pid(port: int) -> int:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "server.main:app" in cmd and str(port) in cmd:
            return p.pid
    raise LookupError(f"no server on port {port}")


def listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        return True
    except httpx.ConnectError:
        return False


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(url: str, content: str, **kw):
    return client(url).chat.completions.create(
        model=SMOLLM2_NAME, messages=[{"role": "user", "content": content}], max_tokens=16,
        temperature=0, **kw)


def test_a_chat_completion_through_the_router_is_the_replicas_own_answer(cluster):
    via_router = ask(cluster["url"], "What is the capital of France?")
    direct = ask(cluster["replicas"][0], "What is the capital of France?")
    assert via_router.choices[0].message.content == direct.choices[0].message.content
    assert via_router.usage.completion_tokens == direct.usage.completion_tokens > 0
    assert via_router.choices[0].finish_reason == direct.choices[0].finish_reason


def test_a_streamed_chat_through_the_router_matches_the_unstreamed_answer(cluster):
    stream = ask(cluster["url"], "Name three colours.", stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    whole = ask(cluster["replicas"][1], "Name three colours.")
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == "length"


def test_a_completion_through_the_router_answers_the_question(cluster):
    out = client(cluster["url"]).completions.create(
        model=SMOLLM2_NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text


def test_requests_of_one_session_stay_on_the_replica_that_cached_its_prefix(cluster):
    cached = []
    for city in ("Lisbon", "Oslo", "Quito", "Hanoi"):
        out = client(cluster["url"]).chat.completions.create(
            model=SMOLLM2_NAME, max_tokens=4, temperature=0,
            extra_headers={ROUTING_KEY_HEADER: "travel-agency"},
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"Where is {city}?"}])
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    # the first computes the shared system prompt; the session's key sends the others to the
    # replica that holds it (round robin would send every other one to a cold replica)
    assert all(c >= 64 for c in cached[1:]), cached


def test_every_replica_is_given_the_one_prefix_cache_dir_and_state_dir(cluster):
    for url in cluster["replicas"]:
        env = psutil.Process(server_pid(int(url.rsplit(":", 1)[1]))).environ()
        assert env["PAGEDLLAMA_CACHE_DIR"] == cluster["dirs"]["PAGEDLLAMA_CACHE_DIR"]
        assert env["PAGEDLLAMA_STATE_DIR"] == cluster["dirs"]["PAGEDLLAMA_STATE_DIR"]


def test_each_replica_has_one_core_and_one_thread_with_the_governor_off(cluster):
    cores = []
    for url in cluster["replicas"]:
        ctx = next(iter(httpx.get(f"{url}/health").json()["models"].values()))["contexts"][0]
        assert ctx["threads"] == 1 and ctx["configured_threads"] == 1
        assert ctx["other_cpu_cores"] is None       # no contention governor at one thread
        cores.append(os.sched_getaffinity(server_pid(int(url.rsplit(":", 1)[1]))))
    assert len(os.sched_getaffinity(0)) < 2 or cores[0].isdisjoint(cores[1])


def test_replicas_tell_the_router_their_model_name(cluster):
    info = httpx.get(f"{cluster['replicas'][0]}/server_info").json()
    assert info["served_model_name"] == SMOLLM2_NAME
    models = httpx.get(f"{cluster['url']}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SMOLLM2_NAME]


def test_replicas_report_their_model_and_load_per_context(cluster):
    info = httpx.get(f"{cluster['replicas'][0]}/model_info").json()
    assert info["is_generation"] and info["architectures"] == ["llama"]
    (load,) = httpx.get(f"{cluster['replicas'][0]}/get_load").json()
    assert load["num_reqs"] == load["num_waiting_reqs"] == 0 and load["num_tokens"] >= 0


def test_sigterm_stops_the_router_and_every_replica(cluster):
    ports = (cluster["port"], cluster["port"] + 1, cluster["port"] + 2)
    pids = [server_pid(p) for p in ports[1:]]
    os.killpg(cluster["proc"].pid, signal.SIGTERM)
    cluster["proc"].wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) for p in pids)
    assert not any(listening(p) for p in ports)
