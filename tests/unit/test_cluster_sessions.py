"""The sessions scenario of benchmarks.cluster (benchmarks/cluster_sessions.py), its pure parts:
histories that grow turn by turn, a distinct context per session, the session's id in both
routing headers, the replicas' settings, and the report's shares (later turns; the moved
sessions' next turn after a kill)."""
from types import SimpleNamespace

import pytest

from benchmarks import cluster_sessions as cs
from benchmarks.cluster import parse_args
from benchmarks.harness.client import RequestOutput
from benchmarks.harness.datasets import Calibration
from cluster.launch import ROUTING_KEY_HEADER


def args(*extra: str):
    return parse_args(["--scenario", "sessions", "--sessions", "3", "--turns", "4",
                       "--context-tokens", "200", *extra])


def test_a_history_grows_by_the_answer_and_a_new_message_each_turn():
    (s, *_) = cs.make_sessions(args(), Calibration(), seed=0)
    s.answers = ["first answer", "second answer"]
    assert s.messages(0) == [{"role": "user", "content": f"{s.context}\n\n{s.questions[0]}"}]
    third = s.messages(2)
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[:3] == s.messages(1) and third[3]["content"] == "second answer"
    assert third[4]["content"] == s.questions[2]
    assert s.headers() == {cs.SESSION_HEADER: s.sid, ROUTING_KEY_HEADER: s.sid}


def test_sessions_have_distinct_contexts_of_about_the_asked_length():
    sessions = cs.make_sessions(args(), Calibration(), seed=0)
    assert len({s.context for s in sessions}) == len(sessions) == 3
    assert len({s.context.split()[:4][-1] for s in sessions}) > 1   # distinct from the start
    assert all(190 <= len(s.context.split()) <= 215 for s in sessions)
    assert all(len(s.questions) == 4 for s in sessions)


def test_the_replicas_share_a_cache_dir_and_fit_the_longest_history(tmp_path):
    env = cs.replica_env(args(), tmp_path)
    assert env["PAGEDLLAMA_CACHE_DIR"] == str(tmp_path)
    assert int(env["PAGEDLLAMA_CACHE_MIN_TOKENS"]) <= 200   # a smoke context is still saved
    assert int(env["PAGEDLLAMA_N_CTX"]) >= 2048
    big = cs.replica_env(parse_args(["--scenario", "sessions", "--context-tokens", "6000"]),
                         tmp_path)
    assert int(big["PAGEDLLAMA_N_CTX"]) >= 6000 + 4 * (48 + 32)
    assert "PAGEDLLAMA_CACHE_MIN_TOKENS" not in big                 # the server's default
    assert "PAGEDLLAMA_CACHE_DIR" not in cs.replica_env(args("--no-shared-disk"), None)


def turn(session: int, k: int, cached: int, prompt: int = 100, ttft: float = 1.0,
         replica: int | None = None) -> cs.Turn:
    out = RequestOutput(ok=True, start=0.0, end=ttft + 1, chunk_times=[ttft], prompt_tokens=prompt,
                        output_tokens=10, cached_tokens=cached, usage_reported=True)
    return cs.Turn(session, k, out, attempts=1, replica=replica)


def test_the_report_counts_later_turns_and_the_moved_sessions_next_turn():
    a = args("--kill-halfway", "--turns", "4")
    run = SimpleNamespace(args=a, sessions=[None] * 3, urls=["http://127.0.0.1:9"],
                          errors={"HTTP 502": 2}, stopped=set(), killed=0,
                          turns=[turn(0, 0, 0), turn(1, 0, 0), turn(2, 0, 0),
                                 turn(0, 1, 90, replica=0), turn(1, 1, 80),
                                 turn(2, 1, 100, replica=0),
                                 turn(0, 2, 50), turn(1, 2, 100), turn(2, 2, 70)])
    r = cs.report_of(run, duration=10.0)
    assert r["cached_share_later_turns"] == pytest.approx((90 + 80 + 100 + 50 + 100 + 70) / 600)
    assert r["moved_sessions"] == 2 and r["unattributed"] == 1
    assert r["moved_next_turn_cached_share"] == pytest.approx((50 + 70) / 200)
    assert r["errors"] == 2 and r["output_throughput"] == pytest.approx(9.0)
    assert r["disk_hits_per_replica"] == [None]          # a replica that answers nothing
    assert "2 sessions moved, next-turn cached 60%" in cs.line({**r, "policy": "manual"})


def test_a_policy_cluster_launch_does_not_know_is_reported_not_run():
    text = cs.line({"policy": "session", "not_run": "policy must be one of ..."})
    assert text.startswith("session") and "not run" in text
