"""Whether the API can be reached from beyond this machine without an API key, said at start.

`make run` listens on 127.0.0.1 unless HOST says otherwise; a server that listens on 0.0.0.0,
::, or an address of a network interface answers anyone who can reach the port, and without
PAGEDLLAMA_API_KEY it asks nothing of them. The server learns where it listens from the
sockets uvicorn bound (its Server's `servers`, once it has started), so `--host`, `--fd`,
`--uds` and sockets handed over by a process manager are all seen as they are; it then logs a
WARNING when any of them is beyond loopback without a key, an INFO line otherwise.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable

log = logging.getLogger("pagedllama.server")


def is_local(host: str) -> bool:
    """Whether an address (as a socket reports it, or as given to --host) is reachable only
    from this machine: loopback (127.0.0.0/8, ::1, ::ffff:127.x), `localhost`, or a Unix
    socket's path. 0.0.0.0 and :: (every interface) and other names are not."""
    if not host or host.startswith(("/", "\0", "@")) or host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False          # a name: it may resolve to anything
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def exposed(hosts: Iterable[str], api_key: str | None) -> list[str]:
    """The hosts that answer beyond this machine without a key: those not local, when no API
    key is set; none when one is."""
    if api_key:
        return []
    return [h for h in hosts if not is_local(h)]


def listening(server) -> list[tuple[str, str]]:
    """(host, shown as) for every socket a started uvicorn Server serves: `host:port`, or a Unix
    socket's path (host "": local)."""
    found = []
    for srv in getattr(server, "servers", None) or []:
        for sock in srv.sockets or ():
            name = sock.getsockname()
            if sock.family == socket.AF_UNIX:
                shown = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
                found.append(("", shown or "an unnamed Unix socket"))
            elif sock.family == socket.AF_INET6:
                found.append((name[0], f"[{name[0]}]:{name[1]}"))
            else:
                found.append((name[0], f"{name[0]}:{name[1]}"))
    return found


def report(addresses: list[tuple[str, str]], api_key: str | None) -> None:
    """Log where the server listens ((host, shown as) pairs), with a WARNING when it is open
    beyond this machine without a key."""
    shown = ", ".join(s for _, s in addresses)
    if exposed([h for h, _ in addresses], api_key):
        log.warning("listening on %s, beyond this machine, and PAGEDLLAMA_API_KEY is not set: "
                    "anyone who can reach the port can use the API. Set PAGEDLLAMA_API_KEY, or "
                    "listen on 127.0.0.1 (HOST=127.0.0.1, make run's default)", shown)
    elif all(is_local(h) for h, _ in addresses):
        log.info("listening on %s: this machine only", shown)
    else:
        log.info("listening on %s: beyond this machine, PAGEDLLAMA_API_KEY required", shown)


async def report_when_listening(server, api_key: str | None, poll: float = 0.05) -> None:
    """Wait until uvicorn's `server` has bound its sockets (after the lifespan's startup), then
    report them. `server` None (not under uvicorn): nothing is known, a DEBUG line."""
    if server is None:
        log.debug("not under uvicorn: where the server listens is not checked")
        return
    while not getattr(server, "started", False):
        if getattr(server, "should_exit", False):
            return
        await asyncio.sleep(poll)
    addresses = listening(server)
    if addresses:
        report(addresses, api_key)
