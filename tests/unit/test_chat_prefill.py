"""Assistant prefill (vLLM's continue_final_message / add_generation_prompt) in chat rendering."""
import pytest

from engine.chat import ChatTemplate, ChatTemplateError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": "The capital is"}]


def test_continue_final_message_leaves_the_last_assistant_message_open():
    text = ChatTemplate(CHATML).render(HISTORY, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital is")


def test_without_a_generation_prompt_the_history_ends_closed():
    text = ChatTemplate(CHATML).render(HISTORY[:1], add_generation_prompt=False)
    assert text.endswith("Capital of France?<|im_end|>\n")


def test_continue_final_message_needs_an_assistant_message_last():
    with pytest.raises(ChatTemplateError):
        ChatTemplate(CHATML).render(HISTORY[:1], False, continue_final_message=True)
