"""Chat messages -> prompt text with the Jinja2 chat template stored in the GGUF."""
from __future__ import annotations

from datetime import date

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise,
                           strftime_now=lambda fmt: date.today().strftime(fmt))
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        """The prompt text. `continue_final_message` (vLLM's assistant prefill): the last
        message is left open, so the model continues its text instead of starting a new turn."""
        if continue_final_message:
            return self._render_open(messages)
        return self._render(messages, add_generation_prompt)

    def _render_open(self, messages: list[dict]) -> str:
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs an assistant message last")
        text, final = self._render(messages, False), messages[-1].get("content") or ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("the chat template does not show the final message's text")
        return text[:end + len(final)]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
