"""Start a server as a subprocess (ours, or a peer such as llama.cpp's llama-server), wait for
its /health, and stop it (by its own pid) afterwards; find a running server's process and the
CPU time it used. Loopback only."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.harness.client import check_loopback
from cluster.processes import free_port, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PEER_BIN = ROOT / ".peer" / "build" / "bin" / "llama-server"


def env_items(items: list[str]) -> dict[str, str]:
    """KEY=VALUE command-line items (the --our-env of the benchmarks) as an environment."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, not {item!r}")
        env[key] = value
    return env


def parse_env(items: list[str]) -> dict[str, str]:
    """--a-env/--b-env items: KEY=VALUE settings of our server, each PAGEDLLAMA_NAME."""
    env = env_items(items)
    for name in env:
        if not name.startswith("PAGEDLLAMA_"):
            raise SystemExit(f"not a PAGEDLLAMA_NAME=VALUE setting: {name!r}")
    return env


@dataclass
class ServerSpec:
    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def our_server(model: str | Path = DEFAULT_MODEL, threads: int = 2, n_ctx: int = 2048,
               env: dict[str, str] | None = None, port: int | None = None) -> ServerSpec:
    port = port or free_port()
    cmd = [sys.executable, "-m", "uvicorn", "server.main:app", "--host", "127.0.0.1",
           "--port", str(port), "--no-access-log"]
    full_env = {"PAGEDLLAMA_MODEL": str(model), "PAGEDLLAMA_THREADS": str(threads),
                "PAGEDLLAMA_N_CTX": str(n_ctx), "PAGEDLLAMA_LOG_LEVEL": "warning",
                "PAGEDLLAMA_DRAIN_SECONDS": "5", **(env or {})}   # stop() waits 30 s at most
    return ServerSpec("pagedllama", cmd, port, full_env)


def find_peer_bin(explicit: str | None = None) -> Path | None:
    """--peer-bin, else $LLAMA_SERVER_BIN, else .peer/build/bin/llama-server, else PATH.
    A binary asked for by name that is missing gives None (no silent fallback)."""
    asked = explicit or os.environ.get("LLAMA_SERVER_BIN")
    if asked:
        return Path(asked) if _executable(asked) else None
    if _executable(DEFAULT_PEER_BIN):
        return DEFAULT_PEER_BIN
    found = shutil.which("llama-server")
    return Path(found) if found else None


def _executable(path: str | Path) -> bool:
    return Path(path).is_file() and os.access(path, os.X_OK)


def llama_server(binary: str | Path, model: str | Path = DEFAULT_MODEL, threads: int = 2,
                 parallel: int = 16, n_ctx: int = 2048, extra: list[str] | None = None,
                 port: int | None = None) -> ServerSpec:
    """llama-server as its docs suggest for concurrent clients: -np slots, each with the same
    per-sequence context as ours (-c is the total over all slots)."""
    port = port or free_port()
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads),
           "-np", str(parallel), "-c", str(n_ctx * parallel), "--host", "127.0.0.1",
           "--port", str(port), *(extra or [])]
    return ServerSpec("llama-server", cmd, port)


def peer_from_template(template: str, model: str | Path, threads: int, parallel: int,
                       n_ctx: int) -> ServerSpec:
    """Any OpenAI-compatible server command, with {port} {model} {threads} {parallel} {ctx}
    {ctx_total} filled in."""
    import shlex

    port = free_port()
    cmd = [part.format(port=port, model=model, threads=threads, parallel=parallel, ctx=n_ctx,
                       ctx_total=n_ctx * parallel) for part in shlex.split(template)]
    return ServerSpec(Path(cmd[0]).name, cmd, port)


def command_exists(cmd: list[str]) -> bool:
    return _executable(cmd[0]) or shutil.which(cmd[0]) is not None


def label(what: str, env: list[str]) -> str:
    """A server's name in a report: what it is and the settings it was started with."""
    return " ".join([what, *env])


def start_server(stack: ExitStack, what: str, env: list[str], args) -> str:
    """The base URL of `what`: `ours` (with the PAGEDLLAMA_NAME=VALUE items `env`) or
    `llama-server`, started here with args.model and args.threads (llama-server with
    args.parallel slots) until `stack` closes, or the URL of a loopback server running already."""
    if env and what != "ours":
        raise SystemExit(f"--a-env/--b-env set our server's settings; {what!r} is not ours")
    if what.startswith("http"):
        return check_loopback(what)
    n_ctx = getattr(args, "n_ctx", None) or 2048
    if what == "ours":
        spec = our_server(args.model, args.threads, n_ctx, env=parse_env(env))
    elif what == "llama-server":
        binary = find_peer_bin()
        if binary is None:
            raise SystemExit("llama-server not found (scripts/build_llama_server.sh builds it)")
        spec = llama_server(binary, args.model, args.threads, args.parallel, n_ctx)
    else:
        raise SystemExit(f"--a/--b: ours, llama-server or a URL, not {what!r}")
    return stack.enter_context(launched(spec))


def stop_servers_on_sigterm() -> None:
    """On SIGTERM, unwind (exit 143) so that the servers this process started are stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@contextmanager
def launched(spec: ServerSpec, startup_timeout: float = 300.0, log_dir: str | None = None):
    """Yields the base URL once GET /health answers 200; the server's output goes to a log
    file whose tail is shown if it fails to start."""
    log_dir = log_dir or tempfile.gettempdir()
    log_path = Path(log_dir) / f"bench-{spec.name}-{spec.port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(spec.cmd, cwd=spec.cwd, env={**os.environ, **spec.env},
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_healthy(spec, proc, log_path, startup_timeout)
            yield spec.base_url
        finally:
            stop([proc], timeout=30)


def _wait_healthy(spec: ServerSpec, proc: subprocess.Popen, log_path: Path,
                  timeout: float) -> None:
    try:
        wait_http(f"{spec.base_url}/health", proc, timeout, spec.name)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; log {log_path}:\n{_tail(log_path)}") from None


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def server_process(base: str) -> psutil.Process | None:
    """The process listening on base's port (the server, ours or a peer's)."""
    port = int(base.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    return None


def cpu_seconds(proc: psutil.Process | None) -> float:
    """User + system CPU seconds of a process so far; 0 when it is gone or unknown."""
    try:
        t = proc.cpu_times() if proc else None
    except psutil.Error:
        return 0.0
    return t.user + t.system if t else 0.0
