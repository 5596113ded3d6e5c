"""The cluster's front door: HAProxy's configuration for N replicas on this machine.

HAProxy forwards every route unchanged (the body as the client sent it; SSE and NDJSON stream
through as they are written) and only chooses the replica (docs/scaling-out.md, "The front
door: HAProxy"):

- a request that names its session (a header the agent already sends, else a field of its JSON
  body that HAProxy reads itself) goes by a consistent hash of that key: every request of a
  session reaches the same replica while it is up;
- a request without a session key goes to the replica with the fewest open requests
  (`leastconn`);
- the Batch API's routes (`/v1/files`, `/v1/batches`) go to the one replica that holds the batch
  store: all replicas share one state dir, whose store one process opens at a time, and the
  health check of that backend is a Batch API request, which only the holder answers with 200;
- a replica that refuses connections or stops answering its health check is taken out, and a
  request it could not take is sent to another replica.

The same rules serve Kubernetes (deploy/kubernetes/router.yaml) and compose (docker/), with the
replicas found through DNS instead of listed; `python -m cluster.frontdoor` writes those files
and a test checks that they match.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

# Where a session's key is read, first found wins: request headers, then JSON body fields.
# Claude Code sends x-claude-code-session-id; Codex CLI session-id (older releases session_id
# and conversation_id); opencode x-session-affinity and x-session-id; any other client can send
# x-session-id.
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "conversation_id",
                   "x-session-affinity", "x-session-id")
SESSION_BODY_FIELDS = ("prompt_cache_key", "metadata.user_id", "safety_identifier", "user")
SERVED_BY_HEADER = "x-pagedllama-replica"   # added to each answer: the replica that served it
BATCH_PATHS = ("/v1/files", "/v1/batches")
# A request body up to this size is read for a session key before the replica is chosen;
# a larger one is forwarded the same, routed by its headers only.
BODY_BUFFER = 1 << 20
POLICIES = ("session", "least_conn", "round_robin")
BALANCE = {"least_conn": "leastconn", "round_robin": "roundrobin"}


@dataclass(frozen=True)
class FrontDoor:
    """What the configuration is made of: where it listens and the replicas behind it."""
    bind: str                         # host:port of the API
    admin_bind: str                   # host:port of /metrics (Prometheus) and /ready
    replicas: tuple[str, ...] = ()    # host:port of each replica, or
    dns: str | None = None            # name:port whose DNS records are the replicas (headless)
    slots: int = 16                   # the most replicas found through DNS
    resolve: bool = False             # `replicas` are names: resolve them again as they change
    policy: str = "session"
    api_key_env: str | None = None    # variable holding the replicas' API key, for health checks


def session_rules() -> list[str]:
    """`txn.session`: the first session key found in the headers, else in the JSON body."""
    rules = []
    for name in SESSION_HEADERS:
        rules.append(f"http-request set-var(txn.session) req.hdr({name}) "
                     f"if !{{ var(txn.session) -m found }} {{ req.hdr({name}) -m len gt 0 }}")
    for field in SESSION_BODY_FIELDS:
        query = f"req.body,json_query('$.{field}')"
        rules.append(f"http-request set-var(txn.session) {query} "
                     f"if !{{ var(txn.session) -m found }} METH_POST {{ {query} -m len gt 0 }}")
    return rules


def _servers(f: FrontDoor, check: str) -> list[str]:
    if f.dns is not None:   # slots filled from DNS (re-read every few seconds), empty until then
        return [f"    server-template replica- {f.slots} {f.dns} {check} resolvers dns "
                "init-addr none resolve-prefer ipv4"]
    names = " resolvers dns init-addr last,libc,none" if f.resolve else ""
    return [f"    server replica-{i + 1} {addr} {check}{names}"
            for i, addr in enumerate(f.replicas)]


def _resolvers(f: FrontDoor) -> list[str]:
    if f.dns is None and not f.resolve:
        return []
    return ["resolvers dns", "    parse-resolv-conf", "    hold valid 5s", "    hold nx 5s",
            "    accepted_payload_size 8192", ""]


def _auth(f: FrontDoor) -> str:
    return (f' hdr Authorization "Bearer ${{{f.api_key_env}}}"' if f.api_key_env else "")


CHECK = "check inter 1s fall 1 rise 2 observe layer4 error-limit 1 on-error mark-down"
DEFAULTS = [
    "defaults",
    "    mode http",
    "    timeout connect 2s",
    "    timeout client 1h",
    "    timeout server 1h",
    "    timeout http-request 60s",
    "    timeout queue 60s",
    # a request a replica could not take (refused, reset before an answer, 503 while it
    # drains) is sent again, to another replica
    "    retries 2",
    "    option redispatch 1",
    "    retry-on conn-failure empty-response 503",
    "    option http-buffer-request",
    ""]


def _frontends(f: FrontDoor) -> list[str]:
    keyed = ["    use_backend sessions if { var(txn.session) -m found }"]
    return ["frontend api", f"    bind {f.bind}", *[f"    {r}" for r in session_rules()],
            f"    use_backend batch if {{ path_beg {' '.join(BATCH_PATHS)} }}",
            *(keyed if f.policy == "session" else []), "    default_backend pool", "",
            "frontend admin", f"    bind {f.admin_bind}", "    monitor-uri /ready",
            "    monitor fail if { nbsrv(pool) lt 1 }",
            "    http-request use-service prometheus-exporter if { path /metrics }", ""]


def _backend(f: FrontDoor, name: str, balance: list[str], check_uri: str, check: str) -> list[str]:
    return [f"backend {name}", *[f"    {b}" for b in balance],
            f"    http-response set-header {SERVED_BY_HEADER} %[srv_name]",
            "    option httpchk", f"    http-check send meth GET uri {check_uri}{_auth(f)}",
            "    http-check expect status 200", *_servers(f, check), ""]


def config(f: FrontDoor) -> str:
    if f.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    lines = ["global", f"    tune.bufsize {BODY_BUFFER + 16384}", "    tune.maxrewrite 16384",
             "    maxconn 2048", "", *_resolvers(f), *DEFAULTS, *_frontends(f)]
    # passive health: a connection refused or reset counts at once (observe layer4); active:
    # /health every second (503 while a replica drains)
    lines += _backend(f, "pool", [f"balance {BALANCE.get(f.policy, 'leastconn')}"], "/health",
                      CHECK)
    if f.policy == "session":
        lines += _backend(f, "sessions", ["balance hash var(txn.session)",
                                          "hash-type consistent"], "/health", CHECK)
    # only the replica that holds the batch store answers this check with 200 (the others 503
    # "batch_store_unavailable"), so the batch backend has one server up at a time
    lines += _backend(f, "batch", ["balance first"], "/v1/batches?limit=1",
                      "check inter 1s fall 1 rise 1")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the configuration for replicas found by name (Kubernetes, compose)."""
    p = argparse.ArgumentParser(prog="python -m cluster.frontdoor", description=main.__doc__)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--dns", help="name:port whose DNS records are the replicas, e.g. a "
                       "headless Service's pagedllama-replicas.pagedllama.svc.cluster.local:8000")
    where.add_argument("--replicas", nargs="+", help="name:port of each replica")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--bind", default="0.0.0.0:8000")
    p.add_argument("--admin-bind", default="0.0.0.0:29000")
    p.add_argument("--policy", choices=POLICIES, default="session")
    p.add_argument("--api-key-env", default=None,
                   help="the variable that holds the replicas' API key (health checks send it)")
    a = p.parse_args(argv)
    args = " ".join(argv if argv is not None else sys.argv[1:])
    sys.stdout.write(f"# written by: python -m cluster.frontdoor {args}\n")
    sys.stdout.write(config(FrontDoor(a.bind, a.admin_bind, replicas=tuple(a.replicas or ()),
                                      dns=a.dns, slots=a.slots, resolve=a.replicas is not None,
                                      policy=a.policy, api_key_env=a.api_key_env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
