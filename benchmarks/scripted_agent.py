"""An agent session through Anthropic's Messages API (/v1/messages), as Claude Code and agents
built on the anthropic SDK drive a server: a ~1,500-token system prompt with tool definitions,
resent on every turn; each turn adds the assistant's tool call, the tool's result and a new
question. Per turn: input tokens, the tokens read from the prefix cache, TTFT and total time,
at 1 and 4 concurrent sessions, for our server and llama.cpp's llama-server (its /v1/messages,
started with --jinja from the same llama.cpp build), or ours alone (--peer none).

    python -m benchmarks.scripted_agent                         # ours and llama-server, 1 and 4 sessions
    python -m benchmarks.scripted_agent --peer none --sessions 1 --turns 2      # ours alone, a smoke run

The history is scripted, so both servers get the same prompts: the assistant turn of turn k is
a fixed tool call, not the answer the server generated at turn k - 1 (which is read, timed and
dropped). The sessions of one concurrency level share the system prompt and tools (one agent,
several tasks); each level has a system prompt of its own, so one level does not hit what the
previous level left in the cache. Targets: from the second turn on, at least 90 % of the input
tokens read from the cache; TTFT per turn at most llama-server's at 1 session and at most half of
it at 4 sessions. docs/benchmarks.md has the command and what the report holds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import NotLoopback, check_loopback, first_model, make_client
from benchmarks.harness.launch import (
    find_peer_bin,
    launched,
    llama_server,
    our_server,
    parse_env,
    stop_servers_on_sigterm,
)
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import parser

MESSAGES = "/v1/messages"
TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository and return its text.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "path from the repository root"},
         "offset": {"type": "integer", "description": "first line to read"},
         "limit": {"type": "integer", "description": "how many lines"}}, "required": ["path"]}},
    {"name": "write_file", "description": "Write text to a file, replacing what it held.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string"}, "content": {"type": "string"}},
         "required": ["path", "content"]}},
    {"name": "list_dir", "description": "List the entries of a folder.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                      "required": ["path"]}},
    {"name": "grep", "description": "Search the repository for a regular expression.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string"}, "path": {"type": "string"},
         "ignore_case": {"type": "boolean"}}, "required": ["pattern"]}},
    {"name": "run_command", "description": "Run a shell command in the repository and return "
     "its output and exit status.",
     "input_schema": {"type": "object", "properties": {
         "command": {"type": "string"}, "timeout_s": {"type": "number"}},
         "required": ["command"]}},
    {"name": "edit_file", "description": "Replace one exact piece of a file's text by another.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
         "required": ["path", "old", "new"]}},
]
TOOLS_TOKENS = 450   # about what the tools add to the prompt (rendered as text)
RULES = ("You are a coding agent working in a software repository. Use the tools to read, "
         "search and change files and to run commands; call one tool at a time and wait for "
         "its result. Keep answers short. Project notes follow.\n\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.scripted_agent", __doc__, "model", "threads", "n_ctx", "our_env", "peer_bin",
               "parallel", "output_len", "seed", "quick", "request_timeout", "result_file",
               n_ctx=4096, parallel={"default": 4, "help": "llama-server -np (slots)"},
               output_len={"default": 32, "help": "max_tokens of each turn"})
    p.add_argument("--peer", default="llama-server",
                   help="llama-server (started here), a loopback URL, or none")
    p.add_argument("--ours", default="ours", help="ours (started here) or a loopback URL")
    p.add_argument("--sessions", default="1,4", help="concurrent sessions, one run per value")
    p.add_argument("--turns", type=int, default=10, help="turns of each session")
    p.add_argument("--system-len", type=int, default=1500,
                   help="tokens of the system prompt with the tools")
    p.add_argument("--result-len", type=int, default=60, help="tokens of each tool result")
    p.add_argument("--question-len", type=int, default=16, help="tokens of each question")
    p.add_argument("--tools-in-system", action="store_true",
                   help="write the tool definitions into the system prompt as text and send no "
                        "`tools`: a server whose chat template has no tool support may leave "
                        "`tools` out of the prompt (llama-server does), so only this way both "
                        "servers compute the same prompt")
    p.add_argument("--plain-history", action="store_true",
                   help="write the earlier turns' tool calls and results as plain text messages "
                        "rather than tool_use / tool_result blocks, which each server renders "
                        "its own way when the chat template has no tool support")
    p.add_argument("--same-prompt", action="store_true",
                   help="--tools-in-system and --plain-history: both servers compute the same "
                        "prompt, token for token, on every turn (the table shows both inputs)")
    args = p.parse_args(argv)
    if args.same_prompt:
        args.tools_in_system = args.plain_history = True
    args.levels = [int(x) for x in args.sessions.split(",") if x.strip()]
    if args.quick:
        args.levels, args.turns, args.system_len, args.output_len = [1], 2, 600, 4
    return args


# ---- the sessions ------------------------------------------------------------------------------
@dataclass
class Session:
    system: str
    tasks: list[str]                 # the first question, then one per turn
    results: list[str]               # the tool result that comes with each later turn
    calls: list[dict] = field(default_factory=list)   # the scripted tool call of each turn

    def messages(self, turn: int, plain: bool = False) -> list[dict]:
        """The history sent at `turn` (0-based): the task, then per earlier turn the assistant's
        tool call and a user turn with its result and the next question; `plain`: the call and
        the result as text."""
        out = [{"role": "user", "content": self.tasks[0]}]
        for k in range(1, turn + 1):
            call, result, task = self.calls[k - 1], self.results[k - 1], self.tasks[k]
            if plain:
                out.append({"role": "assistant", "content": json.dumps(
                    {"tool": call["name"], "input": call["input"]}, ensure_ascii=False)})
                out.append({"role": "user", "content": f"Tool result:\n{result}\n\n{task}"})
                continue
            out.append({"role": "assistant", "content": [{"type": "tool_use", **call}]})
            out.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": result},
                {"type": "text", "text": task}]})
        return out


def build_sessions(n: int, args, level: int) -> list[Session]:
    rng = random.Random(f"agent:{args.seed}:{level}")
    system = RULES + ds.random_text(rng, max(1, args.system_len - TOOLS_TOKENS - 40))
    sessions = []
    for s in range(n):
        tasks = [ds.question(rng, args.question_len) for _ in range(args.turns)]
        results = [ds.random_text(rng, args.result_len) for _ in range(args.turns)]
        session = Session(system, tasks, results)
        for k in range(args.turns):
            tool = TOOLS[(s + k) % len(TOOLS)]
            arg = {name: ds.random_words(rng, 2) for name in tool["input_schema"]["required"]}
            session.calls.append({"id": f"toolu_{level}_{s}_{k}", "name": tool["name"],
                                  "input": arg})
        sessions.append(session)
    return sessions


# ---- one turn, timed ---------------------------------------------------------------------------
@dataclass
class Turn:
    session: int
    turn: int
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    total_s: float = 0.0
    input_tokens: int | None = None      # the whole prompt: uncached + written + read
    cached_tokens: int | None = None     # read from the prefix cache (None: not reported)
    output_tokens: int | None = None
    stop_reason: str | None = None


def _usage(turn: Turn, usage: dict) -> None:
    parts = [usage.get(k) for k in ("input_tokens", "cache_creation_input_tokens",
                                    "cache_read_input_tokens")]
    if parts[0] is not None:
        turn.input_tokens = sum(p or 0 for p in parts)
    if usage.get("cache_read_input_tokens") is not None:
        turn.cached_tokens = usage["cache_read_input_tokens"]
    if usage.get("output_tokens") is not None:
        turn.output_tokens = usage["output_tokens"]


async def one_turn(client, base: str, body: dict, turn: Turn, timeout: float) -> Turn:
    """POST one streamed /v1/messages request: TTFT is the first content delta (text, tool
    input or thinking), the total ends at message_stop; usage from message_start and the
    cumulative message_delta."""
    start = time.perf_counter()
    event = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", base + MESSAGES, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    turn.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return turn
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    data = json.loads(line[5:])
                    kind = data.get("type", event)
                    if kind == "message_start":
                        _usage(turn, data["message"].get("usage") or {})
                    elif kind == "content_block_delta" and turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - start
                    elif kind == "message_delta":
                        _usage(turn, data.get("usage") or {})
                        turn.stop_reason = (data.get("delta") or {}).get("stop_reason")
                    elif kind == "error":
                        turn.error = f"stream error: {json.dumps(data.get('error'))[:300]}"
                        return turn
                    elif kind == "message_stop":
                        break
    except TimeoutError:
        turn.error = f"timed out after {timeout:.0f} s"
    except Exception as exc:   # a failed turn is reported, the run goes on
        turn.error = f"{type(exc).__name__}: {exc}"
    finally:
        turn.total_s = time.perf_counter() - start
    if not turn.error and turn.stop_reason is None:
        turn.error = "stream ended without a stop_reason"
    turn.ok = not turn.error
    return turn


def tools_fields(system: str, in_system: bool) -> dict:
    """The system prompt and the tools: as the API's `tools`, or as text in the system prompt."""
    if not in_system:
        return {"system": system, "tools": TOOLS}
    lines = [json.dumps(t, ensure_ascii=False) for t in TOOLS]
    return {"system": system + "\n\nTools (call one as a tool_use block):\n" + "\n".join(lines)}


async def run_sessions(base: str, model: str, sessions: list[Session], args) -> list[Turn]:
    """Every session at once, each turn after the previous one's answer."""
    async with make_client(len(sessions), args.request_timeout) as client:
        async def session(i: int, s: Session) -> list[Turn]:
            turns = []
            for k in range(args.turns):
                body = {"model": model, "max_tokens": args.output_len, "temperature": 0,
                        "stream": True, **tools_fields(s.system, args.tools_in_system),
                        "messages": s.messages(k, args.plain_history)}
                t = await one_turn(client, base, body, Turn(i, k + 1), args.request_timeout)
                turns.append(t)
                if not t.ok:
                    break
            return turns
        per_session = await asyncio.gather(*(session(i, s) for i, s in enumerate(sessions)))
    return [t for turns in per_session for t in turns]


# ---- the report --------------------------------------------------------------------------------
def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def per_turn(turns: list[Turn], n_turns: int) -> list[dict]:
    rows = []
    for k in range(1, n_turns + 1):
        done = [t for t in turns if t.turn == k and t.ok]
        inputs = sum(t.input_tokens or 0 for t in done)
        cached = [t.cached_tokens for t in done]
        rows.append({
            "turn": k, "completed": len(done),
            "failed": len([t for t in turns if t.turn == k and not t.ok]),
            "input_tokens": _median([t.input_tokens for t in done]),
            "cached_tokens": _median(cached),
            "cached_fraction": (sum(c for c in cached if c is not None) / inputs
                                if inputs and all(c is not None for c in cached) else None),
            "ttft_s": _median([t.ttft_s for t in done]),
            "total_s": _median([t.total_s for t in done])})
    return rows


def _f(value, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def level_table(level: int, rows: dict[str, list[dict]]) -> str:
    names = list(rows)
    head = f"{'turn':>4} {'input':>6} {'cached':>7}"
    for name in names:
        head += f" {'TTFT ' + name[:10]:>17} {'total ' + name[:10]:>17}"
    if len(names) == 2:
        head += f" {'input ' + names[1][:10]:>17} {'TTFT ratio':>10}"
    lines = []
    ours = rows[names[0]]
    for i, row in enumerate(ours):
        line = (f"{row['turn']:>4} {_f(row['input_tokens'], '{:.0f}'):>6} "
                f"{_f(row['cached_fraction'], '{:.0f}%', 100):>7}")
        for name in names:
            r = rows[name][i]
            line += f" {_f(r['ttft_s'], '{:.0f} ms', 1000):>17} {_f(r['total_s'], '{:.0f} ms', 1000):>17}"
        if len(names) == 2:
            peer = rows[names[1]][i]
            a, b = ours[i]["ttft_s"], peer["ttft_s"]
            line += (f" {_f(peer['input_tokens'], '{:.0f}'):>17}"
                     f" {_f(a / b if a and b else None, '{:.2f}x'):>10}")
        lines.append(line)
    title = f"{level} session{'s' if level > 1 else ''} (medians over sessions; cached: {names[0]})"
    return f"{title}\n" + ruled(head, lines)


def targets(level: int, rows: dict[str, list[dict]]) -> list[str]:
    ours = next(iter(rows.values()))
    later = [r["cached_fraction"] for r in ours[1:]]
    out = []
    if later and all(f is not None for f in later):
        worst = min(later)
        out.append(f"{level} session(s): from turn 2 on, cached >= 90% of input: lowest "
                   f"{worst * 100:.0f}% -> {'met' if worst >= 0.9 else 'MISSED'}")
    if len(rows) == 2:
        peer = list(rows.values())[1]
        ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(ours, peer) if a["ttft_s"] and b["ttft_s"]]
        bound = 1.0 if level == 1 else 0.5
        if ratios:
            worst = max(ratios)
            out.append(f"{level} session(s): TTFT per turn <= {bound:g}x the peer's: highest "
                       f"{worst:.2f}x -> {'met' if worst <= bound else 'MISSED'}")
    return out


# ---- servers -----------------------------------------------------------------------------------
def servers(stack: ExitStack, args) -> dict[str, str]:
    """Base URLs by name: ours, then the peer (none: ours alone)."""
    try:
        return _servers(stack, args)
    except NotLoopback as exc:
        raise SystemExit(str(exc)) from None


def _servers(stack: ExitStack, args) -> dict[str, str]:
    out = {}
    if args.ours == "ours":
        spec = our_server(args.model, args.threads, n_ctx=args.n_ctx, env=parse_env(args.our_env))
        out["pagedllama"] = stack.enter_context(launched(spec))
    else:
        out["pagedllama"] = check_loopback(args.ours)
    if args.peer == "none":
        return out
    if args.peer != "llama-server":
        out["peer"] = check_loopback(args.peer)
        return out
    binary = find_peer_bin(args.peer_bin)
    if binary is None:
        raise SystemExit("llama-server not found (scripts/build_llama_server.sh builds it; "
                         "--peer none runs ours alone)")
    spec = llama_server(binary, args.model, args.threads, args.parallel, args.n_ctx,
                        extra=["--jinja"])
    out["llama-server"] = stack.enter_context(launched(spec))
    return out


def run(args) -> dict:
    result: dict = {"config": {k: v for k, v in vars(args).items()}, "levels": {}}
    with ExitStack() as stack:
        bases = servers(stack, args)
        for level in args.levels:
            sessions = build_sessions(level, args, level)
            rows, raw = {}, {}
            for name, base in bases.items():
                model = first_model(base)
                turns = asyncio.run(run_sessions(base, model, sessions, args))
                raw[name] = [vars(t) for t in turns]
                rows[name] = per_turn(turns, args.turns)
            result["levels"][str(level)] = {"per_turn": rows, "turns": raw,
                                            "targets": targets(level, rows)}
            result["levels"][str(level)]["table"] = level_table(level, rows)
    return result


def main(argv: list[str] | None = None) -> int:
    stop_servers_on_sigterm()
    args = parse_args(argv)
    result = run(args)
    parts = []
    for level in result["levels"].values():
        parts += [level["table"], *level["targets"], ""]
    failed = [t for level in result["levels"].values() for turns in level["turns"].values()
              for t in turns if not t["ok"]]
    if failed:
        parts.append(f"{len(failed)} turn(s) failed; first: {failed[0]['error']}")
    finish("\n".join(parts), result, args.result_file)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
