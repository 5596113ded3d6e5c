"""A thinking model's reasoning, told apart from its answer on every API: `reasoning_content` on
chat completions, a reasoning item on /v1/responses, `thinking` blocks on /v1/messages; and a
grammar (structured output, a forced call) applies once the reasoning has ended.

No thinking GGUF is at hand, so SmolLM2 is served with a chat template written for these tests
(tests/templates/thinking-chatml.jinja, set through the models file's `chat_template`): its
generation prompt opens `<think>`, as DeepSeek-R1 distills' templates do, and two example turns
show the model how to close it, which SmolLM2 follows when decoding greedily."""
import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server_proc import ROOT, SMOLLM2, running_server

THINKER = "thinker"
TEMPLATE = ROOT / "tests" / "templates" / "thinking-chatml.jinja"
Q = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    models = tmp_path_factory.mktemp("thinker") / "models.yaml"
    models.write_text(f"models:\n  - name: {THINKER}\n    path: {SMOLLM2}\n"
                      f"    chat_template: {TEMPLATE}\n")
    with running_server({"PAGEDLLAMA_MODELS_FILE": str(models)}) as url:
        yield url


@pytest.fixture()
def oai(base):
    return OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture()
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)


def test_the_model_list_says_the_model_thinks_with_a_template_from_a_file(oai):
    model = oai.models.retrieve(THINKER).model_extra
    assert model["thinks"] is True and model["chat_template"] == "file"


# ---- chat completions ----------------------------------------------------------------------------
def test_chat_returns_the_reasoning_apart_from_the_content(oai):
    msg = oai.chat.completions.create(model=THINKER, messages=Q, max_tokens=40,
                                      temperature=0).choices[0].message
    assert "Paris" in msg.model_extra["reasoning_content"]
    assert msg.content == "Paris" and "<think>" not in msg.content


def test_chat_streams_reasoning_deltas_then_content_deltas(oai):
    whole = oai.chat.completions.create(model=THINKER, messages=Q, max_tokens=40,
                                        temperature=0).choices[0].message
    kinds, reasoning, content = [], "", ""
    for chunk in oai.chat.completions.create(model=THINKER, messages=Q, max_tokens=40,
                                             temperature=0, stream=True):
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            kinds.append("reasoning")
            reasoning += delta.model_extra["reasoning_content"]
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert kinds.index("content") > kinds.index("reasoning") and kinds.count("reasoning") > 2
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)


def test_a_json_schema_applies_after_the_reasoning(oai):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"]}
    msg = oai.chat.completions.create(
        model=THINKER, messages=Q, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    ).choices[0].message
    assert msg.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(msg.content), schema)


def test_a_forced_call_comes_after_the_reasoning(oai):
    choice = oai.chat.completions.create(
        model=THINKER, max_tokens=80, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"]
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


# ---- the Responses API ---------------------------------------------------------------------------
def test_responses_put_the_reasoning_in_a_reasoning_item_first(oai):
    resp = oai.responses.create(model=THINKER, input=Q, max_output_tokens=40, temperature=0)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and "Paris" in reasoning.content[0].text
    assert message.type == "message" and resp.output_text == "Paris"


def test_responses_stream_the_reasoning_as_reasoning_text_deltas(oai):
    with oai.responses.stream(model=THINKER, input=Q, max_output_tokens=40,
                              temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas and deltas == final.output[0].content[0].text
    assert final.output_text == "Paris"


def test_a_reasoning_item_sent_back_is_rendered_in_the_history(oai):
    first = oai.responses.create(model=THINKER, input=Q, max_output_tokens=40, temperature=0)
    again = oai.responses.create(model=THINKER, max_output_tokens=40, temperature=0,
                                 input=Q + first.output + [
                                     {"role": "user", "content": "And of Spain?"}])
    assert again.usage.input_tokens > first.usage.input_tokens + 15


# ---- the Messages API ----------------------------------------------------------------------------
def test_messages_return_a_thinking_block_before_the_text(claude):
    msg = claude.messages.create(model=THINKER, max_tokens=40, messages=Q,
                                 extra_body={"temperature": 0})
    thinking, text = msg.content
    assert thinking.type == "thinking" and "Paris" in thinking.thinking
    assert text.type == "text" and text.text == "Paris"


def test_messages_stream_thinking_deltas_then_text_deltas(claude):
    with claude.messages.stream(model=THINKER, max_tokens=40, messages=Q,
                                extra_body={"temperature": 0}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
    assert deltas[-1] == "text_delta" and [b.type for b in final.content] == ["thinking", "text"]


def test_thinking_enabled_is_served_by_a_model_that_thinks(claude):
    msg = claude.messages.create(model=THINKER, max_tokens=1100, messages=Q,
                                 thinking={"type": "enabled", "budget_tokens": 1024},
                                 extra_body={"temperature": 0})
    assert msg.content[0].type == "thinking"


def test_thinking_disabled_answers_without_reasoning(claude):
    msg = claude.messages.create(model=THINKER, max_tokens=20, messages=Q,
                                 thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["text"]


def test_omitted_thinking_keeps_the_block_without_its_text(claude):
    msg = claude.messages.create(model=THINKER, max_tokens=40, messages=Q,
                                 thinking={"type": "adaptive", "display": "omitted"},
                                 extra_body={"temperature": 0})
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == ""
    assert msg.content[1].text == "Paris"


def test_a_thinking_budget_below_1024_is_a_400(base):
    resp = httpx.post(f"{base}/v1/messages", json={
        "model": THINKER, "max_tokens": 2048, "messages": Q,
        "thinking": {"type": "enabled", "budget_tokens": 100}})
    assert resp.status_code == 400 and "budget_tokens" in resp.json()["error"]["message"]


def test_a_thinking_block_sent_back_is_part_of_the_prompt(claude):
    def count(thinking: str) -> int:
        return claude.messages.count_tokens(model=THINKER, messages=Q + [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": thinking, "signature": ""},
                {"type": "text", "text": "Paris"}]},
            {"role": "user", "content": "And of Spain?"}]).input_tokens
    assert count("The capital of France is Paris, on the Seine.") > count("Paris.")
