"""How `make cluster` splits the cores and builds its commands (no process started)."""
from __future__ import annotations

import pytest

from cluster.__main__ import open_warning, parse_args
from cluster.cores import split_cores
from cluster.launch import ClusterSpec, replica_env, router_command


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


def test_the_router_is_given_every_replica_and_the_policy():
    cmd = router_command(ClusterSpec(replicas=3, policy="round_robin", port=9000))
    urls = cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")]
    assert urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert cmd[cmd.index("--prometheus-port") + 1] == "10000"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        router_command(ClusterSpec(policy="fastest"))


def test_the_manual_policy_spreads_new_routing_keys_evenly_unless_told_otherwise():
    cmd = router_command(ClusterSpec(policy="manual"))
    assert cmd[cmd.index("--assignment-mode") + 1] == "min_group"
    cmd = router_command(ClusterSpec(policy="manual", router_args=["--assignment-mode", "min_load"]))
    assert cmd.count("--assignment-mode") == 1
    assert cmd[cmd.index("--assignment-mode") + 1] == "min_load"
    assert "--assignment-mode" not in router_command(ClusterSpec(policy="cache_aware"))


def test_a_router_beyond_this_machine_without_a_key_is_warned_about():
    assert open_warning(parse_args([]), {}) is None                      # 127.0.0.1
    spec = parse_args(["--host", "0.0.0.0", "--port", "9000"])
    assert "0.0.0.0:9000, beyond this machine" in open_warning(spec, {})
    assert open_warning(spec, {"PAGEDLLAMA_API_KEY": "k"}) is None
