"""Scheduling policies, admission control and deadlines through the real server."""
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from tests.devices import cpu_timing
from tests.server_proc import SMOLLM2_NAME, running_server


def first_token_time(base, priority, content, max_tokens=24):
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model=SMOLLM2_NAME, messages=[{"role": "user", "content": content}], stream=True,
        max_tokens=max_tokens, temperature=0, extra_body={"priority": priority, "ignore_eos": True})
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.monotonic() - t0
    return ttft


@cpu_timing
def test_priority_requests_overtake_a_flood_of_low_priority_ones():
    env = {"PAGEDLLAMA_SCHEDULER": "priority", "PAGEDLLAMA_MAX_SEQS": "2"}
    with running_server(env) as base:
        with ThreadPoolExecutor(14) as pool:
            flood = [pool.submit(first_token_time, base, 10, f"Tell story number {i}.", 48)
                     for i in range(10)]
            time.sleep(1.0)
            vips = [pool.submit(first_token_time, base, 0, f"Say {w}.", 8)
                    for w in ("yes", "no", "maybe", "hello")]
            flood_ttft = [f.result() for f in flood]
            vip_ttft = [f.result() for f in vips]
        p50_flood, p50_vip = statistics.median(flood_ttft), statistics.median(vip_ttft)
        print(f"TTFT p50: priority 0 {p50_vip:.2f}s, priority 10 flood {p50_flood:.2f}s")
        assert p50_vip <= 0.25 * p50_flood
        health = httpx.get(f"{base}/health").json()
        assert health["models"][SMOLLM2_NAME]["contexts"][0]["num_preemptions"] >= 1


def test_full_queue_answers_429_with_retry_after_and_never_5xx():
    env = {"PAGEDLLAMA_MAX_SEQS": "1", "PAGEDLLAMA_MAX_QUEUE": "1"}
    with running_server(env) as base:
        def post(i):
            return httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": SMOLLM2_NAME, "prompt": f"Count to {i}", "max_tokens": 30,
                "ignore_eos": True})
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        codes = [r.status_code for r in responses]
        assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
        assert all(c in (200, 429) for c in codes), codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        ok = next(r for r in responses if r.status_code == 200)
        assert ok.json()["usage"]["completion_tokens"] == 30


def test_a_deadline_ends_a_request_early(server_url, model_name):
    t0 = time.monotonic()
    resp = httpx.post(f"{server_url}/v1/completions", timeout=60, json={
        "model": model_name, "prompt": "Once upon a time", "max_tokens": 1500,
        "ignore_eos": True, "timeout": 1.0}).json()
    assert time.monotonic() - t0 < 20
    assert resp["choices"][0]["finish_reason"] == "length"
    assert 0 < resp["usage"]["completion_tokens"] < 1500
