"""The cheap token bound (server/service/prompts.py) never exceeds the real token count, with the real
tokenizers of both models: a prompt it rejects could never have fit."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Model
from server.service.prompts import TokenBound
from tests.server_proc import GEMMA3, SMOLLM2

PIECES = ["<|im_end|>", "<|im_start|>", "<bos>", "<start_of_turn>", "<eos>", " ", "    ",
          "\n", "\t", "#", "=", "-", "a", "the", " quick", "é", "日本", "😀", "0", "123", "<",
          ">", "|", "_", "\\u0000", "\x00", "\u2581", "=" * 70, " " * 90]


@pytest.fixture(scope="module", params=[SMOLLM2, GEMMA3], ids=["smollm2-bpe", "gemma3-spm"])
def model_and_bound(request):
    if not request.param.exists():
        pytest.fail(f"{request.param} is missing: run `make models`")
    model = Model(request.param)
    yield model, TokenBound(model.byte_weights())
    model.close()


texts = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=120).map("".join),
    st.text(max_size=120),
    st.tuples(st.sampled_from(PIECES), st.integers(1, 300)).map(lambda p: p[0] * p[1]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_the_bound_never_exceeds_the_real_token_count(model_and_bound, text):
    model, bound = model_and_bound
    assert bound.at_least(text) <= len(model.tokenize(text, add_special=False))


def test_the_bound_rejects_the_slow_special_token_prompt_at_once(model_and_bound):
    model, bound = model_and_bound
    assert bound.weights is not None
    assert bound.at_least("<|im_end|>" * 20_000) > 2048
