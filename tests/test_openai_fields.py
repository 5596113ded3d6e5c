"""The OpenAI surface never fails open: structured output is enforced, unsupported fields are a
400 naming them (real openai SDK, real server; the shared server fixture)."""
import json

import httpx
import jsonschema
import openai
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def ask(client, model, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=0, **kw)


def error_of(exc) -> dict:
    return exc.value.body


# ---- never fail open ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("verbosity", "low"),
    ("reasoning_effort", "low"),
    ("guided_json", {"type": "object"})])
def test_a_field_we_do_not_implement_is_a_400_naming_it(client, model_name, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, model_name, max_tokens=2, extra_body={field: value})
    assert error_of(exc)["code"] == "unsupported_parameter" and error_of(exc)["param"] == field


def test_harmless_fields_are_accepted(client, model_name):
    resp = ask(client, model_name, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
               extra_body={"service_tier": "auto"})
    assert resp.choices[0].finish_reason == "length"


def test_an_image_content_part_is_a_400_naming_messages(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    assert error_of(exc)["code"] == "unsupported_parameter" and error_of(exc)["param"] == "messages"


@pytest.mark.parametrize("options,param", [
    ({"include_usage": True, "shards": 2}, "stream_options.shards"),
    ({"include_obfuscation": True}, "stream_options.include_obfuscation")])
def test_a_stream_option_we_do_not_implement_is_a_400_naming_it(client, model_name, options,
                                                                param):
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, model_name, max_tokens=2, stream=True, stream_options=options)
    assert error_of(exc)["code"] == "unsupported_parameter" and error_of(exc)["param"] == param


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, model_name):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries
    the usage so far; include_obfuscation false is what we do anyway and is accepted."""
    chunks = list(ask(client, model_name, max_tokens=12, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}))
    assert all(c.usage is not None for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    done = [c.usage.completion_tokens for c in body]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 12
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert sum(1 for c in body if c.choices and c.choices[0].delta.content) >= 2


def test_without_continuous_usage_stats_chunks_carry_no_usage(client, model_name):
    chunks = list(ask(client, model_name, max_tokens=4, stream=True,
                      stream_options={"include_usage": True}))
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


# ---- structured output ---------------------------------------------------------------------------
def test_json_object_output_parses(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=64, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Repeat exactly: {"answer": "yes"}'}])
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_json_schema_output_validates(client, model_name):
    resp = ask(client, model_name, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)


def test_json_schema_output_validates_when_sampled_and_streamed(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "A person?"}], max_tokens=64,
        temperature=0.8, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_llama_server_json_schema_field_constrains_completions(client, model_name):
    resp = client.completions.create(model=model_name, prompt="Person:", max_tokens=64,
                                     temperature=0, extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


def test_a_gbnf_grammar_constrains_the_output(client, model_name):
    resp = ask(client, model_name, max_tokens=8, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert resp.choices[0].message.content in ("yes", "no")
    assert resp.choices[0].finish_reason == "stop"


def test_an_invalid_schema_is_a_400_saying_what_is_wrong(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, model_name, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}})
    assert error_of(exc)["param"] == "response_format.json_schema.schema"
    assert "frob" in error_of(exc)["message"]


def test_a_grammar_that_does_not_parse_is_a_400(server_url, model_name):
    resp = httpx.post(f"{server_url}/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}],
        "grammar": "root ::= (("})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "grammar"


def test_an_unknown_response_format_type_is_a_400(server_url, model_name):
    resp = httpx.post(f"{server_url}/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "yaml"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"


# ---- tool calls ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_tool_choice_returns_calls_whose_arguments_validate(client, model_name):
    resp = client.chat.completions.create(model=model_name, messages=WEATHER_Q, max_tokens=48,
                                          temperature=0, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])


# every call breaks this schema (`not` undoes `required`); the grammar of a forced call holds
# what it can enforce (`not` is dropped), so the call always has a city
UNSATISFIABLE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                 "required": ["city"], "additionalProperties": False,
                 "not": {"required": ["city"]}}


def test_a_call_that_breaks_a_schema_that_is_not_strict_is_returned_as_a_call(client,
                                                                               model_name):
    """As OpenAI returns one: only `strict: true` promises the schema; the client checks."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": UNSATISFIABLE}}
    resp = client.chat.completions.create(model=model_name, messages=WEATHER_Q, max_tokens=48,
                                          temperature=0, tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(arguments["city"], str)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, UNSATISFIABLE)


def test_a_named_tool_choice_streams_openai_tool_call_deltas(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=WEATHER_Q, max_tokens=48, temperature=0, stream=True,
        tools=[WEATHER], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, args, finish, ids = "", "", None, set()
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            ids.add(d.id) if d.id else None
            name += d.function.name or ""
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish, len(ids)) == ("get_weather", "tool_calls", 1)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_with_tools_offered_a_streamed_answer_sends_its_text_as_it_is_generated(client,
                                                                               model_name):
    stream = client.chat.completions.create(
        model=model_name, max_tokens=24, temperature=0, stream=True, tools=[WEATHER],
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    deltas = [c.choices[0].delta.content for c in stream if c.choices and
              c.choices[0].delta.content]
    # held back, the whole text would come as one delta at the end
    assert len(deltas) > 1 and len(deltas[0]) < len("".join(deltas)) / 2


def test_a_history_with_calls_and_tool_results_is_accepted(client, model_name):
    resp = client.chat.completions.create(model=model_name, max_tokens=8, temperature=0,
                                          tools=[WEATHER], messages=WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_smollm2s_template_does_not_know_tools_so_the_fallback_renders_them(client, model_name):
    assert client.models.retrieve(model_name).model_extra["tool_format"] == "fallback"


def test_tool_choice_naming_an_unknown_function_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, messages=WEATHER_Q, max_tokens=4,
                                       tools=[WEATHER], tool_choice={
                                           "type": "function", "function": {"name": "nope"}})
    assert error_of(exc)["param"] == "tool_choice"


# ---- logit_bias ----------------------------------------------------------------------------------
def test_a_large_logit_bias_forces_its_token_greedy_and_sampled(client, model_name):
    texts = [client.completions.create(model=model_name, prompt="Hello", max_tokens=3,
                                       temperature=temperature, logit_bias={"28": 100},
                                       extra_body={"ignore_eos": True}).choices[0].text
             for temperature in (0, 0.9)]
    piece = texts[0][:len(texts[0]) // 3]
    assert piece and texts == [piece * 3, piece * 3]


def test_a_logit_bias_key_outside_the_vocabulary_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                  logit_bias={"999999": 5})
    assert error_of(exc)["param"] == "logit_bias"


# ---- logprobs ------------------------------------------------------------------------------------
def test_chat_logprobs_give_each_token_and_its_top_alternatives(client, model_name):
    resp = ask(client, model_name, max_tokens=4, logprobs=True, top_logprobs=3,
               extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.logprob   # greedy: the chosen one is the best
    assert "".join(t.token for t in content) == resp.choices[0].message.content


def test_streamed_chat_logprobs_cover_every_token(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, stream=True, logprobs=True, extra_body={"ignore_eos": True})
    n = sum(len(c.choices[0].logprobs.content) for c in stream
            if c.choices and c.choices[0].logprobs)
    assert n == 5


def test_completions_logprobs_are_parallel_lists(client, model_name):
    resp = client.completions.create(model=model_name, prompt="The sky is", max_tokens=3,
                                     temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == resp.choices[0].text and lp.text_offset[0] == 0


def test_streamed_completions_logprobs_have_the_offsets_of_the_whole_answer(client, model_name):
    kw = dict(model=model_name, prompt="The sky is", max_tokens=4, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    offsets = [o for c in client.completions.create(stream=True, **kw)
               if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.text_offset and offsets[1] == len(whole.tokens[0])


def test_null_n_stream_and_echo_mean_their_defaults(client, model_name):
    kw = dict(model=model_name, prompt="Hi", max_tokens=2, temperature=0)
    resp = client.completions.create(**kw, extra_body={"n": None, "stream": None, "echo": None})
    assert [c.text for c in resp.choices] == [client.completions.create(**kw).choices[0].text]


def test_top_logprobs_above_20_is_a_400(server_url, model_name):
    resp = httpx.post(f"{server_url}/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True, "top_logprobs": 21})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
