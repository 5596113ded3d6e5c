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

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
