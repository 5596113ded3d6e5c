"""The prefix cache's RAM and disk tiers, side by side in one run, each figure next to its target:

- restart: a --long-len-token prompt cold, then the same document after the server restarted
  on the same PAGEDLLAMA_CACHE_DIR (TTFT ratio, target <= 0.1x);
- unload: the same after the model was unloaded (POST /models/{id}/unload) and loaded again by
  the next request, RAM tier only (TTFT ratio, load included, target <= 0.1x);
- sessions: --sessions agent-like sessions (a --shared-len-token system prompt, histories
  growing by a message and an answer a turn) through --seq-ids sequence ids, with the tiers and
  without: the share of each later turn's prompt read from a cache (target >= 95 %);
- short chats: short multi-turn chats, tiers on and off alternated (output tokens/s ratio,
  target >= 0.98x);
- restore rates: tokens/s restored from disk and from RAM, against computing them.

    python -m benchmarks.tiers [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model, make_client, payload, send
from benchmarks.harness.launch import DEFAULT_MODEL, launched, our_server
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import run_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.tiers", __doc__, "threads")
    p.add_argument("--long-len", type=int, default=7000, help="tokens of the long prompt")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--seq-ids", type=int, default=8, help="PAGEDLLAMA_MAX_SEQS of the sessions")
    p.add_argument("--shared-len", type=int, default=2000,
                   help="tokens of the sessions' shared system prompt")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--chats", type=int, default=48, help="short chat requests per round")
    p.add_argument("--parts", default="restart,unload,sessions,chats")
    add(p, "rounds", "seed", "quick", "result_file",
        rounds={"help": "on/off alternations of the short chats", "default": 2})
    args = p.parse_args(argv)
    if args.quick:
        args.long_len, args.sessions, args.seq_ids, args.shared_len = 1500, 6, 2, 600
        args.turns, args.chats, args.rounds = 2, 8, 1
    return args


def words_for(tokens: int) -> int:
    return ds.Calibration().words_for(tokens, with_overhead=False)


async def ask(base: str, model: str, system: str, user: str, max_tokens: int = 4,
              history: list[dict] | None = None):
    messages = [{"role": "system", "content": system}, *(history or []),
                {"role": "user", "content": user}]
    async with make_client(1, 1200.0) as client:
        out = await send(client, base + CHAT, payload(model, messages, True, max_tokens, False),
                         True, 1200.0)
    if not out.ok:
        raise RuntimeError(out.error)
    return out


def tiers_of(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=30).json()["prefix_cache_tiers"]


def row(out) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
            "ttft_s": out.ttft}


def restart(args, cache_dir: Path) -> dict:
    """Cold, then after a restart on the same directory (another question: the document is
    what was saved)."""
    doc = "Report. " + ds.random_text(random.Random(f"tiers:{args.seed}"),
                                      words_for(args.long_len))
    env = {"PAGEDLLAMA_CACHE_DIR": str(cache_dir), "PAGEDLLAMA_MAX_SEQS": "2"}
    spec = our_server(threads=args.threads, n_ctx=args.long_len + 512, env=env)
    with launched(spec) as base:
        model = first_model(base)
        cold = asyncio.run(ask(base, model, doc, "Summarize the report."))
    spec = our_server(threads=args.threads, n_ctx=args.long_len + 512, env=env)
    with launched(spec) as base:
        warm = asyncio.run(ask(base, model, doc, "List its main words."))
        tiers = tiers_of(base)
    return {"cold": row(cold), "restarted": row(warm), "ratio": warm.ttft / cold.ttft,
            "tiers": tiers}


def unload(args) -> dict:
    """Cold, unload, then the same document again (the request loads the model)."""
    doc = "Memo. " + ds.random_text(random.Random(f"tiers-unload:{args.seed}"),
                                    words_for(args.long_len))
    with tempfile.TemporaryDirectory() as d:
        models = Path(d) / "models.yaml"
        models.write_text(f"models:\n  - name: m\n    path: {Path(DEFAULT_MODEL).resolve()}\n"
                          "    pin: false\n    keep_alive: -1\n")
        spec = our_server(threads=args.threads, n_ctx=args.long_len + 512,
                          env={"PAGEDLLAMA_MODELS_FILE": str(models),
                               "PAGEDLLAMA_MAX_SEQS": "2"})
        with launched(spec) as base:
            cold = asyncio.run(ask(base, "m", doc, "Summarize the memo."))
            r = httpx.post(f"{base}/models/m/unload", timeout=60)
            r.raise_for_status()
            deadline = time.monotonic() + 60
            while httpx.get(f"{base}/health", timeout=10).json()["models"]["m"]["loaded"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the model did not unload")
                time.sleep(0.2)
            warm = asyncio.run(ask(base, "m", doc, "List its main words."))
            tiers = tiers_of(base)
    return {"cold": row(cold), "reloaded": row(warm), "ratio": warm.ttft / cold.ttft,
            "tiers": tiers}


async def session_turns(base: str, model: str, args) -> list[dict]:
    """Every session takes a turn, then the next round of turns: between two turns of one
    session the others run, so with more sessions than sequence ids its cells leave the KV
    streams. Requests run --seq-ids at a time."""
    rng = random.Random(f"tiers-sessions:{args.seed}")
    system = "You are a coding agent. " + ds.random_text(rng, words_for(args.shared_len))
    histories: list[list[dict]] = [[] for _ in range(args.sessions)]
    rows = []
    gate = asyncio.Semaphore(args.seq_ids)

    async def turn(i: int, t: int) -> None:
        user = f"Session {i}, step {t}: " + ds.question(rng, 60)
        async with gate:
            out = await ask(base, model, system, user, 24, histories[i])
        histories[i] += [{"role": "user", "content": user},
                         {"role": "assistant", "content": out.text}]
        rows.append({"session": i, "turn": t, **row(out)})

    for t in range(args.turns):
        await asyncio.gather(*[turn(i, t) for i in range(args.sessions)])
    return rows


def sessions(args, cache_dir: Path) -> dict:
    result = {}
    for mode, env in (("tiers", {"PAGEDLLAMA_CACHE_DIR": str(cache_dir / "sessions")}),
                      ("streams only", {"PAGEDLLAMA_CACHE_RAM": "0"})):
        env = {**env, "PAGEDLLAMA_MAX_SEQS": str(args.seq_ids)}
        n_ctx = args.shared_len + args.turns * 200 + 512
        with launched(our_server(threads=args.threads, n_ctx=n_ctx, env=env)) as base:
            t0 = time.perf_counter()
            rows = asyncio.run(session_turns(base, first_model(base), args))
            seconds = time.perf_counter() - t0
        later = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["turn"] > 0]
        result[mode] = {"rows": rows, "seconds": seconds,
                        "later_median": statistics.median(later), "later_min": min(later),
                        "later_ttft_median_s": statistics.median(
                            r["ttft_s"] for r in rows if r["turn"] > 0)}
    return result


def chats(args, cache_dir: Path) -> dict:
    """Short multi-turn chats (prompts under the tiers' minimum: they are never saved), tiers
    on and off alternated."""
    convs = ds.chat_dataset(args.chats, 64, 3, ds.Calibration(), args.seed)
    out: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            env = ({"PAGEDLLAMA_CACHE_DIR": str(cache_dir / "chats")} if mode == "on"
                   else {"PAGEDLLAMA_CACHE_RAM": "0"})
            with launched(our_server(threads=args.threads, env=env)) as base:
                report, _ = asyncio.run(run_workload(
                    base, CHAT, first_model(base), convs, max_concurrency=8, output_len=32,
                    ignore_eos=True, seed=args.seed + r, desc=f"chats ({mode})"))
                out[mode].append(report["output_throughput"])
    on, off = statistics.median(out["on"]), statistics.median(out["off"])
    return {"throughput": out, "on": on, "off": off, "ratio": on / off}


def rates(result: dict) -> dict:
    """Tokens/s restored per tier (lookup, read, check and load), and the cold prompt's
    tokens/s computing them."""
    rates = {}
    for part in ("restart", "unload"):
        for tier, counts in result.get(part, {}).get("tiers", {}).items():
            if isinstance(counts, dict) and counts.get("restore_s"):
                rates[tier] = counts["tokens"] / counts["restore_s"]
    if "restart" in result:
        cold = result["restart"]["cold"]
        rates["compute"] = cold["prompt_tokens"] / cold["ttft_s"]
    return rates


def summary(result: dict, args) -> str:
    lines = []
    if "restart" in result:
        r = result["restart"]
        lines.append(f"restart: {r['cold']['prompt_tokens']}-token prompt cold TTFT "
                     f"{r['cold']['ttft_s']:.2f} s; after a restart {r['restarted']['ttft_s']:.2f}"
                     f" s ({r['restarted']['cached_tokens']} cached) = {r['ratio']:.3f}x   "
                     "(target <= 0.1x)")
    if "unload" in result:
        r = result["unload"]
        lines.append(f"unload: cold TTFT {r['cold']['ttft_s']:.2f} s; after unload and reload "
                     f"{r['reloaded']['ttft_s']:.2f} s, load included "
                     f"({r['reloaded']['cached_tokens']} cached) = {r['ratio']:.3f}x   "
                     "(target <= 0.1x)")
    if "sessions" in result:
        lines.append(f"sessions: {args.sessions} x ({args.shared_len}-token system prompt, "
                     f"{args.turns} turns) through {args.seq_ids} sequence ids; later turns' "
                     "prompt from a cache (target >= 95 %):")
        for mode, s in result["sessions"].items():
            lines.append(f"  {mode:13} median {100 * s['later_median']:.1f} %, lowest "
                         f"{100 * s['later_min']:.1f} %, later turns' TTFT median "
                         f"{s['later_ttft_median_s']:.2f} s, all turns {s['seconds']:.0f} s")
    if "chats" in result:
        c = result["chats"]
        lines.append(f"short chats: output tok/s tiers on {c['on']:.1f} vs off {c['off']:.1f} "
                     f"= {c['ratio']:.3f}x   (target >= 0.98x)")
    r = rates(result)
    if r:
        lines.append("restore rates (tokens/s): " + ", ".join(
            f"{k} {v:,.0f}" for k, v in r.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"config": vars(args).copy()}
    with tempfile.TemporaryDirectory(prefix="pagedllama-tiers-") as d:
        cache_dir = Path(d)
        if "restart" in parts:
            result["restart"] = restart(args, cache_dir / "restart")
        if "unload" in parts:
            result["unload"] = unload(args)
        if "sessions" in parts:
            result["sessions"] = sessions(args, cache_dir)
        if "chats" in parts:
            result["chats"] = chats(args, cache_dir)
    result["rates"] = rates(result)
    print(summary(result, args))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
