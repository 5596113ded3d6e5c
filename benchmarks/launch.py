"""Start a server as a subprocess (ours, or a peer such as llama.cpp's llama-server), wait for
its /health, and stop it (by its own pid) afterwards. Loopback only."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cluster.processes import wait_http

ROOT = Path(__file__).resolve().parent.parent
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


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
