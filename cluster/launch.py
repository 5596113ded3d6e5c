"""A cluster on this machine: N pagedllama replicas (cores split between them, ports of their
own, one prefix-cache directory and one state dir shared by all) and HAProxy in front of them
on one port (cluster/frontdoor.py says how it routes; docs/scaling-out.md says why HAProxy).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cluster.cores import available_cores, split_cores
from cluster.frontdoor import POLICIES, SERVED_BY_HEADER, FrontDoor, config
from cluster.processes import spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
MAX_RESTARTS = 5                      # a replica that keeps exiting stops the cluster
ROUTING_KEY_HEADER = "x-session-id"   # the header a client names its session in (any policy)
__all__ = ["POLICIES", "ROUTING_KEY_HEADER", "SERVED_BY_HEADER", "Cluster", "ClusterSpec"]


@dataclass
class ClusterSpec:
    replicas: int = 2
    policy: str = "session"
    port: int = 8000
    host: str = "127.0.0.1"
    first_replica_port: int | None = None     # default: port + 1, port + 2, ...
    metrics_port: int | None = None           # the router's /metrics and /ready (port + 1000)
    pin: bool = True                          # pin each replica to its cores
    replica_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    cache_dir: Path | None = None             # PAGEDLLAMA_CACHE_DIR of every replica (one dir)
    state_dir: Path | None = None             # PAGEDLLAMA_STATE_DIR of every replica (one dir)
    router_args: list[str] = field(default_factory=list)   # more haproxy command-line flags

    def replica_ports(self) -> list[int]:
        first = self.first_replica_port or self.port + 1
        return [first + i for i in range(self.replicas)]

    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports()]

    @property
    def admin_port(self) -> int:
        return self.metrics_port or self.port + 1000

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Replica:
    url: str
    cores: list[int]
    proc: subprocess.Popen
    restarts: int = 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_cluster_port(replicas: int) -> int:
    """A router port p with p + 1 .. p + replicas (the replicas) and p + 1000 (the router's
    metrics) free too: for tests and benchmarks."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 1000 < 65536 and all(_bindable(port + d)
                                       for d in (*range(1, replicas + 1), 1000)):
            return port
    raise RuntimeError("no free range of ports")


def replica_command(port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "server.main:app", "--host", "127.0.0.1",
            "--port", str(port), "--no-access-log"]


def replica_env(spec: ClusterSpec, cores: list[int]) -> dict[str, str]:
    """One llama.cpp thread per core of the replica's share, unless the caller says otherwise;
    the same cache and state dirs for every replica."""
    shared = {}
    if spec.cache_dir is not None:
        shared["PAGEDLLAMA_CACHE_DIR"] = str(spec.cache_dir)
    if spec.state_dir is not None:
        shared["PAGEDLLAMA_STATE_DIR"] = str(spec.state_dir)
    return {**os.environ, "PAGEDLLAMA_THREADS": str(len(cores)), **shared, **spec.replica_env}


def front_door(spec: ClusterSpec, env: dict[str, str]) -> FrontDoor:
    key = "PAGEDLLAMA_API_KEY" if env.get("PAGEDLLAMA_API_KEY") else None
    return FrontDoor(bind=f"{spec.host}:{spec.port}", admin_bind=f"127.0.0.1:{spec.admin_port}",
                     replicas=tuple(u.removeprefix("http://") for u in spec.worker_urls()),
                     policy=spec.policy, api_key_env=key)


def haproxy() -> str:
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None)
    if found is None:
        raise RuntimeError("the front door needs HAProxy 2.6 or newer: apt-get install haproxy")
    return found


def router_command(spec: ClusterSpec, config_file: Path) -> list[str]:
    if spec.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    return [haproxy(), "-db", "-f", str(config_file), *spec.router_args]


class Cluster:
    """Context manager: replicas up and healthy, then the router; stopped in reverse order."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.log_dir = spec.log_dir or Path(
            tempfile.mkdtemp(prefix=f"pagedllama-cluster-{spec.port}-"))
        self.replicas: list[Replica] = []
        self.router: subprocess.Popen | None = None

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn_replica(self, i: int, cores: list[int]) -> subprocess.Popen:
        port = self.spec.replica_ports()[i]
        return spawn(replica_command(port), replica_env(self.spec, cores),
                     self.log_dir / f"replica-{i + 1}.log", cores if self.spec.pin else None,
                     cwd=ROOT, append=True)

    def start(self, timeout: float = 180.0) -> None:
        if self.spec.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        groups = split_cores(available_cores(), self.spec.replicas)
        for i, cores in enumerate(groups):
            proc = self._spawn_replica(i, cores)
            self.replicas.append(Replica(self.spec.worker_urls()[i], cores, proc))
        for i, r in enumerate(self.replicas):
            wait_http(f"{r.url}/health", r.proc, timeout, f"replica {i + 1} ({r.url})")
        cfg = self.log_dir / "haproxy.cfg"
        cfg.write_text(config(front_door(self.spec, dict(os.environ))))
        self.router = spawn(router_command(self.spec, cfg), dict(os.environ),
                            self.log_dir / "router.log", cwd=ROOT)
        wait_http(f"http://127.0.0.1:{self.spec.admin_port}/ready", self.router, 60.0,
                  "the router")

    def restart_exited(self) -> list[int]:
        """Start again each replica that exited (the router takes it back once its health check
        passes); the indices of those restarted. RuntimeError after MAX_RESTARTS of one."""
        restarted = []
        for i, r in enumerate(self.replicas):
            if r.proc.poll() is not None:
                if r.restarts >= MAX_RESTARTS:
                    raise RuntimeError(f"replica {i + 1} exited {r.restarts + 1} times")
                r.proc, r.restarts = self._spawn_replica(i, r.cores), r.restarts + 1
                restarted.append(i)
        return restarted

    def processes(self) -> list[subprocess.Popen]:
        return ([self.router] if self.router else []) + [r.proc for r in self.replicas]

    def exited(self) -> subprocess.Popen | None:
        return next((p for p in self.processes() if p.poll() is not None), None)

    def stop(self) -> None:
        stop([self.router] if self.router else [])
        stop([r.proc for r in self.replicas])
