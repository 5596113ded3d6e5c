"""Ollama's native API (/api/...) through the official `ollama` Python client against a real
server: chat and generate (streamed and not), embeddings, the model routes, structured output,
tools in the prompt, keep_alive 0, and errors in Ollama's shape. One server for the module (a
catalogue of SmolLM2 alone, loaded on demand), small token limits."""
import json
import time
import uuid

import httpx
import ollama
import pytest
from pydantic import BaseModel

from tests.server_proc import SMOLLM2, SMOLLM2_NAME, smollm2_folder_server

M = SMOLLM2_NAME
TAGGED = M + ":latest"
GREEDY = {"temperature": 0, "num_predict": 12}
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with smollm2_folder_server(tmp_path_factory.mktemp("ollama-models")) as proc:
        yield proc


@pytest.fixture(scope="module")
def base(server):
    return server.base


@pytest.fixture(scope="module")
def client(base):
    return ollama.Client(host=base, timeout=120)


def fresh_system() -> dict:
    """A system message no earlier request had: its prompt shares only the template's opening
    tokens with earlier ones in the prefix cache."""
    return {"role": "system", "content": f"Session {uuid.uuid4().hex}. You are a terse assistant."}


# ---- chat and generate -------------------------------------------------------------------------
def test_same_answer_and_prompt_tokens_as_the_openai_route(base, client):
    """The module's first request: nothing is cached yet, so every prompt token is computed
    (prompt_eval_count counts those only), and the OpenAI route's prompt_tokens counts them
    all."""
    messages = [fresh_system(), {"role": "user", "content": "Name three colours."}]
    native = client.chat(model=M, messages=messages, options={"temperature": 0,
                                                              "num_predict": 16})
    openai = httpx.post(f"{base}/v1/chat/completions", json={
        "model": M, "messages": messages, "temperature": 0, "max_tokens": 16}, timeout=60).json()
    assert native.message.content == openai["choices"][0]["message"]["content"]
    assert native.prompt_eval_count == openai["usage"]["prompt_tokens"]


def test_chat_streamed_is_the_chat_answered_at_once(client):
    whole = client.chat(model=TAGGED, messages=COUNT, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.model == TAGGED
    assert whole.message.role == "assistant" and whole.message.content.startswith("1, 2")
    assert whole.eval_count == 12 and whole.total_duration >= whole.eval_duration > 0
    chunks = list(client.chat(model=TAGGED, messages=COUNT, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == whole.message.content
    last = chunks[-1]
    assert last.done_reason == "length" and last.eval_count == 12
    assert last.message.content == ""   # as Ollama ends a stream: the text came before
    assert last.prompt_eval_duration > 0 and last.total_duration > 0


def test_generate_streamed_and_not(client):
    whole = client.generate(model=M, prompt="Count from 1 to 10, separated by commas.",
                            options=GREEDY)
    assert whole.done and whole.response.startswith("1, 2") and whole.eval_count == 12
    parts = list(client.generate(model=M, prompt="Count from 1 to 10, separated by commas.",
                                 options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].done_reason == "length"


def test_stream_absent_means_ndjson_lines(base):
    body = {"model": M, "prompt": "Say hello.", "options": {"temperature": 0, "num_predict": 4}}
    with httpx.stream("POST", f"{base}/api/generate", content=json.dumps(body),
                      timeout=60) as resp:   # no Content-Type: as curl -d sends it, read as JSON
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in resp.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4
    assert all(not line["done"] for line in lines[:-1])


def test_a_stream_left_early_is_cancelled_in_the_engine(server, base):
    count = [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]
    body = {"model": M, "messages": count, "options": {"num_predict": 500, "temperature": 0}}
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert not json.loads(next(lines))["done"] and not json.loads(next(lines))["done"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        models = httpx.get(f"{base}/health", timeout=10).json()["models"].values()
        contexts = [c for m in models for c in m.get("contexts", [])]
        if all(c["outstanding"] == 0 and c["running"] == 0 for c in contexts):
            break
        time.sleep(0.1)
    assert contexts and all(c["outstanding"] == 0 and c["running"] == 0 for c in contexts)
    assert " disconnected model=" in server.log()   # cancelled, not run to its end


def test_a_stream_closed_at_its_last_line_has_finished(server, base):
    """A client that closes the connection as soon as it reads `done: true` (the JavaScript
    client and Open WebUI do) got the whole answer: the request ends as finished, not as left
    early."""
    finished = server.log().count("POST /api/chat ok ")
    left = server.log().count("POST /api/chat disconnected ")
    with httpx.stream("POST", f"{base}/api/chat", timeout=60, json={
            "model": M, "messages": COUNT, "options": GREEDY}) as resp:
        for line in resp.iter_lines():
            if line and json.loads(line)["done"]:
                break
    deadline = time.monotonic() + 10
    while server.log().count("POST /api/chat ok ") == finished and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.log().count("POST /api/chat ok ") == finished + 1
    assert server.log().count("POST /api/chat disconnected ") == left


def test_raw_generate_and_system(base, client):
    text = "The capital of France is"
    raw = client.generate(model=M, prompt=text, raw=True, options=GREEDY)
    tokens = httpx.post(f"{base}/tokenize", json={"model": M, "content": text,
                                                  "add_special": True}).json()["tokens"]
    assert raw.prompt_eval_count == len(tokens)   # the text alone, no template around it
    pirate = client.generate(model=M, prompt="Who are you?", system="You are a pirate.",
                             options={"temperature": 0, "num_predict": 4})
    assert pirate.done


def test_options_stop_and_seed(client):
    stopped = client.chat(model=M, messages=COUNT, options={"temperature": 0, "num_predict": 30,
                                                            "stop": [", 4"]})
    assert stopped.done_reason == "stop" and stopped.message.content.endswith("3")
    sampled = [client.chat(model=M, messages=COUNT, options={"temperature": 1.0, "seed": 7,
                                                             "num_predict": 8}).message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_a_shared_system_prompt_is_not_computed_again(client):
    system = fresh_system()
    system["content"] += " Always answer in one short sentence. " * 8
    first = client.chat(model=M, messages=[system, {"role": "user", "content": "Hi."}],
                        options={"temperature": 0, "num_predict": 2})
    second = client.chat(model=M, messages=[system, {"role": "user", "content": "Hello."}],
                         options={"temperature": 0, "num_predict": 2})
    assert second.prompt_eval_count < first.prompt_eval_count - 40


# ---- structured output and tools ---------------------------------------------------------------
class Country(BaseModel):
    name: str
    capital: str


def test_format_with_a_pydantic_schema(client):
    answer = client.chat(model=M, messages=[{"role": "user", "content": "France as JSON."}],
                         format=Country.model_json_schema(),
                         options={"temperature": 0, "num_predict": 40})
    Country.model_validate_json(answer.message.content)


def test_format_json_is_a_json_object(client):
    answer = client.generate(model=M, prompt="Describe a cat in JSON.", format="json",
                             options={"temperature": 0, "num_predict": 24})
    assert answer.response.lstrip().startswith("{")


def test_tools_and_a_call_history_reach_the_prompt(client):
    ask = [fresh_system(), {"role": "user", "content": "What is the weather in Paris?"}]
    plain = client.chat(model=M, messages=ask, options={"temperature": 0, "num_predict": 1})
    ask[0] = fresh_system()
    with_tools = client.chat(model=M, messages=ask, tools=[WEATHER],
                             options={"temperature": 0, "num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20
    history = ask + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 24 degrees", "tool_name": "get_weather"}]
    answered = client.chat(model=M, messages=history, tools=[WEATHER],
                           options={"temperature": 0, "num_predict": 24})
    assert answered.done and answered.prompt_eval_count > 0
    assert answered.message.content or answered.message.tool_calls


# ---- embeddings --------------------------------------------------------------------------------
# Ollama has no tool_choice, so a call is the model's own decision: SmolLM2 calls the tool
# (greedily) after three earlier turns that each answered a weather question with a call
FORECAST = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"}}}}}


def forecast_turns() -> list[dict]:
    turns = []
    for city, weather in (("London", "Rainy, 12 degrees"), ("Rome", "Sunny, 25 degrees"),
                          ("Madrid", "Hot, 30 degrees")):
        turns += [{"role": "user", "content": f"Weather in {city}?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"function": {"name": "get_weather", "arguments": {"city": city}}}]},
                  {"role": "tool", "content": weather, "tool_name": "get_weather"},
                  {"role": "assistant", "content": f"{weather}."}]
    return turns


def test_the_model_calls_a_tool_and_reads_its_result(base, client):
    """A real call end to end: the model's call comes back in message.tool_calls with its
    arguments an object (streamed: in one line before the last), and the result sent back as
    a tool message is what the model answers from."""
    ask = forecast_turns() + [{"role": "user", "content": "Weather in Tokyo?"}]
    greedy = {"temperature": 0, "num_predict": 40}
    called = client.chat(model=M, messages=ask, tools=[FORECAST], options=greedy)
    assert called.done_reason == "stop" and called.message.content == ""
    (call,) = called.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Tokyo"})
    raw = httpx.post(f"{base}/api/chat", timeout=60, json={
        "model": M, "messages": ask, "tools": [FORECAST], "options": greedy,
        "stream": False}).json()["message"]["tool_calls"]
    assert raw[0]["function"] == {"index": 0, "name": "get_weather",
                                  "arguments": {"city": "Tokyo"}}
    assert raw[0]["id"].startswith("call_")
    lines = list(client.chat(model=M, messages=ask, tools=[FORECAST], options=greedy,
                             stream=True))
    assert [bool(line.message.tool_calls) for line in lines] == [True, False]
    assert lines[0].message.tool_calls == called.message.tool_calls and lines[-1].done
    answered = client.chat(model=M, tools=[FORECAST], options=greedy, messages=ask + [
        called.message, {"role": "tool", "content": "Snowing, -2 degrees",
                         "tool_name": "get_weather"}])
    assert answered.message.content == "Snowing, -2 degrees." and not answered.message.tool_calls


def test_embed_and_the_older_embeddings(client):
    out = client.embed(model=TAGGED, input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 576
    assert abs(sum(x * x for x in out.embeddings[0]) - 1.0) < 1e-3
    assert out.prompt_eval_count >= 2
    old = client.embeddings(model=M, prompt="a cat")
    assert old.embedding == pytest.approx(out.embeddings[0], abs=1e-5)


# ---- models ------------------------------------------------------------------------------------
def test_list_show_ps_and_version(base, client):
    names = [m.model for m in client.list().models]
    assert names == [TAGGED]
    listed = client.list().models[0]
    assert listed.size == SMOLLM2.stat().st_size and listed.details.family == "llama"
    shown = client.show(TAGGED)
    assert "<|im_start|>" in shown.template and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.details.quantization_level == "Q4_1"
    client.generate(model=M, prompt="Hi", options={"num_predict": 1}, keep_alive="10m")
    (running,) = client.ps().models
    assert running.model == TAGGED and running.size > 0 and running.context_length == 1024
    left = running.expires_at.timestamp() - time.time()
    assert 9 * 60 < left <= 10 * 60 + 1
    assert httpx.get(f"{base}/api/version").json()["version"]
    assert httpx.get(f"{base}/").text == "Ollama is running"
    assert httpx.head(f"{base}/").status_code == 200


def test_pull_of_a_model_here_succeeds_and_the_others_explain(client):
    assert client.pull(M).status == "success"
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("llama3.2")
    assert err.value.status_code == 400 and "PAGEDLLAMA_MODELS_DIR" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="mine", from_=M)
    assert err.value.status_code == 400 and "models-on-demand" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(M)
    assert err.value.status_code == 400 and "keep_alive: 0" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.copy(M, "mine")
    assert err.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("llama3.2")
    assert err.value.status_code == 404


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    ({"model": M, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"model": M, "messages": COUNT, "options": {"mirostat": 2}}, "options.mirostat"),
    ({"model": M, "messages": COUNT, "options": {"num_ctx": "big"}}, "options.num_ctx"),
    ({"model": M, "messages": COUNT, "options": {"no_such_option": 1}}, "no_such_option"),
    ({"model": M, "messages": COUNT, "think": True}, "does not support thinking"),
    ({"model": M, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "images"),
    ({"model": M, "messages": COUNT, "format": {"type": "object", "properties": 3}}, "format"),
])
def test_a_bad_chat_body_is_a_400_in_ollamas_shape(base, body, words):
    resp = httpx.post(f"{base}/api/chat", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert list(resp.json()) == ["error"] and words in resp.json()["error"]


def test_suffix_and_a_context_too_small(base):
    resp = httpx.post(f"{base}/api/generate", json={"model": M, "prompt": "def f(", "suffix": ")"})
    assert resp.status_code == 400 and "fill in the middle" in resp.json()["error"]
    resp = httpx.post(f"{base}/api/generate", json={"model": M, "prompt": "Hello " * 40,
                                                    "options": {"num_ctx": 16}})
    assert resp.status_code == 400 and "num_ctx" in resp.json()["error"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3.2:latest", messages=COUNT)
    assert err.value.status_code == 404 and "llama3.2:latest" in err.value.error


# ---- LangChain's ChatOllama --------------------------------------------------------------------
def test_langchain_chat_ollama_structured_output(base):
    chat_ollama = pytest.importorskip("langchain_ollama").ChatOllama
    llm = chat_ollama(model=TAGGED, base_url=base, temperature=0, num_predict=40)
    country = llm.with_structured_output(Country, method="json_schema").invoke("France?")
    assert isinstance(country, Country)


# ---- last: unloading ---------------------------------------------------------------------------
def test_keep_alive_0_unloads_the_model(client):
    assert client.ps().models
    answer = client.generate(model=M, keep_alive=0)
    assert answer.done and answer.done_reason == "unload"
    deadline = time.monotonic() + 10
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.ps().models == []
    loaded = client.generate(model=M)    # an empty prompt loads it again
    assert loaded.done_reason == "load" and client.ps().models
