"""Real agent CLIs against the server: Claude Code (`/v1/messages`), Codex CLI (`/v1/responses`)
and opencode (`/v1/chat/completions`), installed from npm at pinned versions (`make agents`),
each run for a few turns in a small scratch repository, as a user runs them. Between the CLI and
the server a recording proxy times every request and reads its usage, so each line says what the
agent sent and what the prefix cache did with it:

    python -m benchmarks.agents                              # all three, 3 turns, our server
    python -m benchmarks.agents --agents claude --turns 2 --url http://127.0.0.1:8000
    python -m benchmarks.agents --record tests/fixtures/agents   # keep the request bodies
    python -m benchmarks.agents --new-session                # session A, a restart, session B
    python -m benchmarks.agents --new-session --cold         # ... and B's request cold, again

`--new-session` runs what a user meets when starting an agent again: for each agent, session A
in one folder, the server restarted (the prefix cache's disk tier kept), then session B in
another folder with the same home; per request it prints the prompt, the tokens read from the
cache, the tier they came from (`cached_from`, from the server's request log) and TTFT, and
compares session B's first request with session A's, which was computed cold; `--cold` also
sends B's first request again to a server on an empty cache, for B's own cold time.

Per request: the agent, the turn, the route, the prompt tokens, those read from the cache, TTFT
(time to the first answer event), total time and the HTTP status; per turn, the CLI's exit code.
Without --url it starts our server with a context large enough for the agents' prompts
(SmolLM2 is trained to 8,192 tokens: PAGEDLLAMA_N_CTX_BEYOND_TRAINED is set for it; a model
with a longer trained context, such as Gemma 3 270M with `--chat-template gemma`, needs none).
docs/agents.md: how to point each agent at the server, and the figures measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from benchmarks.harness.launch import (
    find_peer_bin,
    free_port,
    launched,
    llama_server,
    our_server,
    parse_env,
)
from server.config import DEFAULT_MODEL, chat_template_path
from server.openai.tool_fields import responses_tools

ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = ROOT / ".agents"       # make agents installs the CLIs here (ignored by git)
PINS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0",
        "opencode": "opencode-ai@1.18.33"}
TURNS = ["List the files in this folder and say what each one is for.",
         "What does hello.py print when it runs? Read it to find out.",
         "Add a line saying 'checked' to the end of notes.txt."]
CONTENT_EVENTS = ("content_block_delta", "response.output_text.delta",
                  "response.function_call_arguments.delta", "response.reasoning_text.delta")


# ---- the recording proxy -------------------------------------------------------------------------
@dataclass
class Exchange:
    agent: str
    turn: int
    method: str
    path: str
    status: int = 0
    prompt: int | None = None
    cached: int | None = None
    ttft: float | None = None
    total: float = 0.0
    body: dict | None = None
    headers: dict = field(default_factory=dict)
    session: str = ""                 # --new-session: "A" or "B"
    cached_from: str | None = None    # the tier the cached tokens came from (the server's log)


@dataclass
class Recorder:
    upstream: str
    agent: str = ""
    turn: int = 0
    session: str = ""
    exchanges: list[Exchange] = field(default_factory=list)
    max_tokens: int | None = None   # bodies forwarded with at most this many output tokens
    flatten_tools: bool = False     # Responses tools sent as the functions our server offers


LIMITS = ("max_tokens", "max_output_tokens", "max_completion_tokens")


def capped(body: dict, limit: int | None) -> dict:
    """The body with its output limit at most `limit` (set where it asks for none): for a server
    that does not bound what a request asks (llama-server lets a request's max_tokens win over
    its own -n), so that both servers of a comparison compute the same answers' lengths."""
    if limit is None:
        return body
    out = {k: (min(v, limit) if k in LIMITS and isinstance(v, int) else v)
           for k, v in body.items()}
    if not any(k in out for k in LIMITS):
        out["max_output_tokens" if "input" in out else "max_tokens"] = limit
    return out


def flattened(body: dict) -> dict:
    """A Responses body whose tools are the function tools this server offers the model for
    them (a namespace's functions, custom tools as one-string functions; hosted tools left out),
    for llama-server, whose /v1/responses skips every tool that is not a function: without this
    its prompt lacks Codex's namespaced and custom tools and is not the same prompt."""
    if "input" not in body or not isinstance(body.get("tools"), list):
        return body
    offered = responses_tools(body["tools"], body.get("tool_choice"),
                              body.get("parallel_tool_calls")).use.functions
    tools = [{"type": "function", "name": f.name, "description": f.description,
              "parameters": f.parameters, "strict": False} for f in offered]
    return {**body, "tools": tools}


def _usage(event: dict, ex: Exchange) -> None:
    """Prompt and cached tokens from a usage object of any of the three APIs."""
    usage = (event.get("usage") or (event.get("message") or {}).get("usage")
             or (event.get("response") or {}).get("usage"))
    if not isinstance(usage, dict):
        return
    if "cache_read_input_tokens" in usage:          # Anthropic
        read = usage.get("cache_read_input_tokens") or 0
        ex.cached = read
        ex.prompt = (usage.get("input_tokens") or 0) + read + \
            (usage.get("cache_creation_input_tokens") or 0)
    elif "input_tokens_details" in usage:           # Responses
        ex.prompt, ex.cached = usage.get("input_tokens"), \
            (usage.get("input_tokens_details") or {}).get("cached_tokens")
    elif "prompt_tokens" in usage:                  # chat completions
        ex.prompt = usage.get("prompt_tokens")
        ex.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _is_content(event: dict) -> bool:
    if event.get("type") in CONTENT_EVENTS:
        return True
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


def proxy_app(rec: Recorder) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=rec.upstream, timeout=None)

    @app.api_route("/{path:path}", methods=["GET", "POST", "HEAD", "DELETE", "PUT"])
    async def forward(path: str, http: HTTPRequest):
        raw = await http.body()
        query = http.url.query             # Claude Code posts to /v1/messages?beta=true
        ex = Exchange(rec.agent, rec.turn, http.method, "/" + path + (f"?{query}" if query else ""),
                      session=rec.session)
        try:
            ex.body = json.loads(raw) if raw else None
        except ValueError:
            ex.body = None
        ex.headers = {k: v for k, v in http.headers.items()
                      if k.startswith(("anthropic-", "x-claude", "x-stainless-lang", "originator",
                                       "session_id", "user-agent"))}
        rec.exchanges.append(ex)
        headers = {k: v for k, v in http.headers.items() if k not in ("host", "content-length")}
        if isinstance(ex.body, dict) and http.method == "POST" and (
                rec.max_tokens is not None or rec.flatten_tools):
            sent = capped(ex.body, rec.max_tokens)
            raw = json.dumps(flattened(sent) if rec.flatten_tools else sent).encode()
        t0 = time.monotonic()
        req = client.build_request(http.method, "/" + path, params=http.query_params,
                                   content=raw, headers=headers)
        resp = await client.send(req, stream=True)
        ex.status = resp.status_code

        async def body():
            buffer = b""
            try:
                async for chunk in resp.aiter_raw():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        _read_line(line, ex, t0)
                    yield chunk
                _read_line(buffer, ex, t0)
            finally:
                ex.total = time.monotonic() - t0
                await resp.aclose()

        out_headers = {k: v for k, v in resp.headers.items()
                       if k not in ("content-length", "content-encoding", "transfer-encoding")}
        return StreamingResponse(body(), status_code=resp.status_code, headers=out_headers)

    return app


def _read_line(line: bytes, ex: Exchange, t0: float) -> None:
    text = line.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    if not text.startswith(b"{"):
        return
    try:
        event = json.loads(text)
    except ValueError:
        return
    if ex.ttft is None and (_is_content(event) or "content" in event and "usage" in event):
        ex.ttft = time.monotonic() - t0
    _usage(event, ex)


class Proxy:
    def __init__(self, rec: Recorder):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(proxy_app(rec), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# ---- the agents ----------------------------------------------------------------------------------
def agent_bin(name: str) -> Path:
    binary = AGENTS_DIR / "node_modules" / ".bin" / name
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run `make agents` (npm install of {PINS})")
    return binary


def scratch_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "hello.py").write_text('print("hello from the scratch repository")\n')
    (repo / "notes.txt").write_text("Notes\n")
    (repo / "README.md").write_text("# scratch\nA small repository an agent works in.\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=False)
    return repo


def command(agent: str, base: str, model: str, home: Path, turn: int,
            prompt: str) -> tuple[list[str], dict[str, str]]:
    """The CLI's command line and environment for one turn, with nothing set that changes what
    it sends (its answers are bounded by the server's PAGEDLLAMA_MAX_OUTPUT, not by asking
    the CLI for a smaller max_tokens)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "CI": "1"}
    if agent == "claude":
        env.update({"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "unused",
                    "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
                    "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                    "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "DISABLE_TELEMETRY": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "DISABLE_AUTOUPDATER": "1", "API_TIMEOUT_MS": "3600000"})
        cmd = [str(agent_bin("claude")), "-p", prompt, "--max-turns", "3"]
        return cmd + (["--continue"] if turn > 1 else []), env
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\n'
            f'name = "pagedllama"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
            'env_key = "PAGEDLLAMA_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
            'stream_idle_timeout_ms = 3600000\n')
        env.update({"CODEX_HOME": str(codex_home), "PAGEDLLAMA_KEY": "unused"})
        head = [str(agent_bin("codex")), "exec"] + (["resume", "--last"] if turn > 1 else [])
        return head + ["--skip-git-repo-check", prompt], env
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": f"local/{model}",
        "small_model": f"local/{model}", "autoupdate": False, "share": "disabled",
        "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "pagedllama",
                               "options": {"baseURL": f"{base}/v1", "apiKey": "unused",
                                           "timeout": False},
                               "models": {model: {"name": model}}}}}))
    env.update({"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"})
    cmd = [str(agent_bin("opencode")), "run"] + (["--continue"] if turn > 1 else [])
    return cmd + [prompt], env


@dataclass
class TurnResult:
    agent: str
    turn: int
    exit_code: int
    seconds: float
    output: str


def run_agent(agent: str, rec: Recorder, base: str, model: str, turns: int,
              timeout: float) -> list[TurnResult]:
    # one fixed place per agent, made anew: the prompt names the working directory, so a run
    # in the place of the last one finds its prompt cached, as a user's next session does
    place = Path(tempfile.gettempdir()) / "pagedllama-agents" / agent
    shutil.rmtree(place, ignore_errors=True)
    try:
        home = place / "home"
        home.mkdir(parents=True)
        return run_session(agent, rec, base, model, turns, timeout, home, scratch_repo(place))
    finally:
        shutil.rmtree(place, ignore_errors=True)


def run_session(agent: str, rec: Recorder, base: str, model: str, turns: int, timeout: float,
                home: Path, repo: Path) -> list[TurnResult]:
    """`turns` turns of one agent session in `repo`, with `home` as its home directory."""
    results = []
    for turn in range(1, turns + 1):
        rec.agent, rec.turn = agent, turn
        cmd, env = command(agent, base, model, home, turn, TURNS[(turn - 1) % len(TURNS)])
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
            code, output = done.returncode, (done.stdout + done.stderr)
        except subprocess.TimeoutExpired as exc:
            code, output = 124, str(exc.stdout or "")
        results.append(TurnResult(agent, turn, code, time.monotonic() - t0, output.strip()))
    return results


# ---- a new session after a restart -------------------------------------------------------------
LOG_LINE = re.compile(r"POST (\S+) \w+ model=\S+ prompt=(\d+) cached=(\d+)"
                      r"(?: cached_from=(\w+))?")


def tiers_from_log(log: str, exchanges: list[Exchange]) -> None:
    """Each exchange's `cached_from`, from the server's request log lines (matched by route,
    prompt and cached tokens, in order)."""
    lines = [(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) or "kv")
             for m in LOG_LINE.finditer(log)]
    for ex in exchanges:
        for i, (path, prompt, cached, tier) in enumerate(lines):
            if path == ex.path.split("?")[0] and prompt == ex.prompt and cached == ex.cached:
                ex.cached_from = tier if cached else None
                del lines[i]
                break


def new_sessions(args, agents: list[str], ap) -> tuple[list[Exchange], list[TurnResult]]:
    """Per agent: session A in one folder, a restart, session B in another folder (same home),
    on our server with a disk tier of its own for the run."""
    cache = Path(tempfile.mkdtemp(prefix="agents-prefix-"))
    args.env = list(args.env) + [f"PAGEDLLAMA_CACHE_DIR={cache}"]
    root = Path(tempfile.mkdtemp(prefix="pagedllama-sessions-"))
    exchanges: list[Exchange] = []
    turns: list[TurnResult] = []
    try:
        for agent in agents:
            home = root / agent / "home"
            home.mkdir(parents=True)
            for label, folder in (("A", "project-a"), ("B", "project-b")):
                repo = scratch_repo(root / agent / folder)
                logs = tempfile.mkdtemp(prefix="agents-log-")
                with ExitStack() as stack:
                    url = stack.enter_context(_launch("ours", args, ap, logs))
                    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                    rec = Recorder(url, session=label)
                    base = stack.enter_context(Proxy(rec))
                    turns += run_session(agent, rec, base, model, args.turns, args.timeout,
                                         home, repo)
                tiers_from_log("".join(p.read_text(errors="replace")
                                       for p in Path(logs).glob("*.log")), rec.exchanges)
                exchanges += rec.exchanges
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return exchanges, turns


def cold_replays(args, ap, exchanges: list[Exchange], agents: list[str]) -> dict[str, Exchange]:
    """Per agent, session B's main request sent again, as the agent sent it, to our server
    started on an empty disk tier: the same prompt computed cold, the time B's first request
    would have taken without the cache (session A's first request is a different prompt, and
    an agent that gives up on a slow first request and retries it leaves A without a cold
    time)."""
    out: dict[str, Exchange] = {}
    for agent in agents:
        b = main_request([e for e in exchanges if e.agent == agent and e.session == "B"])
        if b is None or b.body is None:
            continue
        cache = Path(tempfile.mkdtemp(prefix="agents-cold-"))
        env = [e for e in args.env if not e.startswith("PAGEDLLAMA_CACHE_DIR=")]
        try:
            with _launch("ours", argparse.Namespace(**{**vars(args), "env": env + [
                    f"PAGEDLLAMA_CACHE_DIR={cache}"]}), ap) as url:
                ex = Exchange(agent, b.turn, "POST", b.path, session="cold")
                t0 = time.monotonic()
                with httpx.stream("POST", url + b.path, json=b.body, headers=b.headers,
                                  timeout=None) as resp:
                    ex.status = resp.status_code
                    for line in resp.iter_lines():
                        _read_line(line.encode(), ex, t0)
                ex.total = time.monotonic() - t0
                out[agent] = ex
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return out


def report_sessions(exchanges: list[Exchange], agents: list[str],
                    cold: dict[str, Exchange] | None = None) -> dict:
    print(f"{'agent':9} {'sess':>4} {'turn':>4} {'route':22} {'status':>6} {'prompt':>7} "
          f"{'cached':>7} {'cached%':>7} {'from':>5} {'ttft s':>8}")
    for ex in exchanges:
        if ex.method != "POST":
            continue
        share = (f"{100 * ex.cached / ex.prompt:.1f}" if ex.prompt and ex.cached is not None
                 else "-")
        print(f"{ex.agent:9} {ex.session:>4} {ex.turn:>4} {ex.path[:22]:22} {ex.status:>6} "
              f"{_n(ex.prompt):>7} {_n(ex.cached):>7} {share:>7} {ex.cached_from or '-':>5} "
              f"{_s(ex.ttft):>8}")
    summary: dict = {"agents": []}
    print("\nEach session's main request (its first with the full prompt), B against A (cold):")
    for agent in agents:
        a, b = (main_request([e for e in exchanges if e.agent == agent and e.session == label])
                for label in ("A", "B"))
        if a is None or b is None or not b.prompt:
            print(f"  {agent}: no answered main request in both sessions")
            continue
        line = {"agent": agent, "prompt_a": a.prompt, "prompt_b": b.prompt,
                "cached_b": b.cached, "cached_pct_b": round(100 * (b.cached or 0) / b.prompt, 1),
                "cached_from_b": b.cached_from, "ttft_a_s": _r(a.ttft), "ttft_b_s": _r(b.ttft),
                "ttft_ratio": _r(b.ttft / a.ttft if a.ttft and b.ttft else None)}
        summary["agents"].append(line)
        print(f"  {agent:9} B: {b.prompt} tokens, {line['cached_pct_b']} % from the cache "
              f"({b.cached_from or '-'}), TTFT {_s(b.ttft)} s against A's {_s(a.ttft)} s "
              f"({a.prompt} tokens, cold): {line['ttft_ratio']}x")
        c = (cold or {}).get(agent)
        if c is not None:
            line.update({"ttft_b_cold_s": _r(c.ttft), "prompt_b_cold": c.prompt,
                         "cached_b_cold": c.cached,
                         "ttft_ratio_cold": _r(b.ttft / c.ttft if c.ttft and b.ttft else None)})
            print(f"  {'':9} B's request again on an empty cache: {_n(c.prompt)} tokens, "
                  f"{_n(c.cached)} cached, TTFT {_s(c.ttft)} s: B took "
                  f"{line['ttft_ratio_cold']}x its cold time")
    return summary


def main_request(exchanges: list[Exchange]) -> Exchange | None:
    """A session's first answered request whose prompt is at least 90 % of its longest (a
    title or quota request before it is shorter; the requests after it grow by a turn)."""
    answered = [e for e in exchanges if e.method == "POST" and e.prompt]
    longest = max((e.prompt or 0 for e in answered), default=0)
    return next((e for e in answered if (e.prompt or 0) >= 0.9 * longest), None)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


# ---- the report ----------------------------------------------------------------------------------
def report(exchanges: list[Exchange], turns: list[TurnResult]) -> dict:
    print(f"{'agent':9} {'turn':>4} {'route':24} {'status':>6} {'prompt':>7} {'cached':>7} "
          f"{'cached%':>7} {'ttft s':>7} {'total s':>8}")
    for ex in exchanges:
        share = (f"{100 * ex.cached / ex.prompt:.1f}" if ex.prompt and ex.cached is not None
                 else "-")
        print(f"{ex.agent:9} {ex.turn:>4} {ex.path[:24]:24} {ex.status:>6} "
              f"{_n(ex.prompt):>7} {_n(ex.cached):>7} {share:>7} {_s(ex.ttft):>7} "
              f"{ex.total:>8.2f}")
    print()
    summary: dict = {"turns": []}
    for t in turns:
        mine = [e for e in exchanges if e.agent == t.agent and e.turn == t.turn
                and e.prompt is not None]
        rates = [e.cached / e.prompt for e in mine if e.prompt and e.cached is not None]
        line = {"agent": t.agent, "turn": t.turn, "exit": t.exit_code,
                "seconds": round(t.seconds, 1), "requests": len(mine),
                "status_4xx": sum(1 for e in exchanges if e.agent == t.agent
                                  and e.turn == t.turn and 400 <= e.status < 500),
                "min_cached_pct": round(100 * min(rates), 1) if rates else None,
                "ttft_max_s": round(max((e.ttft or 0) for e in mine), 2) if mine else None}
        summary["turns"].append(line)
        print(f"{t.agent} turn {t.turn}: exit {t.exit_code} in {t.seconds:.1f} s, "
              f"{line['requests']} requests, 4xx {line['status_4xx']}, lowest cached share "
              f"{line['min_cached_pct']} %, largest TTFT {line['ttft_max_s']} s")
        if t.exit_code != 0:
            print("   output: " + t.output[-600:].replace("\n", "\n   "))
    later = [e.cached / e.prompt for e in exchanges if e.turn > 1 and e.prompt and
             e.cached is not None]
    if later:
        summary["later_turns_cached_median_pct"] = round(100 * statistics.median(later), 1)
        print(f"turns >= 2: median {summary['later_turns_cached_median_pct']} % of the prompt "
              "from the cache")
    return summary


def _n(v) -> str:
    return "-" if v is None else str(v)


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def record(exchanges: list[Exchange], folder: Path) -> None:
    """The request bodies as fixtures: <agent>-turn<k>-<i>.json with the route and headers."""
    folder.mkdir(parents=True, exist_ok=True)
    counts: dict[tuple, int] = {}
    for ex in exchanges:
        if ex.method != "POST" or ex.body is None:
            continue
        key = (ex.agent, ex.turn)
        counts[key] = counts.get(key, 0) + 1
        name = f"{ex.agent}-turn{ex.turn}-{counts[key]}.json"
        (folder / name).write_text(json.dumps({"path": ex.path, "headers": ex.headers,
                                               "body": ex.body}, indent=1, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="claude,codex,opencode")
    ap.add_argument("--turns", type=int, help="turns per session (default 3; 1 with "
                    "--new-session)")
    ap.add_argument("--servers", default="ours",
                    help="ours, llama-server or both (ours,llama-server): each runs the same "
                    "sessions, one server at a time")
    ap.add_argument("--url", help="a running server instead (--servers is then ignored)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the GGUF file")
    ap.add_argument("--chat-template", help="a template name or file for both servers")
    ap.add_argument("--peer-bin", help="llama-server (default: .peer/build/bin/llama-server)")
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for our server")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a turn may take")
    ap.add_argument("--max-output", type=int, default=64,
                    help="the most tokens an answer may have, set on the servers this starts "
                    "(PAGEDLLAMA_MAX_OUTPUT, llama-server's -n): a small model rarely stops "
                    "by itself; 0: none")
    ap.add_argument("--cap-requests", action="store_true",
                    help="the proxy also lowers each request's own output limit to --max-output "
                    "(for llama-server, where a request's max_tokens wins over its -n; applied "
                    "to every server of the run, so that they compute the same)")
    ap.add_argument("--record", type=Path, help="write the request bodies here as fixtures")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--new-session", action="store_true",
                    help="per agent: session A, a restart of our server (its disk tier kept), "
                    "session B in another folder; --turns turns each (default 1 here)")
    ap.add_argument("--cold", action="store_true",
                    help="with --new-session: then send session B's first request again to "
                    "our server on an empty cache, for its cold time")
    args = ap.parse_args(argv)
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    for a in agents:
        if a not in PINS:
            ap.error(f"unknown agent {a!r} (one of {', '.join(PINS)})")
        agent_bin(a)
    if shutil.which("git") is None:
        ap.error("git is needed for the scratch repository")
    if args.new_session:
        if args.url:
            ap.error("--new-session restarts the server it starts: no --url")
        args.turns = args.turns or 1
        exchanges, turns = new_sessions(args, agents, ap)
        cold = cold_replays(args, ap, exchanges, agents) if args.cold else None
        summary = report_sessions(exchanges, agents, cold)
        summary["exits"] = [t.exit_code for t in turns]
        for t in turns:
            if t.exit_code != 0:
                print(f"{t.agent} exited {t.exit_code} after {t.seconds:.1f} s:\n   "
                      + t.output[-600:].replace("\n", "\n   "))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
        return 0 if all(t.exit_code == 0 for t in turns) else 1
    args.turns = args.turns or 3
    servers = ["url"] if args.url else [s.strip() for s in args.servers.split(",")]
    results: dict[str, tuple[list[Exchange], list[TurnResult]]] = {}
    for server in servers:
        with ExitStack() as stack:
            url = args.url or stack.enter_context(_launch(server, args, ap))
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            rec = Recorder(url, max_tokens=(args.max_output or None) if args.cap_requests
                           else None, flatten_tools=server == "llama-server")
            base = stack.enter_context(Proxy(rec))
            turns: list[TurnResult] = []
            for agent in agents:
                turns += run_agent(agent, rec, base, model, args.turns, args.timeout)
        print(f"== {server}")
        summary = report(rec.exchanges, turns)
        results[server] = (rec.exchanges, turns)
        if args.record and server in ("ours", "url"):
            record(rec.exchanges, args.record)
    if len(results) == 2:
        summary = {"servers": {k: report_quiet(*v) for k, v in results.items()},
                   "ttft_ratio": compare(*results.values())}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if all(t.exit_code == 0 for _, ts in results.values() for t in ts) else 1


def _launch(server: str, args, ap, log_dir: str | None = None):
    log_dir = log_dir or tempfile.mkdtemp(prefix="agents-log-")
    n_out = args.max_output
    template = args.chat_template
    if server == "ours":
        env = {"PAGEDLLAMA_N_CTX_BEYOND_TRAINED": "1", "PAGEDLLAMA_MAX_SEQS": "2",
               "PAGEDLLAMA_LOG_LEVEL": "info",
               **({"PAGEDLLAMA_MAX_OUTPUT": str(n_out)} if n_out else {}),
               **({"PAGEDLLAMA_CHAT_TEMPLATE": template} if template else {}),
               **parse_env(args.env)}
        return launched(our_server(args.model, n_ctx=args.n_ctx, env=env), log_dir=log_dir)
    if server != "llama-server":
        ap.error(f"unknown server {server!r}")
    binary = find_peer_bin(args.peer_bin)
    if binary is None:
        ap.error("no llama-server: scripts/build_llama_server.sh builds it")
    extra = ["--jinja"] + (["-n", str(n_out)] if n_out else [])
    if template:
        path = chat_template_path(template, Path.cwd(), "--chat-template")
        extra += ["--chat-template-file", str(path)]
    return launched(llama_server(binary, args.model, parallel=2, n_ctx=args.n_ctx, extra=extra),
                    log_dir=log_dir)


def report_quiet(exchanges: list[Exchange], turns: list[TurnResult]) -> list[dict]:
    return [{"agent": e.agent, "turn": e.turn, "status": e.status, "prompt": e.prompt,
             "cached": e.cached, "ttft": e.ttft, "total": round(e.total, 3)}
            for e in exchanges if e.method == "POST"]


def compare(ours: tuple, peer: tuple) -> list[dict]:
    """Per agent and turn: the first request's TTFT, ours over llama-server's."""
    def first(exchanges: list[Exchange]) -> dict:
        out: dict = {}
        for e in exchanges:
            if e.method == "POST" and e.ttft is not None:
                out.setdefault((e.agent, e.turn), e.ttft)
        return out
    a, b = first(ours[0]), first(peer[0])
    print("\nTTFT of each turn's first request, ours / llama-server:")
    rows = []
    for key in sorted(a.keys() & b.keys()):
        ratio = a[key] / b[key] if b[key] else float("nan")
        rows.append({"agent": key[0], "turn": key[1], "ours": round(a[key], 2),
                     "llama_server": round(b[key], 2), "ratio": round(ratio, 2)})
        print(f"  {key[0]:9} turn {key[1]}: {a[key]:8.2f} s / {b[key]:8.2f} s = {ratio:.2f}x")
    return rows


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
