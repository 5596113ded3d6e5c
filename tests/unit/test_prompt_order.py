"""Prompt order as a cache decision: tool definitions before the system text (Anthropic's order:
tools, system, messages), so that two agent sessions whose system texts differ early (a folder,
a date, a memory path) still share their whole tool section as a prompt prefix."""
import os
from unittest import mock

from engine.chat import ChatTemplate
from server.config import TEMPLATES, load_settings
from server.openai.tool_fields import parse_tools, prompt_input, render_messages

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool number {i}, which does thing {i} well.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}} for i in range(6)]


def session(folder: str) -> list[dict]:
    """An agent's first request: a system text naming its folder early, then a question."""
    return [{"role": "system", "content": f"You are a coding agent.\nMemory: /home/me/{folder}/"
             "memory.md\nAnswer briefly and use the tools."},
            {"role": "user", "content": f"List the files in /home/me/{folder}."}]


def rendered(template: ChatTemplate, messages: list[dict], tools_first: bool = True) -> str:
    msgs, tools = prompt_input(messages, parse_tools(TOOLS, "auto", None),
                               template.knows_tools, tools_first)
    return template.render(msgs, tools=tools, tools_first=tools_first)


def shared(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def test_the_fallback_puts_the_tools_ahead_of_the_system_text():
    (system, user) = render_messages(session("alpha"), parse_tools(TOOLS, "auto", None))
    text = system["content"]
    assert text.startswith("You can call these functions")
    assert text.index('"tool_5"') < text.index("You are a coding agent.")
    assert user == session("alpha")[1]


def test_with_tools_first_off_the_fallback_keeps_the_system_text_first():
    (system, _) = render_messages(session("alpha"), parse_tools(TOOLS, "auto", None), False)
    assert system["content"].startswith("You are a coding agent.")
    assert system["content"].index("You are a coding agent.") < system["content"].index("tool_5")


def test_a_request_without_a_system_message_gets_the_tools_alone_as_one():
    msgs = render_messages(session("alpha")[1:], parse_tools(TOOLS, "auto", None))
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("You can call")
    assert msgs[1:] == session("alpha")[1:]


def test_two_sessions_in_other_folders_share_the_whole_tool_section():
    template = ChatTemplate(CHATML)
    a, b = rendered(template, session("alpha")), rendered(template, session("beta"))
    tools_end = a.index("You are a coding agent.")
    assert shared(a, b) > tools_end        # every tool, and the system text up to the folder
    old_a, old_b = (rendered(template, session(f), tools_first=False) for f in ("alpha", "beta"))
    assert shared(old_a, old_b) < old_a.index("tool_0")   # the other order shares no tool


def test_the_gemma_tools_template_renders_the_tools_first_and_follows_the_setting():
    template = ChatTemplate((TEMPLATES / "gemma-tools.jinja").read_text(), bos_token="<bos>")
    assert template.knows_tools
    first = rendered(template, session("alpha"))
    assert first.startswith("<bos><start_of_turn>user\nYou may call one or more functions")
    assert first.index("</tools>") < first.index("You are a coding agent.")
    assert shared(first, rendered(template, session("beta"))) > first.index("You are a coding")
    last = rendered(template, session("alpha"), tools_first=False)
    assert last.startswith("<bos><start_of_turn>user\nYou are a coding agent.")
    assert last.index("You are a coding agent.") < last.index("<tools>")


def test_a_template_without_the_variable_renders_as_before():
    template = ChatTemplate(CHATML)
    msgs = session("alpha")
    assert template.render(msgs) == template.render(msgs, tools_first=False)


def test_the_setting_is_on_unless_turned_off():
    with mock.patch.dict(os.environ, {}, clear=False):
        os.environ.pop("PAGEDLLAMA_TOOLS_FIRST", None)
        assert load_settings().tools_first is True
    with mock.patch.dict(os.environ, {"PAGEDLLAMA_TOOLS_FIRST": "0"}):
        assert load_settings().tools_first is False
