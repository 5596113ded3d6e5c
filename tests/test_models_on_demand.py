"""Models loaded on demand within a memory budget, with the two real models (SmolLM2 and Gemma 3)
and a real server: alternating requests load and unload them and every request is answered,
while the server's memory stays within its memory without models plus the budget; concurrent
first requests load a model once; a running stream is never cut to make room; pinned models
stay; a model larger than the budget gets a clear error; the routes that show and control it."""
import re
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from openai import OpenAI

from engine import EngineConfig
from server.config import ModelSpec
from server.service.loading import spec_estimate
from tests.server_proc import GEMMA3, SMOLLM2, server_process

SETTINGS = {"context_size": 512, "sequences": 4}   # small caches: quick loads


def estimate(path) -> int:
    """What the server will count for a model with SETTINGS (the same code, in this process)."""
    engine = EngineConfig(n_ctx=SETTINGS["context_size"], max_seqs=SETTINGS["sequences"])
    return spec_estimate(ModelSpec("m", path, engine))[1].total


def models_yaml(tmp_path, smol: str = "", gemma: str = "") -> str:
    if not GEMMA3.exists():
        pytest.fail(f"{GEMMA3} is missing: run `make models`")
    path = tmp_path / "models.yaml"
    common = "".join(f"    {k}: {v}\n" for k, v in SETTINGS.items())
    path.write_text("models:\n"
                    f"  - name: smol\n    path: {SMOLLM2}\n{common}{smol}"
                    f"  - name: gemma\n    path: {GEMMA3}\n{common}{gemma}")
    return str(path)


def catalog(base) -> dict:
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text exposition (floats may be in e-notation)."""
    (value,) = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(value)


def ask(base, model, text="The capital of France is", max_tokens=8, **extra):
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": text,
                                                   "max_tokens": max_tokens, "temperature": 0,
                                                   **extra}, timeout=120)
    return r


class MemorySampler:
    """The server process's resident memory, every 20 ms, on a thread of this test."""

    def __init__(self, pid: int):
        self.proc, self.peak, self.samples = psutil.Process(pid), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.samples += 1
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_alternating_models_within_a_budget_for_one_load_and_unload_and_stay_within_it(tmp_path):
    smol, gemma = estimate(SMOLLM2), estimate(GEMMA3)
    budget = max(smol, gemma) + 16 * 2**20
    assert budget < smol + gemma, "the budget must fit only one of them"
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path),
           "PAGEDLLAMA_MEMORY_BUDGET": str(budget)}
    with server_process(env) as server:
        base = server.base
        health = httpx.get(f"{base}/health").json()
        assert health["memory"]["budget"] == budget
        assert {m: s["state"] for m, s in health["models"].items()} == {
            "smol": "unloaded", "gemma": "unloaded"}
        limit = health["memory"]["base"] + budget
        answers = {}
        with MemorySampler(server.proc.pid) as memory:
            for model in ["smol", "gemma"] * 3:
                r = ask(base, model)
                assert r.status_code == 200, r.text
                answers.setdefault(model, set()).add(r.json()["choices"][0]["text"])
                states = {m["id"]: m["state"] for m in catalog(base).values()}
                assert states[model] == "loaded" and list(states.values()).count("loaded") == 1
        assert memory.samples > 50
        assert memory.peak <= limit, (
            f"peak {memory.peak / 2**20:.0f} MiB above {limit / 2**20:.0f} MiB (base + budget)")
        assert all(len(a) == 1 for a in answers.values()), answers   # greedy, reloaded: same
        models = catalog(base)
        assert models["smol"]["loads"] == models["gemma"]["loads"] == 3
        for m in models.values():   # each load measured its memory; the estimate covers it
            assert 0 < m["memory"]["measured"] <= m["memory"]["estimate"]["total"], m["memory"]
        log = server.log()
        assert len(re.findall(r"loaded (smol|gemma) \(request\) in [\d.]+ s: estimate", log)) == 6
        assert len(re.findall(r"unloaded (smol|gemma) \(room for (gemma|smol)\)", log)) == 5
        metrics = httpx.get(f"{base}/metrics").text
        assert 'pagedllama:model_loads_total{model_name="gemma"} 3.0' in metrics
        assert 'pagedllama:model_unloads_total{model_name="smol",reason="room"} 3.0' in metrics
        assert metric(metrics, "pagedllama:memory_budget_bytes") == budget


def test_concurrent_first_requests_load_the_model_once_and_all_are_answered(tmp_path):
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path)}
    with server_process(env) as server:
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: ask(server.base, "gemma"), range(6)))
        assert [r.status_code for r in replies] == [200] * 6
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        assert catalog(server.base)["gemma"]["loads"] == 1
        assert server.log().count("loaded gemma (request)") == 1


def test_a_running_stream_is_not_cut_when_another_model_needs_its_room(tmp_path):
    smol, gemma = estimate(SMOLLM2), estimate(GEMMA3)
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path),
           "PAGEDLLAMA_MEMORY_BUDGET": str(max(smol, gemma) + 16 * 2**20)}
    with server_process(env) as server:
        base = server.base
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        stream = client.completions.create(model="smol", prompt="Count: one, two,",
                                           max_tokens=160, stream=True, temperature=0,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text            # the stream is running
        refused = ask(base, "gemma")
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_capacity_exceeded" and "smol" in error["message"]
        finish = None
        for chunk in chunks:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and len(text) > 100
        assert catalog(base)["smol"]["state"] == "loaded"
        after = ask(base, "gemma")                      # smol is idle now: it makes room
        assert after.status_code == 200, after.text
        assert {m["id"]: m["state"] for m in catalog(base).values()} == {
            "smol": "unloaded", "gemma": "loaded"}


def test_pinned_models_stay_while_others_come_and_go(tmp_path):
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path, smol="    pin: true\n",
                                                 gemma="    keep_alive: 0\n")}
    with server_process(env) as server:
        base = server.base
        assert catalog(base)["smol"]["state"] == "loaded"     # loaded at start
        assert ask(base, "gemma").status_code == 200
        deadline = time.monotonic() + 10
        while catalog(base)["gemma"]["state"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)                                  # keep_alive 0: gone once idle
        assert catalog(base)["gemma"]["state"] == "unloaded"
        r = httpx.post(f"{base}/models/smol/unload")
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_pinned"
        assert catalog(base)["smol"]["state"] == "loaded"
        assert ask(base, "smol").status_code == 200
        assert "unloaded gemma (idle for 0 s (keep_alive))" in server.log()


def test_a_model_larger_than_the_budget_gets_a_clear_400_and_the_others_serve(tmp_path):
    smol, gemma = estimate(SMOLLM2), estimate(GEMMA3)
    assert smol < gemma
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path),
           "PAGEDLLAMA_MEMORY_BUDGET": str((smol + gemma) // 2)}
    with server_process(env) as server:
        r = ask(server.base, "gemma")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "model_exceeds_memory_budget" and error["param"] == "model"
        assert "gemma" in error["message"] and "PAGEDLLAMA_MEMORY_BUDGET" in error["message"]
        assert ask(server.base, "smol").status_code == 200
        assert catalog(server.base)["gemma"]["state"] == "unloaded"


def test_models_are_loaded_and_unloaded_by_hand_and_by_keep_alive(tmp_path):
    env = {"PAGEDLLAMA_MODELS_FILE": models_yaml(tmp_path), "PAGEDLLAMA_API_KEY": "k"}
    auth = {"Authorization": "Bearer k"}
    with server_process(env) as server:
        base = server.base
        assert httpx.post(f"{base}/models/smol/load").status_code == 401   # behind the key
        r = httpx.post(f"{base}/models/smol/load", headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "loaded"
        assert r.json()["memory"]["measured"] > 0
        r = httpx.post(f"{base}/models/smol/unload", headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "unloaded"
        assert httpx.post(f"{base}/models/nope/load", headers=auth).status_code == 404
        # a request's keep_alive (Ollama's field, a duration) unloads it after that long idle
        r = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60, json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "keep_alive": "1s"})
        assert r.status_code == 200, r.text
        models = httpx.get(f"{base}/v1/models", headers=auth).json()["data"]
        assert {m["id"]: m["keep_alive"] for m in models}["smol"] == 1.0
        time.sleep(3)
        assert catalog_with(base, auth)["smol"]["state"] == "unloaded"
        assert "unloaded smol (idle for 1 s (keep_alive))" in server.log()
        bad = httpx.post(f"{base}/v1/completions", headers=auth, json={
            "model": "smol", "prompt": "x", "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.text


def catalog_with(base, headers) -> dict:
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models", headers=headers).json()["data"]}


def test_the_models_folder_catalogues_every_gguf_by_file_name(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for path in (SMOLLM2, GEMMA3):
        (folder / path.name).symlink_to(path)
    env = {"PAGEDLLAMA_MODELS_DIR": str(folder)}
    with server_process(env) as server:
        names = {SMOLLM2.stem, GEMMA3.stem}
        assert set(catalog(server.base)) == names
        assert all(m["state"] == "unloaded" for m in catalog(server.base).values())
        r = ask(server.base, SMOLLM2.stem)
        assert r.status_code == 200, r.text
        print(textwrap.shorten(server.log(), 200))
