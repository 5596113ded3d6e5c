"""Later turns of the recorded agent sessions, built from the recordings' shape (not recorded):
what Claude Code 2.1.197 and Codex CLI 0.171.0 send once a model has thought, called tools and
read their results, which a recording against a small model that never calls a tool does not
hold. Each is its agent's recorded turn 2 (same route, headers, tools, system text and every
other field as sent) with the history grown by one more turn and a new question:

- Claude Code: each assistant content block in a message of its own, as its recorded turn 2
  sends its answers; `thinking` blocks with a `signature`, `tool_use` blocks of its recorded
  tools (Bash, Read) with `toolu_` ids, the results as a user message of `tool_result` blocks,
  `cache_control` on the last user block only. Its `context_management` asks for edits that act
  (`clear_thinking_20251015` keeping 1 turn, `clear_tool_uses_20250919` with a low trigger
  keeping 1 use), where the recording asks for none (keep all).
- Codex: the items the server returned sent back as the recorded turn 2 sends its answer (with
  the server's `id`); `reasoning` items with only `summary` and `encrypted_content` (Codex keeps
  no reasoning text: docs/api.md#codex), sealed under REASONING_KEY, which the server reading
  them must hold (PAGEDLLAMA_REASONING_KEY); `function_call` items of its recorded
  `exec_command` tool (`name`, `arguments` as JSON text, `call_id`), and `function_call_output`
  items with the output as Codex's exec tool writes it.

`python -m tests.agent_turns` writes them to tests/fixtures/agents/ (the sealed tokens differ
on every run: their nonce is random); tests/test_agent_requests.py checks that the files are
what this module builds.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
REASONING_KEY = "pagedllama agent fixtures"   # PAGEDLLAMA_REASONING_KEY of the server
NOTE = ("Built by tests/agent_turns.py from the shape of the recorded {source}: not recorded. "
        "Its history holds a turn with tool calls, their results and reasoning.")

CLAUDE_REPO = "/tmp/pagedllama-agents/claude/repo"
CODEX_REPO = "/tmp/pagedllama-agents/codex/repo"
LISTING = ("total 16\n"
           "drwxr-xr-x 3 user user 4096 Nov 28 10:02 .\n"
           "drwxr-xr-x 5 user user 4096 Nov 28 10:02 ..\n"
           "drwxr-xr-x 8 user user 4096 Nov 28 10:02 .git\n"
           "-rw-r--r-- 1 user user   64 Nov 28 10:02 README.md\n"
           "-rw-r--r-- 1 user user   22 Nov 28 10:02 hello.py")
HELLO = 'print("hello, world")\n'

# the edits the built Claude Code turn asks for; each clears something in its history
CLAUDE_EDITS = {"edits": [
    {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000},
     "keep": {"type": "tool_uses", "value": 1}}]}


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _signature(seed: str) -> str:
    """An opaque signature in the shape Anthropic's are (base64); this server does not check it."""
    return base64.b64encode(b"".join(hashlib.sha256(f"{seed}{i}".encode()).digest()
                                     for i in range(6))).decode()


def _thinking(text: str) -> dict:
    return {"role": "assistant", "content": [
        {"type": "thinking", "thinking": text, "signature": _signature(text)}]}


def _said(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _use(use_id: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": use_id, "name": name, "input": arguments}]}


def _result(use_id: str, content: str) -> dict:
    return {"role": "user", "content": [
        {"tool_use_id": use_id, "type": "tool_result", "content": content}]}


BASH_ID = "toolu_01JqV7WcXkR2mH3sTn8yLpAb"
READ_ID = "toolu_01Fz4nQe9uTcB6vYh2KxWmDs"


def claude_turn3() -> dict:
    """Claude Code's third turn: turn 1 ran Bash (`ls -la`), turn 2 read hello.py with Read, each
    turn thought first; the history as its recorded turn 2 sends it, then those answers."""
    source = recorded("claude-turn2-1")
    body = copy.deepcopy(source["body"])
    first, system, *_, question = body["messages"]
    question = copy.deepcopy(question)
    for block in question["content"]:
        block.pop("cache_control", None)          # only the last user block carries it
    body["messages"] = [
        first, system,
        _thinking("The user wants the files in this folder listed and explained. I will run "
                  "ls -la in the working directory, then describe each file."),
        _said("I'll list the files in this folder."),
        _use(BASH_ID, "Bash", {"command": "ls -la", "description": "List files in the folder"}),
        _result(BASH_ID, LISTING),
        _thinking("Two files besides .git: README.md and hello.py, a Python script."),
        _said("The folder holds `README.md` (the project's description) and `hello.py` (a "
              "Python script), with the `.git` folder of the repository."),
        question,
        _thinking("I should read hello.py to see what it prints."),
        _use(READ_ID, "Read", {"file_path": f"{CLAUDE_REPO}/hello.py"}),
        _result(READ_ID, "     1\t" + HELLO),
        _said("`hello.py` prints `hello, world`."),
        {"role": "user", "content": [{"type": "text", "text": "Add a test for hello.py.",
                                      "cache_control": {"type": "ephemeral"}}]}]
    body["context_management"] = copy.deepcopy(CLAUDE_EDITS)
    return {"note": NOTE.format(source="claude-turn2-1"), "path": source["path"],
            "headers": source["headers"], "body": body}


CALL_ID = "call_8b1f0c2e5d7a4b39a6c1e0f2"
REASONED = ("The user asks what hello.py prints. I will read it with cat.",
            "hello.py prints hello, world; I can answer.")


def _sealed(text: str) -> str:
    from server.openai import sealing
    saved = sealing.configuration()
    sealing.configure(REASONING_KEY, None)
    try:
        return sealing.seal(text)
    finally:
        sealing.configure(*saved)


def codex_turn3() -> dict:
    """Codex's third turn: its recorded turn 2's input, then the answer to turn 2's question
    (reasoning, an exec_command call that cats hello.py, its output, reasoning, the answer) and a
    new question."""
    source = recorded("codex-turn2-1")
    body = copy.deepcopy(source["body"])
    arguments = json.dumps({"cmd": "cat hello.py", "workdir": CODEX_REPO})
    output = ("Chunk ID: 3f9a1c\nWall time: 0.0512 seconds\nProcess exited with code 0\n"
              f"Original token count: 6\nOutput:\n{HELLO}")
    body["input"] += [
        {"type": "reasoning", "id": "rs_4d0e9c1b7a2f4e63b8d5c0a1f9e2b7c4", "summary": [],
         "encrypted_content": _sealed(REASONED[0])},
        {"type": "function_call", "id": "fc_" + CALL_ID.removeprefix("call_"),
         "name": "exec_command", "arguments": arguments, "call_id": CALL_ID},
        {"type": "function_call_output", "call_id": CALL_ID, "output": output},
        {"type": "reasoning", "id": "rs_9a7c3e5f1b2d4c68a0e4f6b8d1c3a5e7", "summary": [],
         "encrypted_content": _sealed(REASONED[1])},
        {"type": "message", "status": "completed", "id": "msg_2e6b0d4f8a1c4e3b9d7f5a2c6e0b8d41",
         "role": "assistant", "content": [{"type": "output_text",
                                           "text": "`hello.py` prints `hello, world`.",
                                           "annotations": [], "logprobs": []}]},
        {"type": "message", "id": "msg_01a2225a-03c4-7d21-9e8b-5f3a6c1d2e4b", "role": "user",
         "content": [{"type": "input_text", "text": "Add a test for hello.py."}]}]
    return {"note": NOTE.format(source="codex-turn2-1"), "path": source["path"],
            "headers": source["headers"], "body": body}


BUILT = {"claude-turn3-built": claude_turn3, "codex-turn3-built": codex_turn3}


def main() -> None:
    for name, build in BUILT.items():
        (FIXTURES / f"{name}.json").write_text(json.dumps(build(), indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
