"""Start a real `uvicorn server.main:app` in a subprocess for integration tests."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster.processes import free_port, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1"


@dataclass
class ServerProcess:
    base: str                   # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def two_cores() -> set[int]:
    """Two of the cores this process may use: a server pinned to them sees a 2-core machine
    (the tests' thread figures), whatever machine runs the tests."""
    return set(sorted(os.sched_getaffinity(0))[:2])


APP = "server.main:app"


@contextmanager
def running_server(env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                   cpus: set[int] | None = None, app: str = APP):
    """Yields the base URL (http://127.0.0.1:PORT) of a fresh server with these env overrides
    (and pinned to `cpus` if given; `app`: another ASGI app to serve, e.g. a test's). The
    server's log is kept in a temp file and printed if startup fails."""
    with server_process(env, startup_timeout, cpus, app) as server:
        yield server.base


@contextmanager
def server_process(env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                   cpus: set[int] | None = None, app: str = APP, host: str = "127.0.0.1"):
    """Like running_server, but yields the ServerProcess (to signal it, read its log); `host`:
    the address it listens on (it is reached on 127.0.0.1 all the same)."""
    port = free_port()
    # a short drain: a test that leaves a request running does not hold up the teardown
    # a state directory of this server's own (batches, the reasoning key), never the user's
    state = tempfile.mkdtemp(prefix="pagedllama-test-state-")
    full_env = {**os.environ, "PAGEDLLAMA_LOG_LEVEL": "info", "PAGEDLLAMA_DRAIN_SECONDS": "3",
                "PAGEDLLAMA_STATE_DIR": state, "PAGEDLLAMA_CACHE_DIR": "", **(env or {})}
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllama-test-{port}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", host,
         "--port", str(port), "--no-access-log"],
        cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{base}/health", proc, startup_timeout, "server")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{log_path.read_text()}") from None
        yield ServerProcess(base, proc, log_path)
    finally:
        stop([proc], timeout=20)
        log.close()


@contextmanager
def smollm2_folder_server(folder: Path):
    """A server whose models folder (`folder`, made here) holds SmolLM2 alone: 1,024 tokens of
    context, 4 sequences, 2 threads; yields the ServerProcess."""
    (folder / SMOLLM2.name).symlink_to(SMOLLM2)
    env = {"PAGEDLLAMA_MODELS_DIR": str(folder), "PAGEDLLAMA_N_CTX": "1024",
           "PAGEDLLAMA_MAX_SEQS": "4", "PAGEDLLAMA_THREADS": "2"}
    with server_process(env) as proc:
        yield proc
