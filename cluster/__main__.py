"""`python -m cluster`: replicas + router in the foreground until Ctrl-C or SIGTERM, or until
one of them exits (then the rest are stopped too, and the exit code is 1)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from cluster.launch import POLICIES, Cluster, ClusterSpec
from server.http.exposure import exposed


def parse_args(argv: list[str] | None = None) -> ClusterSpec:
    p = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--first-replica-port", type=int, default=None,
                   help="replicas listen on 127.0.0.1 from here on (default: port + 1)")
    p.add_argument("--no-pin", action="store_true", help="do not pin replicas to their cores")
    p.add_argument("--log-dir", type=Path, default=None)
    a = p.parse_args(argv)
    return ClusterSpec(replicas=a.replicas, policy=a.policy, port=a.port, host=a.host,
                       first_replica_port=a.first_replica_port, pin=not a.no_pin,
                       log_dir=a.log_dir)


def open_warning(spec: ClusterSpec, env: dict[str, str]) -> str | None:
    """What to say when the router listens beyond this machine and the replicas ask no API key
    (the replicas themselves listen on 127.0.0.1, so they cannot tell)."""
    if not exposed([spec.host], env.get("PAGEDLLAMA_API_KEY")):
        return None
    return (f"warning: the router listens on {spec.host}:{spec.port}, beyond this machine, and "
            "PAGEDLLAMA_API_KEY is not set: anyone who can reach the port can use the API")


class Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise Stop(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    spec = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    cluster = Cluster(spec)
    try:
        cluster.start()
        print(f"router ({spec.policy}) on http://{spec.host}:{spec.port}", flush=True)
        for i, r in enumerate(cluster.replicas):
            print(f"  replica {i + 1}: {r.url}  cores {r.cores}", flush=True)
        print(f"  logs: {cluster.log_dir}   (Ctrl-C stops everything)", flush=True)
        if (warning := open_warning(spec, dict(os.environ))) is not None:
            print(warning, file=sys.stderr, flush=True)
        while (dead := cluster.exited()) is None:
            time.sleep(0.5)
        print(f"a process exited (code {dead.returncode}); stopping the cluster", file=sys.stderr)
        return 1
    except Stop as stop:
        print(f"{stop}: stopping the router and {len(cluster.replicas)} replicas", flush=True)
        return 0
    except RuntimeError as err:
        print(f"error: {err} (logs: {cluster.log_dir})", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
