"""The prefix cache's RAM and disk tiers with a real llama.cpp context: a prompt restored from a
tier gets bitwise the cold answer after its cells left the KV streams, after its model was
unloaded and loaded again, after a restart, and never from a damaged file."""
import asyncio
import logging

import httpx
import pytest

from engine import EngineConfig, Model, Request, SamplingParams, Worker
from kvcache import PrefixStore
from tests.devices import TEST_GPU_LAYERS
from tests.server_proc import SMOLLM2, SMOLLM2_NAME, server_process
from tests.test_engine import SYSTEM, chat_prompt

QUESTIONS = ["Summarise the rules above in one line.", "Which rule matters most?",
             "Give an example of the second rule."]


@pytest.fixture(scope="module")
def model():
    m = Model(SMOLLM2, n_gpu_layers=TEST_GPU_LAYERS)
    yield m
    m.close()


def worker(model, tiers, **overrides):
    cfg = dict(n_ctx=1024, max_seqs=2, max_batch_tokens=128, prefill_chunk=32)
    cfg.update(overrides)
    w = Worker("tiers", model, EngineConfig(**cfg), tiers=tiers)
    w.start()
    return w


def answer(w, prompt):
    """(text, cached tokens, where they came from) of a greedy answer."""
    async def main():
        req = Request(list(prompt), SamplingParams(max_tokens=12, temperature=0))
        queue, parts = w.submit(req), []
        while True:
            event = await queue.get()
            assert event.error is None, event.error
            parts.append(event.text)
            if event.finish_reason:
                return "".join(parts), req.num_cached, req.state.seq.cached_tier
    return asyncio.run(main())


def test_restored_prefixes_give_the_cold_answers(model, tmp_path):
    prompts = [chat_prompt(model, q, f"Topic {i}. {SYSTEM * 3}") for i, q in enumerate(QUESTIONS)]
    store = PrefixStore(ram_limit=1 << 30, disk_dir=tmp_path, disk_limit=1 << 30, min_tokens=64)
    w = worker(model, store)
    try:
        cold = []
        for p in prompts:   # computed cold (they share no block): the reference answers; with
            text, cached, tier = answer(w, p)   # two seq ids the first prompt's cells leave
            assert cached < 16 and tier == "kv"  # the streams, and come back from RAM
            cold.append(text)
        text, cached, tier = answer(w, prompts[0])
        assert (text, tier) == (cold[0], "ram") and cached > len(prompts[0]) - 16
    finally:
        w.stop()
    store.flush()
    w = worker(model, store)     # the model unloaded and loaded again: a new context
    try:
        text, cached, tier = answer(w, prompts[1])
        assert (text, tier) == (cold[1], "ram")
    finally:
        w.stop()
    restarted = PrefixStore(ram_limit=1 << 30, disk_dir=tmp_path, disk_limit=1 << 30,
                            min_tokens=64)   # a new process: only the disk is left
    w = worker(model, restarted)
    try:
        text, cached, tier = answer(w, prompts[2])
        assert (text, tier) == (cold[2], "disk") and cached > len(prompts[2]) - 16
        assert restarted.counts["disk"].hits == 1
    finally:
        w.stop()


def test_a_damaged_snapshot_is_skipped_and_the_answer_computed(model, tmp_path, caplog):
    prompt = chat_prompt(model, QUESTIONS[0], SYSTEM * 3)
    store = PrefixStore(ram_limit=0, disk_dir=tmp_path, disk_limit=1 << 30, min_tokens=64)
    w = worker(model, store)
    try:
        cold = answer(w, prompt)[0]
    finally:
        w.stop()
    store.close()
    (path,) = tmp_path.glob("*/*.kv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40            # one bit in the middle of the KV data
    path.write_bytes(bytes(raw))
    w = worker(model, PrefixStore(ram_limit=0, disk_dir=tmp_path, disk_limit=1 << 30,
                                  min_tokens=64))
    try:
        with caplog.at_level(logging.WARNING, "pagedllama.kvcache"):
            text, cached, tier = answer(w, prompt)
        assert (text, cached, tier) == (cold, 0, "kv")
        assert "checksum mismatch" in caplog.text
    finally:
        w.stop()


def test_a_restarted_server_answers_a_long_prompt_from_its_disk(tmp_path):
    env = {"PAGEDLLAMA_CACHE_DIR": str(tmp_path), "PAGEDLLAMA_CACHE_MIN_TOKENS": "64",
           "PAGEDLLAMA_N_CTX": "1024", "PAGEDLLAMA_MAX_SEQS": "2"}
    body = {"model": SMOLLM2_NAME, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM * 3},
                         {"role": "user", "content": QUESTIONS[0]}]}
    answers = []
    for _ in range(2):
        with server_process(env) as server:
            r = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json())
            metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
            health = httpx.get(f"{server.base}/health", timeout=10).json()
            log = server.log()
    first, second = answers
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached > second["usage"]["prompt_tokens"] - 16
    assert 'pagedllama:prefix_cache_tier_hits_total{tier="disk"} 1.0' in metrics
    assert health["prefix_cache_tiers"]["disk"]["hits"] == 1
    assert f"cached={cached} cached_from=disk" in log
    assert health["prefix_cache_tiers"]["disk"]["state"].startswith("on")
