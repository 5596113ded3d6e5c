"""Open WebUI against pagedllama's Ollama API, in a real headless Chromium: a pagedllama server
(started here, or --server), Open WebUI started on it through its Ollama connection, and a
browser that opens the page, checks the model list (Open WebUI's own /api/models, filled from
/api/tags), sends a chat message and watches the answer stream into the page. At the end: the
routes Open WebUI called on the server and their statuses (any 4xx or 5xx fails the check), the
answer, and its timing. Exit status 0: every check passed; 1: one failed; 2: something it needs
is missing (Open WebUI, Chromium).

Open WebUI is heavy (torch and more: ~7.4 GB) and is installed apart from the project:

    python3.11 -m venv ~/owui-venv && ~/owui-venv/bin/pip install open-webui
    make browser                                   # chromium and chromium-driver (apt)
    .venv/bin/python scripts/open_webui_check.py --open-webui ~/owui-venv/bin/open-webui

Open WebUI runs offline (OFFLINE_MODE: no update check, no model downloads; its RAG embeddings
set to the served model through the Ollama connection, so it loads no embedding model of its
own), without sign-in (WEBUI_AUTH=False), with a data folder of its own that is removed at the
end; its model parameters default to temperature 0, so that its answer can be compared with
the answer of the same message sent to /api/chat directly. Open WebUI offers its built-in
tools (time, knowledge bases, memory, notes, ...) to every chat of a model that may call tools:
~6,600 prompt tokens a chat. The check turns them off (DEFAULT_MODEL_METADATA, as unticking
"Builtin Tools" under a model's capabilities does) unless --builtin-tools, which needs a
context of 8,192 (the server started here then gets it): a server whose context is smaller
answers a 400 that Open WebUI shows in the chat, since prompts are never cut here
(docs/ollama.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # run as a script: the project's own modules

from cluster import processes  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BUILTIN_TOOLS_CTX = 8192
ACCESS = re.compile(r'"(GET|POST|HEAD|DELETE) (/api/[^ ?"]*)[^"]*" (\d{3})')


class Missing(RuntimeError):
    """Something the check needs is not installed."""


class Failed(AssertionError):
    """A check that did not pass."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/open_webui_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--open-webui", default=os.environ.get("OPEN_WEBUI_BIN") or
                   shutil.which("open-webui"),
                   help="the open-webui command (default: $OPEN_WEBUI_BIN, else on PATH)")
    p.add_argument("--server", default=None,
                   help="a pagedllama server running already (its routes are then not listed)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="GGUF file the server serves")
    p.add_argument("--n-ctx", type=int, default=None,
                   help=f"the server's context (default 2048; {BUILTIN_TOOLS_CTX} with "
                        "--builtin-tools)")
    p.add_argument("--builtin-tools", action="store_true",
                   help="leave Open WebUI's built-in tools on (~6,600 prompt tokens a chat)")
    p.add_argument("--message", default="Name three colours.", help="the chat message sent")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for each wait (Open WebUI's start, the answer)")
    p.add_argument("--screenshot", default=None, help="save the page here at the end (PNG)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    args.n_ctx = args.n_ctx or (BUILTIN_TOOLS_CTX if args.builtin_tools else 2048)
    return args


# ---- processes ---------------------------------------------------------------------------------
free_port = processes.free_port


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    try:
        processes.wait_http(url, proc, timeout, url)
    except RuntimeError as exc:
        raise Failed(f"{exc}; its log:\n" + tail(log)) from exc


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None):
    """A child process whose output goes to `log`, stopped (by its own pid) at the end."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def start_server(stack: ExitStack, args, work: Path) -> tuple[str, Path]:
    """pagedllama on a free port, with its access log (the routes Open WebUI calls)."""
    port = free_port()
    log = work / "pagedllama.log"
    env = {"PAGEDLLAMA_MODEL": str(Path(args.model).resolve()),
           "PAGEDLLAMA_N_CTX": str(args.n_ctx), "PAGEDLLAMA_MAX_SEQS": "4",
           "PAGEDLLAMA_CACHE_DIR": "", "PAGEDLLAMA_STATE_DIR": str(work / "state")}
    proc = stack.enter_context(process(
        [sys.executable, "-m", "uvicorn", "server.main:app", "--host", "127.0.0.1",
         "--port", str(port)], env, log, cwd=ROOT))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", proc, args.timeout, log)
    return base, log


def open_webui_version(command: str) -> str:
    python = Path(command).resolve().parent / "python"
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                            "print(m.version('open-webui'))"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def start_open_webui(stack: ExitStack, args, server: str, model: str, work: Path) -> str:
    port = free_port()
    log = work / "open-webui.log"
    data = work / "open-webui-data"
    data.mkdir()
    env = {"DATA_DIR": str(data), "OLLAMA_BASE_URL": server, "ENABLE_OLLAMA_API": "True",
           "ENABLE_OPENAI_API": "False", "WEBUI_AUTH": "False",
           "WEBUI_SECRET_KEY": secrets.token_hex(16), "OFFLINE_MODE": "True",
           "HF_HUB_OFFLINE": "1", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
           "RAG_EMBEDDING_ENGINE": "ollama", "RAG_EMBEDDING_MODEL": model,
           "DEFAULT_MODELS": model, "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True",
           "SCARF_NO_ANALYTICS": "True"}
    env["DEFAULT_MODEL_PARAMS"] = json.dumps({"temperature": 0})   # greedy: comparable
    if not args.builtin_tools:
        env["DEFAULT_MODEL_METADATA"] = json.dumps({"capabilities": {"builtin_tools": False}})
    proc = stack.enter_context(process(
        [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(port)], env, log,
        cwd=work))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", proc, args.timeout, log)
    return base


# ---- the browser -------------------------------------------------------------------------------
def chromium():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        raise Missing(f"{CHROMIUM} and {CHROMEDRIVER} are needed: make browser")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--window-size=1400,1000"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


def wait_for(what: str, timeout: float, probe, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every)
    raise Failed(f"{what}: not within {timeout:.0f} s")


# Open WebUI's own API, from the page (its session token is in localStorage)
FETCH = """const [path, done] = [arguments[0], arguments[arguments.length - 1]];
fetch(path, {headers: {Authorization: 'Bearer ' + localStorage.token}})
  .then(r => r.json()).then(j => done(JSON.stringify(j))).catch(e => done('ERROR ' + e));"""


def page_api(driver, path: str):
    text = driver.execute_async_script(FETCH, path)
    if text.startswith("ERROR"):
        raise Failed(f"Open WebUI {path}: {text}")
    return json.loads(text)


@dataclass
class Seen:
    """The answer's text in the page as it grew: (seconds since sending, characters)."""
    growth: list[tuple[float, int]] = field(default_factory=list)
    text: str = ""


def chat(driver, args, webui: str, model: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.set_script_timeout(30)
    driver.get(webui + "/")
    box = wait_for("the chat input", args.timeout, lambda: driver.find_elements(By.ID,
                                                                                "chat-input"))
    time.sleep(1.0)   # the release notes dialog opens after the page
    for button in driver.find_elements(By.XPATH, "//button[contains(., \"Okay, Let's Go\")]"):
        button.click()
    listed = page_api(driver, "/api/models")["data"]
    ids = {m["id"]: m.get("owned_by") for m in listed}
    if ids.get(model) != "ollama":
        raise Failed(f"Open WebUI's models {ids}: {model} not listed through Ollama")
    selected = " ".join(e.text for e in driver.find_elements(By.ID, "model-selector-model-button"))
    if model not in selected:
        raise Failed(f"the model selector shows {selected!r}, not {model}")
    box[0].click()
    box[0].send_keys(args.message)
    box[0].send_keys(Keys.ENTER)
    sent, seen = time.monotonic(), Seen()

    def answer_done():
        parts = driver.find_elements(By.ID, "response-content-container")
        text = parts[-1].text if parts else ""
        if text and (not seen.growth or seen.growth[-1][1] != len(text)):
            seen.growth.append((round(time.monotonic() - sent, 2), len(text)))
            seen.text = text
        match = re.search(r"/c/([0-9a-f-]{36})", driver.current_url)
        if not match or not seen.text:
            return None
        stored = stored_answer(driver, match.group(1))
        return stored if stored and stored.get("done") else None

    stored = wait_for("the answer", args.timeout, answer_done, every=0.05)
    return {"models": ids, "selected": selected, "seen": seen, "stored": stored,
            "seconds": time.monotonic() - sent}


def stored_answer(driver, chat_id: str) -> dict | None:
    """The assistant's message as Open WebUI keeps it (content, done, usage)."""
    history = page_api(driver, f"/api/v1/chats/{chat_id}").get("chat", {}).get("history", {})
    current = history.get("messages", {}).get(history.get("currentId") or "", {})
    return current if current.get("role") == "assistant" else None


# ---- the check ---------------------------------------------------------------------------------
def routes(log: Path) -> Counter:
    return Counter(f"{m} {p} {s}" for m, p, s in ACCESS.findall(log.read_text(errors="replace")))


def check(args) -> dict:
    if not args.open_webui or not shutil.which(args.open_webui):
        raise Missing("open-webui not found: give --open-webui (or OPEN_WEBUI_BIN), after "
                      "`pip install open-webui` into a virtualenv of its own")
    with tempfile.TemporaryDirectory(prefix="open-webui-check-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        driver = None
        log = None
        if args.server:
            server = args.server.rstrip("/")
        else:
            server, log = start_server(stack, args, work)
        model = httpx.get(f"{server}/api/tags", timeout=10, trust_env=False).json()[
            "models"][0]["name"]
        started = time.monotonic()
        webui = start_open_webui(stack, args, server, model, work)
        webui_start_s = time.monotonic() - started
        try:
            driver = chromium()
            result = chat(driver, args, webui, model)
            if args.screenshot:
                driver.save_screenshot(args.screenshot)
        finally:
            if driver is not None:
                driver.quit()
        called = routes(log) if log else Counter()
        result["direct"] = None if args.builtin_tools else direct_answer(server, model, args)
        return verdict(args, model, result, called, webui_start_s)


def direct_answer(server: str, model: str, args) -> str:
    """The same message sent to /api/chat here, greedy as Open WebUI sent it: the same answer
    (with its built-in tools on, Open WebUI's prompt holds them too, and differs)."""
    body = {"model": model, "stream": False, "options": {"temperature": 0},
            "messages": [{"role": "user", "content": args.message}]}
    answer = httpx.post(f"{server}/api/chat", json=body, timeout=args.timeout, trust_env=False)
    answer.raise_for_status()
    return answer.json()["message"]["content"]


def verdict(args, model: str, result: dict, called: Counter, webui_start_s: float) -> dict:
    seen, stored = result["seen"], result["stored"]
    content = (stored.get("content") or "").strip()
    failures = []
    if not content:
        failures.append("the stored answer is empty")
    if stored.get("error"):
        failures.append(f"Open WebUI shows an error: {stored['error']}")
    direct = result.get("direct")
    if direct is not None and direct.strip() != content:
        failures.append(f"the same message sent to /api/chat here answers {direct!r}")
    if len(seen.growth) < 3:
        failures.append(f"the answer did not stream into the page: {seen.growth}")
    bad = {k: n for k, n in called.items() if not k.endswith((" 200", " 204"))}
    if bad:
        failures.append(f"routes answered an error: {bad}")
    if called and not any(k.startswith("POST /api/chat ") for k in called):
        failures.append("Open WebUI did not call /api/chat")
    usage = stored.get("usage") or {}
    out = {"open_webui": open_webui_version(args.open_webui), "model": model,
           "builtin_tools": args.builtin_tools, "n_ctx": args.n_ctx,
           "open_webui_start_s": round(webui_start_s, 1),
           "models_listed": result["models"], "message": args.message,
           "answer": content, "page_text": seen.text,
           "first_text_s": seen.growth[0][0] if seen.growth else None,
           "answer_s": round(result["seconds"], 1), "page_updates": len(seen.growth),
           "direct_answer": direct, "usage": usage, "routes": dict(sorted(called.items())),
           "failures": failures}
    return out


def report(out: dict) -> str:
    lines = [f"Open WebUI {out['open_webui']} on pagedllama's Ollama API, model {out['model']} "
             f"(built-in tools {'on' if out['builtin_tools'] else 'off'}, n_ctx {out['n_ctx']})",
             f"Open WebUI up in {out['open_webui_start_s']} s; models listed: "
             + ", ".join(f"{k} ({v})" for k, v in out["models_listed"].items()),
             f"sent {out['message']!r}: first text in the page after {out['first_text_s']} s, "
             f"{out['page_updates']} updates as it streamed, done after {out['answer_s']} s",
             f"answer: {out['answer']!r}"
             + (" (the same as /api/chat's when sent directly)"
                if out["direct_answer"] is not None and not out["failures"] else "")]
    usage = out["usage"]
    if usage:
        lines.append("usage Open WebUI kept: " + ", ".join(
            f"{k} {v}" for k, v in usage.items() if isinstance(v, (int, float))))
    if out["routes"]:
        lines.append("routes Open WebUI called: " + ", ".join(
            f"{k} x{n}" for k, n in out["routes"].items()))
    lines += [f"FAILED: {f}" for f in out["failures"]] or ["all checks passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = check(args)
    except Missing as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    except Failed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
