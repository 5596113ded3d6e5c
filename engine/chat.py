"""Chat messages -> prompt text with the Jinja2 chat template stored in the GGUF."""
from __future__ import annotations

import json
from datetime import date

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    """As transformers renders chat templates: plain JSON (jinja's own escapes <, >, & and ')."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise,
                           strftime_now=lambda fmt: date.today().strftime(fmt))
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        # Renders tools itself, in the tagged syntax server/openai/tool_fields.py parses (Hermes,
        # Qwen2.5):
        # the template reads a `tools` variable and writes <tool_call> blocks.
        self.knows_tools = ("tools" in meta.find_undeclared_variables(env.parse(source))
                            and "<tool_call>" in source)
        # A thinking model's template (Qwen3, the DeepSeek-R1 distills) writes its reasoning
        # as <think>…</think>: its answers start with reasoning (server/chat/answer.py).
        self.thinks = "</think>" in source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               tools_first: bool = True) -> str:
        """The prompt text. `continue_final_message` (vLLM's assistant prefill): the last
        message is left open, so the model continues its text instead of starting a new turn.
        `tools` (OpenAI's shape) go to the template as its `tools` variable; `tools_first` as
        its `tools_first` variable (read by the templates of engine/templates that render tools:
        the tools before the system text)."""
        if continue_final_message:
            return self._render_open(messages, tools, tools_first)
        return self._render(messages, add_generation_prompt, tools, tools_first)

    def _render_open(self, messages: list[dict], tools: list[dict] | None,
                     tools_first: bool) -> str:
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs an assistant message last")
        text = self._render(messages, False, tools, tools_first)
        final = messages[-1].get("content") or ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("the chat template does not show the final message's text")
        return text[:end + len(final)]

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None, tools_first: bool = True) -> str:
        extra = {"tools": tools} if tools else {}   # templates test `tools is defined`
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        tools_first=tools_first, **extra)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
