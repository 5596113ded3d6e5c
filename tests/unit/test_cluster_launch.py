"""How `make cluster` splits the cores and builds its commands (no process started)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.__main__ import open_warning, parse_args
from cluster.cores import split_cores
from cluster.frontdoor import SESSION_HEADERS, config, session_rules
from cluster.launch import ClusterSpec, front_door, replica_env


def test_cores_are_split_into_disjoint_equal_groups():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert split_cores([0, 1], 2) == [[0], [1]]


def test_replicas_share_cores_round_robin_when_there_are_fewer_cores():
    assert split_cores([0, 1], 3) == [[0], [1], [0]]


def test_no_replicas_is_refused():
    with pytest.raises(ValueError):
        split_cores([0, 1], 0)


def test_a_replica_gets_one_thread_per_core_unless_the_caller_sets_threads():
    assert replica_env(ClusterSpec(), [2, 3])["PAGEDLLAMA_THREADS"] == "2"
    spec = ClusterSpec(replica_env={"PAGEDLLAMA_THREADS": "1"})
    assert replica_env(spec, [2, 3])["PAGEDLLAMA_THREADS"] == "1"


def door(**kw) -> str:
    spec = ClusterSpec(**kw)
    return config(front_door(spec, {}))


def section(cfg: str, backend: str) -> str:
    return cfg.split(f"\nbackend {backend}\n")[1].split("\n\n")[0]


def test_the_router_is_given_every_replica_and_the_policy():
    cfg = door(replicas=3, policy="round_robin", port=9000)
    for backend in ("pool", "batch"):
        lines = section(cfg, backend).splitlines()
        assert [ln.split()[2] for ln in lines if ln.strip().startswith("server")] \
            == ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    assert "balance roundrobin" in cfg and "backend sessions" not in cfg
    assert "bind 127.0.0.1:9000" in cfg and "bind 127.0.0.1:10000" in cfg


def test_sessions_go_by_a_consistent_hash_of_their_key_and_the_rest_by_load():
    cfg = door()
    sessions = section(cfg, "sessions")
    assert "balance hash var(txn.session)" in sessions and "hash-type consistent" in sessions
    assert "balance leastconn" in section(cfg, "pool")
    # headers first, in this order, then the body's fields
    rules = session_rules()
    assert "x-claude-code-session-id" in rules[0] and "json_query('$.prompt_cache_key')" in \
        rules[len(SESSION_HEADERS)]
    assert "json_query('$.metadata.user_id')" in cfg


def test_the_batch_routes_go_to_the_replica_that_holds_the_store():
    cfg = door()
    assert "use_backend batch if { path_beg /v1/files /v1/batches }" in cfg
    batch = section(cfg, "batch")
    assert "balance first" in batch and "uri /v1/batches?limit=1" in batch


def test_health_checks_carry_the_api_key_when_one_is_set():
    spec = ClusterSpec()
    cfg = config(front_door(spec, {"PAGEDLLAMA_API_KEY": "k"}))
    assert 'hdr Authorization "Bearer ${PAGEDLLAMA_API_KEY}"' in cfg and "k\"" not in cfg


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        door(policy="fastest")


def test_every_replica_gets_the_one_cache_and_state_dir():
    spec = ClusterSpec(cache_dir=Path("/c"), state_dir=Path("/s"))
    envs = [replica_env(spec, [i]) for i in range(2)]
    assert {e["PAGEDLLAMA_CACHE_DIR"] for e in envs} == {"/c"}
    assert {e["PAGEDLLAMA_STATE_DIR"] for e in envs} == {"/s"}
    assert parse_args(["--cache-dir", ""]).cache_dir is None     # PAGEDLLAMA_CACHE_DIR= : off


def test_a_router_beyond_this_machine_without_a_key_is_warned_about():
    assert open_warning(parse_args([]), {}) is None                      # 127.0.0.1
    spec = parse_args(["--host", "0.0.0.0", "--port", "9000"])
    assert "0.0.0.0:9000, beyond this machine" in open_warning(spec, {})
    assert open_warning(spec, {"PAGEDLLAMA_API_KEY": "k"}) is None
