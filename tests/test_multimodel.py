"""Several models, and several contexts of one model, served by one process."""
import textwrap
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server_proc import GEMMA3, SMOLLM2, running_server, two_cores


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    if not GEMMA3.exists():
        pytest.fail(f"{GEMMA3} is missing: run `make models`")
    path = tmp_path_factory.mktemp("cfg") / "models.yaml"
    path.write_text(textwrap.dedent(f"""
        models:
          - name: smol
            path: {SMOLLM2}
            context_size: 1024
            sequences: 4
          - name: gemma
            path: {GEMMA3}
            context_size: 1024
            sequences: 4
            defaults: {{temperature: 0}}
          - name: gemma-chat
            path: {GEMMA3}
            context_size: 1024
            sequences: 2
            chat_template: gemma
    """))
    with running_server({"PAGEDLLAMA_MODELS_FILE": str(path)}) as base:
        yield base


def test_models_lists_both_with_their_gguf_facts(two_models):
    data = {m["id"]: m for m in httpx.get(f"{two_models}/v1/models").json()["data"]}
    assert set(data) == {"smol", "gemma", "gemma-chat"}
    smol, gemma = data["smol"]["gguf"], data["gemma"]["gguf"]
    assert smol["architecture"] == "llama" and gemma["architecture"] == "gemma3"
    assert smol["quantization"] == "Q4_1" and gemma["quantization"] == "Q4_K_M"
    assert 130e6 < smol["parameters"] < 140e6 and 260e6 < gemma["parameters"] < 280e6
    assert smol["chat_template"] is True and gemma["chat_template"] is False
    assert smol["context_length"] == 8192 and gemma["context_length"] == 32768
    assert smol["file_size"] == SMOLLM2.stat().st_size


def test_concurrent_requests_to_both_models_answer(two_models):
    client = OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0, timeout=120)

    def ask_gemma(_):
        return client.completions.create(model="gemma", prompt="The capital of France is",
                                         max_tokens=8).choices[0].text

    def ask_smol(_):
        return client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        gemma = list(pool.map(ask_gemma, range(3)))
        smol = list(pool.map(ask_smol, range(3)))
    assert all("France" in t or "Paris" in t or "capital" in t for t in gemma), gemma
    # (SmolLM2-135M Q4_1's greedy answer here is odd French, the same as llama_cpp.Llama's)
    assert all(t.strip() for t in smol), smol
    assert len(set(gemma)) == 1 and len(set(smol)) == 1   # greedy: the same answer each time


def test_chat_to_a_model_without_a_template_is_a_clear_400(two_models):
    client = OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "no_chat_template"


def test_a_template_named_in_the_models_file_serves_chat_to_a_gguf_without_one(two_models):
    client = OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model="gemma-chat", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].message.content is not None
    assert resp.usage.prompt_tokens == len(httpx.post(f"{two_models}/tokenize", json={
        "model": "gemma-chat", "content": "<start_of_turn>user\nhi<end_of_turn>\n"
                                          "<start_of_turn>model\n", "add_special": True},
                                          timeout=30).json()["tokens"])


def test_replicas_split_the_cores_and_route_by_prefix():
    # pinned to two cores: two replicas get one thread each, whatever the machine
    with running_server({"PAGEDLLAMA_CONTEXTS": "2", "PAGEDLLAMA_THREADS": "2"},
                        cpus=two_cores()) as base:
        contexts = httpx.get(f"{base}/health").json()["models"]
        contexts = next(iter(contexts.values()))["contexts"]
        assert len(contexts) == 2 and all(c["configured_threads"] == 1 for c in contexts)
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        system = "You are a careful assistant who answers in one short sentence. " * 16
        cached = []
        for q in ("What is ice?", "What is fire?", "What is wind?"):
            resp = client.chat.completions.create(
                model=next(iter(httpx.get(f"{base}/v1/models").json()["data"]))["id"],
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=4, temperature=0)
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        # without prefix-affine routing the second request would go to the idle replica (0 hits)
        assert cached[0] == 0 and cached[1] >= 128 and cached[2] >= 128, cached
        # elastic threads: a request computing alone uses the idle replica's thread too
        def health_contexts():
            return next(iter(httpx.get(f"{base}/health").json()["models"].values()))["contexts"]

        assert all(c["configured_threads"] == 1 and c["max_threads"] == 2
                   for c in health_contexts())
        stream = client.chat.completions.create(
            model=next(iter(httpx.get(f"{base}/v1/models").json()["data"]))["id"],
            messages=[{"role": "user", "content": "Count from one to fifty in words."}],
            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        seen = []
        for _ in stream:
            ctx = health_contexts()
            seen.append(sorted(c["threads"] for c in ctx))
        assert [0, 2] in seen, seen          # the busy one on both threads, the idle one on none
        assert all(sum(s) <= 2 for s in seen), seen
        idle = health_contexts()
        assert all(c["threads"] == 0 for c in idle), idle
