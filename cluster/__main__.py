"""`python -m cluster`: replicas + router in the foreground until Ctrl-C or SIGTERM. A replica
that exits is started again (the router sends its requests elsewhere meanwhile); if the router
exits, the replicas are stopped too and the exit code is 1."""
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
    p.add_argument("--policy", choices=POLICIES, default="session",
                   help="session: by session key, else the least busy replica (default)")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--first-replica-port", type=int, default=None,
                   help="replicas listen on 127.0.0.1 from here on (default: port + 1)")
    p.add_argument("--no-pin", action="store_true", help="do not pin replicas to their cores")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--cache-dir", type=_directory, default=_env_path("PAGEDLLAMA_CACHE_DIR"),
                   help="the prefix cache's disk tier, one directory for every replica "
                        "(default: PAGEDLLAMA_CACHE_DIR; unset: no disk tier)")
    p.add_argument("--state-dir", type=_directory, default=_env_path("PAGEDLLAMA_STATE_DIR"),
                   help="the Batch API's store, one directory for every replica "
                        "(default: PAGEDLLAMA_STATE_DIR, else the server's default)")
    a = p.parse_args(argv)
    return ClusterSpec(replicas=a.replicas, policy=a.policy, port=a.port, host=a.host,
                       first_replica_port=a.first_replica_port, pin=not a.no_pin,
                       log_dir=a.log_dir, cache_dir=a.cache_dir, state_dir=a.state_dir)


def _directory(value: str) -> Path | None:
    """An absolute path; an empty value is none (`PAGEDLLAMA_CACHE_DIR=` turns the tier off)."""
    return Path(value).expanduser().resolve() if value.strip() else None


def _env_path(name: str) -> Path | None:
    return _directory(os.environ.get(name, ""))


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
        print(f"router (HAProxy, {spec.policy}) on http://{spec.host}:{spec.port}", flush=True)
        for i, r in enumerate(cluster.replicas):
            print(f"  replica {i + 1}: {r.url}  cores {r.cores}", flush=True)
        print(f"  prefix cache dir: {spec.cache_dir or '(none)'}; logs: {cluster.log_dir}   "
              "(Ctrl-C stops everything)", flush=True)
        if (warning := open_warning(spec, dict(os.environ))) is not None:
            print(warning, file=sys.stderr, flush=True)
        while cluster.router is not None and cluster.router.poll() is None:
            for i in cluster.restart_exited():
                print(f"replica {i + 1} exited; starting it again", file=sys.stderr, flush=True)
            time.sleep(0.5)
        print("the router exited; stopping the cluster", file=sys.stderr)
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
