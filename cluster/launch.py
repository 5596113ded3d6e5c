"""A cluster on this machine: N pagedllama replicas (cores split between them, ports of their
own) and sglang-router in front of them on one port.

Why sglang-router (docs/scaling-out.md, "The router: sglang-router"): it is a maintained Rust
router on PyPI whose
`cache_aware` policy keeps an approximate radix tree of the prompts it sent to each worker and
sends a request to the worker with the longest match (above `cache_threshold`), falling back
to the least loaded worker when the load is out of balance; it also has `round_robin`,
`random` and `power_of_two`, and Kubernetes service discovery by pod label. Its `manual` policy
routes by a key the client names in the `x-smg-routing-key` header (a system prompt's or a
tenant's id): a known key goes to the worker it went to before, a new key here to the worker
holding the fewest keys (`--assignment-mode min_group`), a request without one at random.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cluster.cores import available_cores, split_cores
from cluster.processes import spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
ROUTING_KEY_HEADER = "x-smg-routing-key"   # what the manual policy routes by


@dataclass
class ClusterSpec:
    replicas: int = 2
    policy: str = "cache_aware"
    port: int = 8000
    host: str = "127.0.0.1"
    first_replica_port: int | None = None     # default: port + 1, port + 2, ...
    metrics_port: int | None = None           # the router's Prometheus port (default: port + 1000)
    pin: bool = True                          # pin each replica to its cores
    replica_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    router_log_level: str = "warn"
    router_args: list[str] = field(default_factory=list)   # more sglang-router flags

    def replica_ports(self) -> list[int]:
        first = self.first_replica_port or self.port + 1
        return [first + i for i in range(self.replicas)]

    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports()]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Replica:
    url: str
    cores: list[int]
    proc: subprocess.Popen


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
    """One llama.cpp thread per core of the replica's share, unless the caller says otherwise."""
    return {**os.environ, "PAGEDLLAMA_THREADS": str(len(cores)), **spec.replica_env}


def router_command(spec: ClusterSpec) -> list[str]:
    if spec.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    metrics_port = spec.metrics_port or spec.port + 1000
    extra = list(spec.router_args)
    if spec.policy == "manual" and "--assignment-mode" not in extra:
        extra += ["--assignment-mode", "min_group"]   # new keys spread evenly over the workers
    return [sys.executable, "-m", "sglang_router.launch_router",
            "--host", spec.host, "--port", str(spec.port),
            "--worker-urls", *spec.worker_urls(), "--policy", spec.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", spec.router_log_level, *extra]


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

    def start(self, timeout: float = 180.0) -> None:
        groups = split_cores(available_cores(), self.spec.replicas)
        for i, (port, cores) in enumerate(zip(self.spec.replica_ports(), groups)):
            proc = spawn(replica_command(port), replica_env(self.spec, cores),
                         self.log_dir / f"replica-{i + 1}.log",
                         cores if self.spec.pin else None, cwd=ROOT)
            self.replicas.append(Replica(f"http://127.0.0.1:{port}", cores, proc))
        for i, r in enumerate(self.replicas):
            wait_http(f"{r.url}/health", r.proc, timeout, f"replica {i + 1} ({r.url})")
        self.router = spawn(router_command(self.spec), dict(os.environ),
                            self.log_dir / "router.log", cwd=ROOT)
        wait_http(f"{self.spec.url}/readiness", self.router, 60.0, "the router")

    def processes(self) -> list[subprocess.Popen]:
        return ([self.router] if self.router else []) + [r.proc for r in self.replicas]

    def exited(self) -> subprocess.Popen | None:
        return next((p for p in self.processes() if p.poll() is not None), None)

    def stop(self) -> None:
        stop([self.router] if self.router else [])
        stop([r.proc for r in self.replicas])
