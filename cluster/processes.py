"""Start child processes that die with their parent, wait for an HTTP endpoint, stop them."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1


def _child_setup(cores: list[int] | None):
    def setup() -> None:
        # a child gets SIGTERM when the launcher dies, however it dies (even SIGKILL)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
        if cores:
            os.sched_setaffinity(0, cores)
    return setup


def spawn(cmd: list[str], env: dict[str, str], log: Path | None,
          cores: list[int] | None = None, cwd: Path | None = None,
          append: bool = False) -> subprocess.Popen:
    """Its own session (a terminal's Ctrl-C reaches the launcher only, which stops the children
    in order); output to `log` (appended to with `append`: a restarted process), or inherited
    when None."""
    out = log.open("a" if append else "w") if log else None
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out,
                            stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_child_setup(cores))


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Until GET url answers 200; raises if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")
        time.sleep(0.25)


def stop(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM to each (a pagedllama replica drains and exits), then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
