"""Tools rendered by a chat template that knows them (Hermes / Qwen2.5 style), or the fallback."""
import json
import re

from engine.chat import ChatTemplate
from engine.gguf_info import gguf_chat_template
from server.openai.tool_fields import parse_tool_calls, parse_tools, prompt_input
from tests.grammar_bytes import accepts
from tests.server_proc import GEMMA3, SMOLLM2

# Modelled on the tool section of Qwen2.5's template (own wording): tools listed as JSON inside
# <tools></tools> in the system turn, calls as <tool_call> blocks, results in <tool_response>
# inside a user turn (consecutive results share one).
QWEN_STYLE = """
{%- set default_system = 'You are a helpful assistant.' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- messages[0].content if messages[0].role == 'system' else default_system }}
    {{- '\\n\\n# Tools\\n\\nThe functions below are available, one JSON signature per line '
        'inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, reply with <tool_call></tool_call> holding '
        '{"name": <name>, "arguments": <object>}.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Reads `tools` but calls in its own JSON (Llama 3.1 style): our parser would not read it.
OWN_SYNTAX = ("{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city (<city> as named locally)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


def render(source: str, choice="auto", messages=HISTORY) -> str:
    template = ChatTemplate(source)
    msgs, tools = prompt_input(messages, parse_tools([WEATHER], choice, None),
                               template.knows_tools)
    return template.render(msgs, tools=tools)


def test_a_template_that_reads_tools_and_writes_tool_call_knows_tools():
    assert ChatTemplate(QWEN_STYLE).knows_tools


def test_templates_without_tools_or_with_another_call_syntax_do_not():
    assert not ChatTemplate(CHATML).knows_tools
    assert not ChatTemplate(OWN_SYNTAX).knows_tools
    # `tools` set inside the template is not the caller's variable
    assert not ChatTemplate("{% set tools = [] %}<tool_call>{{ tools }}").knows_tools


def test_smollm2s_own_template_gets_the_fallback():
    source = gguf_chat_template(SMOLLM2)
    assert source and "<|im_start|>" in source
    assert not ChatTemplate(source).knows_tools


def test_gemma3s_gguf_has_no_template_at_all():
    assert gguf_chat_template(GEMMA3) is None


def test_a_template_that_knows_tools_lists_them_as_json_without_our_description():
    text = render(QWEN_STYLE)
    listed = re.search(r"<tools>\n(.*?)\n</tools>", text, re.DOTALL).group(1)
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER]
    assert "(<city> as named locally)" in text          # plain JSON, not HTML-escaped
    assert "You can call these functions" not in text   # the fallback's description


def test_a_template_that_knows_tools_renders_the_history_in_its_own_form():
    text = render(QWEN_STYLE)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "weather", "arguments": '
            '{"city": "Rome"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain"
            "\n</tool_response><|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n")


def test_calls_the_template_writes_are_what_the_parser_reads_back():
    turn = render(QWEN_STYLE).split("<|im_start|>assistant")[1]
    _, calls = parse_tool_calls(turn.removesuffix("<|im_end|>\n<|im_start|>user\n"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("weather", {"city": "Rome"})]


def test_tool_choice_none_leaves_the_tools_out_but_keeps_the_history():
    text = render(QWEN_STYLE, choice="none")
    assert "<tools>" not in text and "You are a helpful assistant." in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_arguments_that_are_not_json_reach_the_template_as_text():
    odd = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "Oslo"}}]}]
    msgs, _ = prompt_input(odd, parse_tools([WEATHER], "auto", None), native=True)
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == "Oslo"
    assert odd[0]["tool_calls"][0]["function"]["arguments"] == "Oslo"   # the input is not changed


def test_a_template_without_tools_gets_the_fallback_form():
    text = render(CHATML)
    assert "<|im_start|>system\nYou can call these functions" in text
    assert json.dumps({"name": "weather", "description": WEATHER["function"]["description"],
                       "parameters": WEATHER["function"]["parameters"]}) in text
    assert ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>') in text
    assert "<|im_start|>user\n<tool_response>sunny</tool_response><|im_end|>" in text


def test_the_call_grammar_admits_the_newlines_hermes_style_models_write():
    g = parse_tools([WEATHER], "required", True).grammar()
    assert accepts(g, '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                      '\n<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert not accepts(g, '<tool_call>\n\n{"name": "weather", "arguments": {"city": "Oslo"}}'
                          '</tool_call>')
