"""The serving core through a real HTTP server, a real model and the official openai client."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.config import DEVICE_DEFAULTS
from tests.devices import ON_GPU, cpu_exact

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Name three colours.", "Explain what a CPU does.", "Say hello in Spanish.",
             "What is 2 + 2?", "Give me a fruit.", "Describe a cat in one sentence."]


def chat(client, model, content, max_tokens=24, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, **kw)


def stream_text(client, model, content, max_tokens=24, **kw):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, stream=True, **kw)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def health(server_url):
    return httpx.get(f"{server_url}/health").json()


def contexts(server_url):
    return [c for m in health(server_url)["models"].values() for c in m["contexts"]]


def wait_idle(server_url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ctx = contexts(server_url)
        if all(c["running"] == 0 and c["waiting"] == 0 and c["outstanding"] == 0
               and c["kv_used_blocks"] == 0 for c in ctx):
            return ctx
        time.sleep(0.1)
    raise AssertionError(f"server did not go idle: {contexts(server_url)}")


# ---- happy paths ---------------------------------------------------------------------------------
def test_models_lists_the_loaded_model(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_health_says_the_model_is_loaded(server_url, model_name):
    body = health(server_url)
    assert body["status"] == "ok" and body["models"][model_name]["loaded"] is True
    model = body["models"][model_name]   # the kernel and cache the defaults give (docs/configuration.md)
    assert (model["flash_attn"], model["kv_type"], model["kv_unified"]) == (True, "f16", False)
    assert model["attention"] == "row-invariant" and model["step_target_ms"] == 500
    # every layer on the GPU by default with a GPU build, none with PAGEDLLAMA_GPU_LAYERS=0
    assert model["on_gpu"] is ON_GPU
    device = DEVICE_DEFAULTS["gpu" if ON_GPU else "cpu"]   # chunks and steps by device
    assert (model["prefill_chunk"], model["max_batch_tokens"]) == (
        device["prefill_chunk"], device["max_batch_tokens"])


def test_chat_completion_answers_with_usage(client, model_name):
    resp = chat(client, model_name, "What is the capital of France?")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 10
    assert 0 < resp.usage.completion_tokens <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_max_tokens_with_ignore_eos_gives_exactly_that_many_tokens(client, model_name):
    resp = chat(client, model_name, "Say hi.", max_tokens=17, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 17 and resp.choices[0].finish_reason == "length"


@cpu_exact
def test_streamed_chat_equals_non_streamed_greedy_chat(client, model_name):
    whole = chat(client, model_name, QUESTIONS[1]).choices[0].message.content
    text, finish = stream_text(client, model_name, QUESTIONS[1])
    assert text == whole and finish in ("stop", "length")


def test_stream_include_usage_sends_a_final_usage_chunk(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}, temperature=0,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_non_stream_and_stream_agree(client, model_name):
    kw = dict(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.choices[0].text and whole.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole.choices[0].text


def test_completion_accepts_token_ids(client, model_name):
    resp = client.completions.create(model=model_name, prompt=[504, 3575, 282, 4649, 314],
                                     max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 5


def test_stop_string_ends_the_text_before_it(client, model_name):
    prompt = "Count from 1 to 10."
    text = chat(client, model_name, prompt, max_tokens=40).choices[0].message.content
    assert len(text) > 8, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = chat(client, model_name, prompt, max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]


def test_generate_stream_sends_token_events_then_done(server_url):
    events = []
    with httpx.stream("POST", f"{server_url}/generate_stream",
                      json={"prompt": "Write a short poem about code.", "max_tokens": 30},
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line.split(":", 1)[1])))
    tokens = [d["text"] for k, d in events if k == "token"]
    done = [d for k, d in events if k == "done"]
    assert len(tokens) >= 2 and "".join(tokens).strip()
    assert len(done) == 1 and done[0]["finish_reason"] in ("stop", "length")
    assert done[0]["completion_tokens"] >= len(tokens)


@pytest.mark.parametrize("path,body,param", [
    ("/generate_stream", {"prompt": "hi", "stream": False}, "stream"),
    ("/generate_stream", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/generate_stream", {"prompt": "hi " * 3000, "max_tokens": 5}, "prompt"),
    ("/tokenize", {"content": "x", "bogus": True}, "bogus"),
    ("/detokenize", {"tokens": [1], "bogus": 1}, "bogus"),
])
def test_native_routes_refuse_what_they_would_ignore_naming_the_field(server_url, path, body,
                                                                       param):
    resp = httpx.post(f"{server_url}{path}", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# ---- concurrency -------------------------------------------------------------------------------
@cpu_exact
def test_eight_concurrent_streams_each_match_their_solo_greedy_output(client, model_name):
    solo = [stream_text(client, model_name, q, max_tokens=32)[0] for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: stream_text(client, model_name, q, max_tokens=32)[0],
                                 QUESTIONS))
    assert all(together), together
    assert together == solo


def test_client_disconnect_frees_the_sequence_and_its_blocks(server_url, model_name):
    wait_idle(server_url)
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", timeout=60, json={
            "model": model_name, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}) as resp:
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
        assert contexts(server_url)[0]["running"] == 1
    ctx = wait_idle(server_url)[0]
    assert ctx["kv_used_blocks"] == 0 and ctx["running"] == 0


def test_disconnect_of_a_non_streamed_request_cancels_it(server_url, model_name):
    wait_idle(server_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server_url}/v1/completions", timeout=1.5, json={
            "model": model_name, "prompt": "Once upon a time", "max_tokens": 1500,
            "ignore_eos": True})
    wait_idle(server_url)


# ---- bad input -----------------------------------------------------------------------------------
def assert_error(resp, status, *words):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    return err


def test_malformed_json_is_a_400(server_url):
    resp = httpx.post(f"{server_url}/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, "JSON")


def test_wrong_type_is_a_400_naming_the_field(server_url, model_name):
    resp = httpx.post(f"{server_url}/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}],
        "temperature": "hot"})
    assert_error(resp, 400, "temperature")


@pytest.mark.parametrize("field,value", [("temperature", 5), ("top_p", 0), ("max_tokens", 0),
                                         ("presence_penalty", 3), ("n", 9), ("n", 0), ("min_p", 1.5)])
def test_out_of_range_sampling_value_is_a_400(server_url, model_name, field, value):
    resp = httpx.post(f"{server_url}/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], field: value})
    assert_error(resp, 400, field)


def test_empty_messages_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, messages=[])
    assert "messages" in str(exc.value)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "model_not_found"


def test_prompt_that_cannot_fit_the_context_is_a_400_with_the_numbers(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt="hello " * 2100, max_tokens=10)
    message = exc.value.body["message"]
    assert "2048" in message and exc.value.body["code"] == "context_length_exceeded"


def test_a_max_tokens_beyond_the_context_left_is_capped_there(client, model_name):
    """As llama-server and Ollama do (agents ask for 32,000 whatever the model): the answer
    ends with the context, finish_reason "length"."""
    resp = client.completions.create(model=model_name, prompt="hello " * 2000, max_tokens=32000,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == 2048


def test_server_keeps_serving_after_bad_requests(client, model_name, server_url):
    for body in (b"[", b'{"model": 3}', b'{"messages": "x"}'):
        httpx.post(f"{server_url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert chat(client, model_name, "Hi", max_tokens=4).choices[0].message.content is not None
