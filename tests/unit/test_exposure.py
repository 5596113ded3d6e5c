"""The warning at start when the API is reachable beyond this machine without an API key
(server/http/exposure.py): the decision, and the addresses read from bound sockets."""
from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

from server.http import exposure

WARNING = "PAGEDLLAMA_API_KEY is not set"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1",
                                  "localhost", "[::1]", "", "/run/pagedllama.sock"])
def test_loopback_and_unix_sockets_are_this_machine_only(host):
    assert exposure.is_local(host)
    assert exposure.exposed([host], api_key=None) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.5", "fe80::1%eth0",
                                  "2001:db8::1", "::ffff:192.168.1.20", "myhost.example"])
def test_every_interface_or_a_network_address_is_beyond_this_machine(host):
    assert not exposure.is_local(host)
    assert exposure.exposed([host], api_key=None) == [host]
    assert exposure.exposed([host], api_key="secret") == []      # a key is asked for


def test_one_open_address_among_local_ones_is_enough():
    assert exposure.exposed(["127.0.0.1", "0.0.0.0"], api_key=None) == ["0.0.0.0"]
    assert exposure.exposed(["127.0.0.1", "0.0.0.0"], api_key="") == ["0.0.0.0"]   # empty: none


def served(*sockets):
    return SimpleNamespace(started=True, servers=[SimpleNamespace(sockets=list(sockets))])


@pytest.fixture()
def bound():
    socks = []

    def bind(family, host):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind((host, 0))
        socks.append(s)
        return s
    yield bind
    for s in socks:
        s.close()


def test_the_addresses_come_from_the_bound_sockets(bound, caplog):
    sock = bound(socket.AF_INET, "127.0.0.1")
    port = sock.getsockname()[1]
    assert exposure.listening(served(sock)) == [("127.0.0.1", f"127.0.0.1:{port}")]
    with caplog.at_level(logging.INFO, "pagedllama.server"):
        exposure.report(exposure.listening(served(sock)), api_key=None)
    assert f"listening on 127.0.0.1:{port}: this machine only" in caplog.text
    assert WARNING not in caplog.text


def test_a_socket_on_every_interface_without_a_key_is_a_warning(bound, caplog):
    sock = bound(socket.AF_INET, "0.0.0.0")     # bound, never listening
    with caplog.at_level(logging.INFO, "pagedllama.server"):
        exposure.report(exposure.listening(served(sock)), api_key=None)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and WARNING in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "pagedllama.server"):
        exposure.report(exposure.listening(served(sock)), api_key="secret")
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "beyond this machine, PAGEDLLAMA_API_KEY required" in caplog.text


def test_an_ipv6_and_a_unix_socket_are_read_too(bound, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        v6 = bound(socket.AF_INET6, "::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp_path / "api.sock"))
    try:
        got = exposure.listening(served(v6, unix))
    finally:
        unix.close()
    assert got == [("::1", f"[::1]:{v6.getsockname()[1]}"), ("", str(tmp_path / "api.sock"))]
    assert exposure.exposed([h for h, _ in got], api_key=None) == []
