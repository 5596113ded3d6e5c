"""The multi-turn sessions scenario of benchmarks.cluster (`--scenario sessions`): N sessions,
each with a context of its own (~2,000 tokens of distinct text) and a history that grows turn by
turn (each turn resends the history, the previous answer and a new user message), through the
router to the replicas, the replicas sharing one prefix-cache disk directory
(PAGEDLLAMA_CACHE_DIR), a fresh cluster per policy.

Every request names its session in the `X-Claude-Code-Session-Id` header (what Claude Code
sends) and in the front door's routing-key header, so the `session` policy keeps a session on
one replica; `least_conn` and `round_robin` ignore both. The policy string is
passed to cluster.launch as it is (a policy it does not know is reported as not run).

With `--kill-halfway`, after half the turns one replica's process group gets SIGKILL: the turn
before it is sent one session at a time, reading each replica's request counter, so that the
sessions that were on the killed replica are known; their next turn lands on a replica that did
not compute their history, and its cached share says whether that history came from the
shared disk tier (or was computed again). A failed turn is retried (a client would), and every
failed attempt counts as an error.

Per policy: the cached share of the prompt tokens of turns 2 and later (from the usage's
cached tokens), TTFT p50/p95 of those turns, output throughput, errors, each replica's
disk-tier hits, and for a kill run the moved sessions' next-turn cached share.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import RequestOutput, first_model, make_client, payload, send
from benchmarks.harness.options import CHAT
from benchmarks.harness.workload import by_policy, calibrate
from cluster.launch import ROUTING_KEY_HEADER, Cluster, ClusterSpec, free_cluster_port

SESSION_HEADER = "X-Claude-Code-Session-Id"
SUCCESS = "pagedllama:request_success_total"
RETRIES = 3            # attempts of a turn after a failed one
RETRY_WAIT_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--scenario sessions")
    g.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    g.add_argument("--turns", type=int, default=4, help="turns per session")
    g.add_argument("--context-tokens", type=int, default=2000,
                   help="tokens of each session's own context (its first message)")
    g.add_argument("--turn-tokens", type=int, default=48, help="tokens of each new user message")
    g.add_argument("--kill-halfway", action="store_true",
                   help="SIGKILL one replica's process group after half the turns")
    g.add_argument("--kill-replica", type=int, default=1, help="which replica (1-based)")
    g.add_argument("--no-shared-disk", action="store_true",
                   help="no PAGEDLLAMA_CACHE_DIR for the replicas (the comparison)")


@dataclass
class Session:
    sid: str
    context: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict]:
        out = [{"role": "user", "content": f"{self.context}\n\n{self.questions[0]}"}]
        for k in range(1, turn + 1):
            out += [{"role": "assistant", "content": self.answers[k - 1]},
                    {"role": "user", "content": self.questions[k]}]
        return out

    def headers(self) -> dict[str, str]:
        return {SESSION_HEADER: self.sid, ROUTING_KEY_HEADER: self.sid}


@dataclass
class Turn:
    session: int
    turn: int
    out: RequestOutput
    attempts: int
    replica: int | None = None   # known for the turn before a kill


def make_sessions(args, cal: ds.Calibration, seed: int) -> list[Session]:
    """Distinct text per session: no two sessions share a first block."""
    rng = random.Random(f"sessions:{seed}:{args.sessions}:{args.context_tokens}")
    words = cal.words_for(args.context_tokens, False)
    q_words = cal.words_for(args.turn_tokens, False)
    return [Session(f"session-{seed}-{i}", f"Case file {i + 1}. " + ds.random_text(rng, words),
                    [ds.question(rng, q_words) for _ in range(args.turns)])
            for i in range(args.sessions)]


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def disk_hits(url: str) -> int | None:
    try:
        health = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
    except httpx.HTTPError:
        return None   # a killed replica
    return int((health.get("prefix_cache_tiers") or {}).get("disk", {}).get("hits", 0))


class Run:
    """One policy's sessions through one cluster."""

    def __init__(self, args, cluster: Cluster, model: str, sessions: list[Session]):
        self.args, self.cluster, self.model, self.sessions = args, cluster, model, sessions
        self.url = cluster.spec.url + CHAT
        self.urls = [r.url for r in cluster.replicas]
        self.turns: list[Turn] = []
        self.errors: dict[str, int] = {}
        self.stopped: set[int] = set()    # sessions whose turn failed every attempt
        self.killed: int | None = None

    async def turn(self, client: httpx.AsyncClient, i: int, k: int) -> Turn | None:
        s = self.sessions[i]
        if i in self.stopped:
            return None
        body = payload(self.model, s.messages(k), True, self.args.output_len, True)
        for attempt in range(1, RETRIES + 2):
            out = await send(client, self.url, body, True, self.args.request_timeout,
                             headers=s.headers())
            if out.ok:
                s.answers.append(out.text)
                t = Turn(i, k, out, attempt)
                self.turns.append(t)
                return t
            key = out.error.split("\n")[0][:100]
            self.errors[key] = self.errors.get(key, 0) + 1
            await asyncio.sleep(RETRY_WAIT_S)
        self.stopped.add(i)
        return None

    async def concurrently(self, client, turns: range) -> None:
        async def session(i: int) -> None:
            for k in turns:
                if await self.turn(client, i, k) is None:
                    return
        await asyncio.gather(*(session(i) for i in range(len(self.sessions))))

    async def attributed(self, client, k: int) -> None:
        """Turn k, one session at a time, noting which replica served each (its counter)."""
        for i in range(len(self.sessions)):
            before = [metric_sum(u, SUCCESS) for u in self.urls]
            t = await self.turn(client, i, k)
            if t is not None:
                after = [metric_sum(u, SUCCESS) for u in self.urls]
                served = [j for j, (a, b) in enumerate(zip(after, before)) if a > b]
                t.replica = served[0] if len(served) == 1 else None

    def kill(self) -> None:
        j = self.args.kill_replica - 1
        proc = self.cluster.replicas[j].proc
        os.killpg(proc.pid, signal.SIGKILL)   # spawned in a session of its own
        proc.wait(timeout=30)
        self.killed = j

    async def run(self) -> float:
        turns, t0 = self.args.turns, time.perf_counter()
        async with make_client(len(self.sessions), self.args.request_timeout) as client:
            if not self.args.kill_halfway:
                await self.concurrently(client, range(turns))
            else:
                half = max(1, turns // 2)
                await self.concurrently(client, range(half - 1))
                await self.attributed(client, half - 1)
                self.kill()
                await self.concurrently(client, range(half, turns))
        return time.perf_counter() - t0


def share(turns: list[Turn]) -> float | None:
    prompt = sum(t.out.prompt_tokens for t in turns)
    return sum(t.out.cached_tokens or 0 for t in turns) / prompt if prompt else None


def report_of(run: Run, duration: float) -> dict:
    later = [t for t in run.turns if t.turn >= 1]
    ttft = np.asarray([t.out.ttft for t in later]) if later else np.zeros(1)
    out_tokens = sum(t.out.output_tokens for t in run.turns)
    report = {"turns_done": len(run.turns),
              "turns_planned": len(run.sessions) * run.args.turns,
              "cached_share_later_turns": share(later),
              "ttft_p50_later_s": float(np.percentile(ttft, 50)),
              "ttft_p95_later_s": float(np.percentile(ttft, 95)),
              "output_throughput": out_tokens / duration if duration > 0 else 0.0,
              "duration_s": duration, "errors": sum(run.errors.values()),
              "error_kinds": run.errors, "sessions_stopped": len(run.stopped),
              "disk_hits_per_replica": [disk_hits(u) for u in run.urls]}
    if run.killed is not None:
        before = {t.session: t for t in run.turns if t.replica is not None}
        moved = {i for i, t in before.items() if t.replica == run.killed}
        half = max(1, run.args.turns // 2)
        nxt = [t for t in run.turns if t.session in moved and t.turn == half]
        report.update(killed_replica=run.killed + 1, moved_sessions=len(moved),
                      unattributed=len(run.sessions) - len(before),
                      moved_next_turn_cached_share=share(nxt))
    return report


def replica_env(args, cache_dir: Path | None) -> dict[str, str]:
    longest = args.context_tokens + args.turns * (args.turn_tokens + args.output_len) + 128
    env = {"PAGEDLLAMA_THREADS": str(args.threads), "PAGEDLLAMA_LOG_LEVEL": "warning",
           "PAGEDLLAMA_N_CTX": str(max(2048, -(-int(longest * 1.2) // 256) * 256))}
    if cache_dir is not None:
        env["PAGEDLLAMA_CACHE_DIR"] = str(cache_dir)
        if args.context_tokens < 1024:   # a small (smoke) context is still saved
            env["PAGEDLLAMA_CACHE_MIN_TOKENS"] = str(max(64, args.context_tokens // 2))
    return env


def run_policy(policy: str, args, seed: int) -> dict:
    cache_dir = (None if args.no_shared_disk
                 else Path(tempfile.mkdtemp(prefix="pagedllama-sessions-cache-")))
    spec = ClusterSpec(replicas=args.replicas, policy=policy,
                       port=free_cluster_port(args.replicas),
                       replica_env=replica_env(args, cache_dir),
                       router_args=args.router_args.split(), pin=not args.no_pin)
    try:
        with Cluster(spec) as cluster:
            url = spec.url
            model = first_model(cluster.replicas[0].url)
            cal = asyncio.run(calibrate(url, CHAT, model, seed))
            run = Run(args, cluster, model, make_sessions(args, cal, seed))
            duration = asyncio.run(run.run())
            report = report_of(run, duration)
    except ValueError as exc:   # a policy cluster.launch does not know (yet)
        return {"policy": policy, "not_run": str(exc)}
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    report["policy"] = policy
    return report


def line(r: dict) -> str:
    if "not_run" in r:
        return f"{r['policy']:<13} not run: {r['not_run']}"

    def pct(x):
        return "-" if x is None else f"{x * 100:.0f}%"
    text = (f"{r['policy']:<13} {pct(r['cached_share_later_turns']):>7} "
            f"{r['ttft_p50_later_s']:>8.2f}s {r['ttft_p95_later_s']:>8.2f}s "
            f"{r['output_throughput']:>9.1f} {r['errors']:>6} "
            f"{r['turns_done']}/{r['turns_planned']:<6} disk hits {r['disk_hits_per_replica']}")
    if "killed_replica" in r:
        text += (f"; replica {r['killed_replica']} killed: {r['moved_sessions']} sessions "
                 f"moved, next-turn cached {pct(r['moved_next_turn_cached_share'])}")
    return text


def run(args) -> dict:
    return by_policy(args, run_policy, line)


def summary_table(result: dict, args) -> str:
    head = (f"{args.sessions} sessions x {args.turns} turns, ~{args.context_tokens}-token "
            f"contexts, {args.turn_tokens}-token messages, {args.output_len} out; "
            f"{args.replicas} replicas x {args.threads} thread(s)"
            + ("" if args.no_shared_disk else ", one shared disk tier")
            + (f", replica {args.kill_replica} killed after {max(1, args.turns // 2)} turns"
               if args.kill_halfway else ""))
    cols = (f"{'policy':<13} {'cached':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'out tok/s':>9} "
            f"{'errors':>6} turns   (cached share and TTFT of turns >= 2)")
    return "\n".join([head, cols] + [line(r) for runs in result["runs"].values() for r in runs])
