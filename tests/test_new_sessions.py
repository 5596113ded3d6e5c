"""A new agent session starts from the cache: two sessions whose system texts differ early (each
names its own folder) and whose tools are the same, the second on a restarted server, sent as
agents send them (the `anthropic` SDK on /v1/messages, the `openai` SDK on chat completions).
With the tools ahead of the system text the second session's first prompt reads its whole tool
section from the disk tier (a head cut from the first session's snapshot) and answers as it
would cold."""
import re

import anthropic
import openai
import pytest

from tests.server_proc import SMOLLM2_NAME, server_process

TOOLS = [{"name": f"tool_{name}", "description": f"{name.title()} the given path of the project "
          f"and report what {name} found, with line numbers and a short summary of each part. "
          f"Use it whenever the user asks to {name} something in the repository.",
          "input_schema": {"type": "object", "properties": {
              "path": {"type": "string", "description": f"the file or folder to {name}"},
              "depth": {"type": "integer", "description": "how many levels to go down"}},
              "required": ["path"]}}
         for name in ("read", "write", "list", "search", "test", "build", "lint", "format",
                      "diff", "commit", "review", "explain")]


def system(folder: str) -> str:
    return (f"You are a coding agent. Your memory file is /home/me/.agent/projects/{folder}/"
            "memory.md. Read the files before you change them and answer briefly.")


def ask(folder: str) -> dict:
    return dict(model=SMOLLM2_NAME, max_tokens=12, extra_body={"temperature": 0},
                system=system(folder),
                tools=TOOLS, messages=[{"role": "user", "content": "What is in this folder?"}])


def chat(folder: str) -> dict:
    tools = [{"type": "function", "function": {"name": t["name"] + "_file",
              "description": t["description"], "parameters": t["input_schema"]}}
             for t in TOOLS]
    return dict(model=SMOLLM2_NAME, max_tokens=12, temperature=0, tools=tools,
                messages=[{"role": "system", "content": system(folder)},
                          {"role": "user", "content": "What is in this folder?"}])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {"PAGEDLLAMA_CACHE_DIR": str(tmp_path_factory.mktemp("prefix")),
            "PAGEDLLAMA_CACHE_MIN_TOKENS": "64", "PAGEDLLAMA_N_CTX": "4096",
            "PAGEDLLAMA_MAX_SEQS": "2"}


def clients(base: str) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300),
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300))


def test_a_new_session_in_another_folder_reads_its_tools_from_the_disk_tier(env):
    with server_process(env) as first:
        claude, oai = clients(first.base)
        a = claude.messages.create(**ask("alpha"))
        a_chat = oai.chat.completions.create(**chat("alpha"))
    assert a.usage.cache_read_input_tokens == 0
    assert a_chat.usage.prompt_tokens_details.cached_tokens < 64   # the fallback's first words
    with server_process(env) as second:             # a restart: only the disk tier is left
        claude, oai = clients(second.base)
        b = claude.messages.create(**ask("beta"))
        b_chat = oai.chat.completions.create(**chat("beta"))
        log = second.log()
    prompt = (b.usage.input_tokens + b.usage.cache_creation_input_tokens
              + b.usage.cache_read_input_tokens)
    assert b.usage.cache_read_input_tokens >= 0.75 * prompt, b.usage
    cached = b_chat.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.75 * b_chat.usage.prompt_tokens, b_chat.usage
    assert re.findall(r"cached=\d+ cached_from=(\w+)", log) == ["disk", "disk"]
    with server_process({**env, "PAGEDLLAMA_CACHE_DIR": ""}) as cold:   # the cold reference
        claude, oai = clients(cold.base)
        b_cold = claude.messages.create(**ask("beta"))
        b_chat_cold = oai.chat.completions.create(**chat("beta"))
    assert b_cold.usage.cache_read_input_tokens == 0
    assert texts(b) == texts(b_cold)
    assert b_chat.choices[0].message.content == b_chat_cold.choices[0].message.content


def texts(message) -> list[str | None]:
    """A message's blocks as text (a call's id is new on every answer)."""
    return [getattr(block, "text", None) or str(getattr(block, "input", "")) for block in
            message.content]
