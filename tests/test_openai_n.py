"""n > 1 (one prefill, forked), lists of prompts and echo with logprobs, through a real server
and the openai SDK (the shared server fixture)."""
import json

import httpx
import openai
import pytest

from tests.devices import cpu_exact
from tests.test_api import contexts, wait_idle

Q = [{"role": "user", "content": "Name a colour."}]


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=Q, **{"max_tokens": 12, **kw})


# ---- n > 1 --------------------------------------------------------------------------------------
@cpu_exact
def test_greedy_n3_gives_three_identical_choices_equal_to_the_n1_answer(client, model_name):
    one = chat(client, model_name, temperature=0).choices[0].message.content
    three = chat(client, model_name, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one] * 3


@cpu_exact
def test_sampled_n3_with_a_seed_is_reproducible_and_choices_differ(client, model_name):
    kw = dict(temperature=1.0, n=3, seed=11, max_tokens=16)
    a = [c.message.content for c in chat(client, model_name, **kw).choices]
    b = [c.message.content for c in chat(client, model_name, **kw).choices]
    assert a == b and len(set(a)) > 1
    n1 = chat(client, model_name, temperature=1.0, seed=11, max_tokens=16)
    assert n1.choices[0].message.content == a[0]   # choice 0 uses the request's seed


def test_usage_counts_every_choices_tokens_and_the_prompt_once(client, model_name):
    one = client.chat.completions.create(model=model_name, messages=Q, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    three = client.chat.completions.create(model=model_name, messages=Q, max_tokens=6, n=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 18 and one.usage.completion_tokens == 6
    assert all(c.finish_reason == "length" for c in three.choices)


def test_streamed_n2_chunks_carry_both_indexes_and_each_ends_with_its_finish(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=Q, max_tokens=8, n=2, temperature=0.9, seed=5, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, "a chunk after the choice's finish"
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and all(text.values())
    assert usage.completion_tokens >= 2


def test_n_above_the_limit_is_a_400_naming_n(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, model_name, n=9)
    err = exc.value.body
    assert err["param"] == "n" and err["code"] == "invalid_value" and "8" in err["message"]


def test_n2_with_a_json_schema_constrains_every_choice(client, model_name):
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
              "required": ["c"], "additionalProperties": False}
    resp = chat(client, model_name, n=2, temperature=1.0, seed=3, max_tokens=24,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}})
    assert all(json.loads(c.message.content)["c"] in ("red", "blue") for c in resp.choices)


def test_n2_with_logprobs_gives_each_choice_its_own(client, model_name):
    resp = chat(client, model_name, n=2, temperature=0, max_tokens=4, logprobs=True)
    a, b = (c.logprobs.content for c in resp.choices)
    assert len(a) == 4 and [t.logprob for t in a] == [t.logprob for t in b]


def test_disconnect_during_an_n4_stream_frees_every_sequence_and_block(server_url, model_name):
    wait_idle(server_url)
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", timeout=60, json={
            "model": model_name, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True, "n": 4}) as resp:
        lines = resp.iter_lines()
        for _ in range(20):
            next(lines)
        assert contexts(server_url)[0]["running"] == 4
    ctx = wait_idle(server_url)[0]
    assert ctx["kv_used_blocks"] == 0 and ctx["running"] == 0 and ctx["live_seqs"] == 0


# ---- a list of prompts ------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "One, two, three,", "My favourite food is"]


@cpu_exact
def test_a_list_of_three_prompts_gives_three_choices_equal_to_three_requests(client, model_name):
    solo = [client.completions.create(model=model_name, prompt=p, max_tokens=8,
                                      temperature=0).choices[0].text for p in PROMPTS]
    resp = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == solo
    singles = [client.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0)
               for p in PROMPTS]
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert resp.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_prompts_with_n2_are_indexed_prompt_times_n_plus_j(client, model_name):
    resp = client.completions.create(model=model_name, prompt=["One, two,", "Hello"], n=2,
                                     max_tokens=3, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text
    assert resp.choices[2].text == resp.choices[3].text


def test_a_list_of_token_id_prompts_gives_one_choice_each(client, model_name):
    ids = [[504, 3575, 282], [1226, 28, 827, 28]]
    resp = client.completions.create(model=model_name, prompt=ids, max_tokens=3, temperature=0)
    solo = [client.completions.create(model=model_name, prompt=p, max_tokens=3, temperature=0)
            for p in ids]
    assert [c.text for c in resp.choices] == [s.choices[0].text for s in solo]
    assert resp.usage.prompt_tokens == 7


def test_a_streamed_list_of_prompts_finishes_every_choice(client, model_name):
    finish = {}
    for chunk in client.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=4,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"}


# ---- echo with logprobs -------------------------------------------------------------------------
@cpu_exact
def test_echo_with_logprobs_scores_the_prompt_then_the_answer(client, model_name):
    prompt = "The capital of France is"
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                      temperature=0, logprobs=2)
    echo = client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                     temperature=0, logprobs=2, echo=True)
    n_prompt = echo.usage.prompt_tokens
    lp, gen = echo.choices[0].logprobs, plain.choices[0].logprobs
    assert echo.choices[0].text == prompt + plain.choices[0].text
    assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens) == echo.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # the 2 most likely, and the token itself when it is not one of them (OpenAI: logprobs + 1)
    assert lp.tokens[1] in lp.top_logprobs[1] and 2 <= len(lp.top_logprobs[1]) <= 3
    assert lp.tokens[n_prompt:] == gen.tokens
    assert lp.token_logprobs[n_prompt:] == gen.token_logprobs
    assert lp.text_offset[n_prompt:] == gen_offsets(gen, len(prompt))


def gen_offsets(gen, start):
    return [start + o - gen.text_offset[0] for o in gen.text_offset]


def test_max_tokens_0_with_echo_scores_the_prompt_only(client, model_name):
    resp = client.completions.create(model=model_name, prompt="Paris is in France.",
                                     max_tokens=0, echo=True, logprobs=0)
    c = resp.choices[0]
    assert c.text == "Paris is in France." and resp.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == resp.usage.prompt_tokens
    assert c.logprobs.token_logprobs[0] is None and c.finish_reason == "length"


def test_max_tokens_0_without_echo_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"


def test_echo_logprobs_of_a_repeated_prompt_are_the_same(client, model_name):
    """A prompt that wants its logprobs takes nothing from the prefix cache (it needs the
    logits of every position), so asking twice gives the same numbers."""
    kw = dict(model=model_name, prompt="A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
              max_tokens=0, echo=True, logprobs=1)
    a, b = (client.completions.create(**kw).choices[0].logprobs for _ in range(2))
    assert a.token_logprobs == b.token_logprobs


def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_first(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="Paris is in", max_tokens=3,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    first = chunks[0].choices[0]
    assert first.text == "Paris is in" and first.logprobs.token_logprobs[0] is None
    assert "".join(first.logprobs.tokens) == "Paris is in"
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("Paris is in")
