"""The routes beside generation, through a real server: GET /v1/models/{id}, /tokenize,
/detokenize, /v1/embeddings, /v1/responses (openai SDK), CORS preflight."""
import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.server_proc import SMOLLM2_NAME, running_server

MODEL = SMOLLM2_NAME
ORIGIN = "http://localhost:5173"


@pytest.fixture(scope="module")
def base():
    with running_server({"PAGEDLLAMA_CORS_ORIGINS": ORIGIN, "PAGEDLLAMA_MAX_SEQS": "4"}) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(base):
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---- models, tokenize, detokenize ---------------------------------------------------------------
def test_a_model_is_retrieved_by_its_id(sdk):
    model = sdk.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "pagedllama"


def test_an_unknown_model_id_is_a_404_in_the_openai_shape(base):
    err = error_of(httpx.get(f"{base}/v1/models/no-such-model"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_tokenize_then_detokenize_gives_the_text_back(base):
    tokens = httpx.post(f"{base}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json() == {
        "content": "Hello world"}


def test_a_control_token_survives_the_round_trip(base):
    text = "<|im_start|>user\nHi"
    out = httpx.post(f"{base}/tokenize", json={"content": text, "with_pieces": True}).json()
    assert out["tokens"][0]["piece"] == "<|im_start|>"
    tokens = [t["id"] for t in out["tokens"]]
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["content"] == text


def test_tokenize_with_pieces_pairs_each_id_with_its_text(base):
    out = httpx.post(f"{base}/tokenize", json={"content": "Hello world", "with_pieces": True,
                                              "model": MODEL}).json()["tokens"]
    assert "".join(t["piece"] for t in out) == "Hello world" and isinstance(out[0]["id"], int)


def test_add_special_adds_the_models_special_prefix_tokens(base):
    plain = httpx.post(f"{base}/tokenize", json={"content": "Hi"}).json()["tokens"]
    special = httpx.post(f"{base}/tokenize", json={"content": "Hi", "add_special": True}).json()
    assert special["tokens"][-len(plain):] == plain and len(special["tokens"]) >= len(plain)


def test_detokenize_of_a_token_outside_the_vocabulary_is_a_400(base):
    err = error_of(httpx.post(f"{base}/detokenize", json={"tokens": [1, 10_000_000]}), 400)
    assert err["param"] == "tokens" and err["code"] == "invalid_token"


# ---- CORS ------------------------------------------------------------------------------------
def test_a_cors_preflight_from_the_configured_origin_is_answered(base):
    resp = httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN


# ---- embeddings -------------------------------------------------------------------------------
TEXTS = ["The cat sat on the mat.", "A kitten is sitting on a rug.",
         "Stock markets fell sharply today."]


def vectors(sdk, inputs, **kw) -> np.ndarray:
    resp = sdk.embeddings.create(model=MODEL, input=inputs, **kw)
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def test_embeddings_of_a_list_are_one_normalized_vector_each_with_usage(sdk):
    resp = sdk.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    vecs = np.array([d.embedding for d in resp.data])
    assert vecs.shape == (3, 576)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > 3 * 5


def test_the_same_text_gives_the_same_vector(sdk):
    first, again = vectors(sdk, TEXTS[0]), vectors(sdk, [TEXTS[2], TEXTS[0]])[1]
    assert np.array_equal(first[0], again)


def test_float_and_base64_encodings_give_the_same_vector(sdk):
    as_float = vectors(sdk, TEXTS[1], encoding_format="float")
    as_b64 = vectors(sdk, TEXTS[1])   # the SDK asks for base64 by default and decodes it
    assert np.allclose(as_float, as_b64, atol=1e-6)


def test_token_ids_embed_like_the_text_they_spell(sdk, base):
    ids = httpx.post(f"{base}/tokenize", json={"content": TEXTS[0], "add_special": True}).json()
    assert np.allclose(vectors(sdk, [ids["tokens"]]), vectors(sdk, TEXTS[0]), atol=1e-6)


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(sdk):
    # measured with SmolLM2-135M, mean pooling: cat/kitten 0.92, cat/stock markets 0.75 (pizza
    # pair 0.88; unrelated pairs 0.69-0.82): true here, but by a modest margin
    cat, kitten, stocks = vectors(sdk, TEXTS)
    assert cat @ kitten > cat @ stocks


def test_a_dimensions_other_than_the_models_is_a_400_unsupported_parameter(sdk):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input="hi", dimensions=64)
    assert exc.value.body["code"] == "unsupported_parameter"
    assert exc.value.body["param"] == "dimensions"


@pytest.mark.parametrize("field,value", [("truncate_prompt_tokens", 2), ("normalize", False),
                                         ("foo", 1)])
def test_an_unknown_embeddings_field_is_a_400_naming_it(sdk, field, value):
    """vLLM's extensions would change the vectors: refused, not ignored ("user" is harmless)."""
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input="a b c d e", extra_body={field: value})
    assert exc.value.body["code"] == "unsupported_parameter" and exc.value.body["param"] == field
    assert sdk.embeddings.create(model=MODEL, input="hi", user="u1").data


def test_a_null_encoding_format_means_float(base):
    resp = httpx.post(f"{base}/v1/embeddings",
                      json={"model": MODEL, "input": "hi", "encoding_format": None})
    assert resp.status_code == 200 and isinstance(resp.json()["data"][0]["embedding"], list)


def test_an_empty_input_string_is_a_400(base):
    err = error_of(httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": ""}), 400)
    assert err["param"] == "input"


# ---- responses -------------------------------------------------------------------------------
def respond(sdk, **kw):
    return sdk.responses.create(model=MODEL, input="What is the capital of France?",
                                max_output_tokens=16, temperature=0, **kw)


def test_a_response_has_its_text_status_and_usage(sdk):
    resp = respond(sdk, instructions="Answer in one short sentence.")
    assert resp.object == "response" and resp.output_text.strip()
    assert resp.status in ("completed", "incomplete")
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"
    assert 0 < resp.usage.output_tokens <= 16
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_a_response_cut_by_max_output_tokens_is_incomplete(sdk):
    resp = sdk.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                extra_body={"ignore_eos": True})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


def test_a_streamed_response_sends_the_typed_events_in_order_and_the_same_text(sdk):
    whole = respond(sdk)
    events = list(respond(sdk, stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response." + ("completed" if whole.status == "completed"
                                                       else "incomplete")]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_message_history_is_answered(sdk):
    resp = sdk.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}])
    assert resp.output_text.strip()


def test_store_true_is_a_400_because_the_server_is_stateless(sdk):
    with pytest.raises(openai.BadRequestError) as exc:
        respond(sdk, store=True)
    assert exc.value.body["param"] == "store"


@pytest.mark.parametrize("options,param", [
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
    ({"chunk_size": 4}, "stream_options.chunk_size")])
def test_a_stream_option_a_response_does_not_honour_is_a_400_naming_it(sdk, options, param):
    with pytest.raises(openai.BadRequestError) as exc:
        respond(sdk, stream=True, stream_options=options)
    assert exc.value.body["param"] == param


# ---- assistant prefill -------------------------------------------------------------------------
PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_continues_the_assistant_text(sdk):
    resp = sdk.chat.completions.create(
        model=MODEL, messages=PREFILL, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in resp.choices[0].message.content


def test_continue_final_message_with_a_generation_prompt_is_a_400(base):
    err = error_of(httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": PREFILL, "continue_final_message": True}), 400)
    assert err["param"] == "continue_final_message"


def test_embeddings_work_beside_an_agents_long_context_up_to_their_own_limit():
    """With the context an agent needs (32,768 tokens) the embedding context keeps its own
    length (PAGEDLLAMA_EMBED_MAX_TOKENS): it fits the memory budget, and a longer input is a
    400 that names the limit."""
    with running_server({"PAGEDLLAMA_N_CTX": "32768", "PAGEDLLAMA_N_CTX_BEYOND_TRAINED": "1",
                         "PAGEDLLAMA_MAX_SEQS": "2", "PAGEDLLAMA_EMBED_MAX_TOKENS": "256"}) as url:
        ok = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi there"},
                        timeout=120)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] > 0
        err = error_of(httpx.post(f"{url}/v1/embeddings", timeout=120, json={
            "model": MODEL, "input": "word " * 400}), 400)
        assert "256" in err["message"]
