"""A model's context capped at what it was trained on, and chat templates given by name."""
from dataclasses import replace
from pathlib import Path

import pytest

from engine import ChatTemplate, EngineConfig
from engine.gguf_info import read_header
from server.config import ModelSpec, chat_template_path
from server.service.loading import cap_context
from tests.server_proc import SMOLLM2


def spec(n_ctx: int) -> ModelSpec:
    return ModelSpec("smol", SMOLLM2, replace(EngineConfig(), n_ctx=n_ctx))


def test_a_context_beyond_the_trained_one_is_capped_there():
    s = spec(32768)
    cap_context(s, read_header(SMOLLM2), beyond=False)
    assert s.engine.n_ctx == 8192          # SmolLM2's context_length


def test_a_context_beyond_the_trained_one_is_kept_when_allowed():
    s = spec(32768)
    cap_context(s, read_header(SMOLLM2), beyond=True)
    assert s.engine.n_ctx == 32768


def test_a_context_within_the_trained_one_is_left_alone():
    s = spec(2048)
    cap_context(s, read_header(SMOLLM2), beyond=False)
    assert s.engine.n_ctx == 2048


@pytest.mark.parametrize("name", ["chatml", "gemma"])
def test_a_template_is_found_by_name(name):
    path = chat_template_path(name, Path.cwd(), "PAGEDLLAMA_CHAT_TEMPLATE")
    assert path.name == f"{name}.jinja" and path.is_file()


def test_an_unknown_template_name_says_which_names_exist(tmp_path):
    with pytest.raises(ValueError, match="chatml, gemma"):
        chat_template_path("nope", tmp_path, "PAGEDLLAMA_CHAT_TEMPLATE")


def test_the_gemma_template_puts_the_system_prompt_in_the_first_user_turn():
    source = chat_template_path("gemma", Path.cwd(), "t").read_text()
    text = ChatTemplate(source, "<bos>", "<eos>").render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
