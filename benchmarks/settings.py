"""Engine settings side by side without HTTP: our scheduler and llama.cpp context (engine/worker.py)
in this process, one per --set of PAGEDLLAMA_* settings, driven by a closed loop of concurrent
requests in rounds that alternate between them (docs/benchmarks.md, "settings").

    python -m benchmarks.settings --set MAX_SEQS=16 --set MAX_SEQS=10 --concurrency 16
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

from benchmarks.harness.datasets import token_dataset
from benchmarks.harness.metrics import finish, ruled, stats_ms
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import alternate
from engine.config import EngineConfig
from engine.model import Model
from engine.request import Request
from engine.sampling import SamplingParams
from engine.worker import Worker
from server import config as server_config

DEFAULTS = {"THREADS": "2", "ADAPTIVE_THREADS": "0", "N_CTX": "512"}


def parse_setting(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().upper().removeprefix("PAGEDLLAMA_")
        if not sep or not name or not value.strip():
            raise ValueError(f"{part!r}: expected NAME=VALUE")
        out[name] = value.strip()
    return out


def engine_config(setting: dict[str, str]) -> EngineConfig:
    """The server's EngineConfig for these PAGEDLLAMA_* values (and DEFAULTS), as if from the
    environment; the process's own PAGEDLLAMA_* variables are ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLAMA_")}
    env.update({f"PAGEDLLAMA_{k}": v for k, v in {**DEFAULTS, **setting}.items()})
    read: set[str] = set()
    env_reader = server_config._env

    def recording_env(name: str, default: str) -> str:   # which names engine_from_env reads
        read.add(name)
        return env_reader(name, default)
    with mock.patch.dict(os.environ, env, clear=True), \
            mock.patch.object(server_config, "_env", recording_env):
        config = server_config.engine_from_env()
    unknown = sorted(set(setting) - read)
    if unknown:
        raise ValueError(f"not an engine setting: {', '.join(unknown)} "
                         f"(engine settings: {', '.join(sorted(read))})")
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.settings", __doc__, "model")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=V,...",
                   help="one configuration (repeat; an empty string is the defaults)")
    add(p, "concurrency", "num_prompts", "input_len", input_len=94,
        num_prompts={"help": "requests per round"})
    p.add_argument("--shared-head", type=int, default=30, help="leading tokens every prompt shares")
    add(p, "output_len", "rounds", "seed", "result_file", rounds=2)
    args = p.parse_args(argv)
    try:
        args.configs = [parse_setting(s) for s in (args.settings or [""])]
        for c in args.configs:
            engine_config(c)
    except ValueError as e:
        p.error(str(e))
    if not (1 <= args.concurrency <= 256 and args.num_prompts >= 1 and args.output_len >= 1
            and 1 <= args.rounds <= 20 and 0 <= args.shared_head < args.input_len):
        p.error("need --concurrency in [1, 256], --num-prompts >= 1, --output-len >= 1, "
                "--rounds in [1, 20], 0 <= --shared-head < --input-len")
    return args


async def _one(worker: Worker, prompt: list[int], output_len: int) -> dict:
    req = Request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    sent = time.monotonic()
    queue = worker.submit(req)
    times: list[float] = []
    while True:
        event = await queue.get()
        if event.error:
            raise RuntimeError(f"request failed: {event.error}")
        times += [time.monotonic()] * event.num_tokens
        if event.finish_reason is not None:
            break
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - sent, "itl": sum(gaps) / len(gaps) if gaps else 0.0,
            "gaps": gaps, "tokens": len(times)}


async def run_round(worker: Worker, prompts: list[list[int]], args) -> dict:
    pending, done = iter(prompts), []

    async def lane():
        for prompt in pending:
            done.append(await _one(worker, prompt, args.output_len))
    start = time.monotonic()
    await asyncio.gather(*(lane() for _ in range(args.concurrency)))
    seconds = time.monotonic() - start
    ttft = stats_ms([r["ttft"] for r in done], "ttft")
    itl = stats_ms([r["itl"] for r in done], "itl")
    gap = stats_ms([g for r in done for g in r["gaps"]], "gap")
    tokens = sum(r["tokens"] for r in done)
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "requests": len(done), "ttft_p50_ms": ttft["median_ttft_ms"],
            "ttft_p99_ms": ttft["p99_ttft_ms"], "itl_p50_ms": itl["median_itl_ms"],
            "gap_p99_ms": gap["p99_gap_ms"]}


def prompts_for(args, n_vocab: int, round_no: int) -> list[list[int]]:
    head = token_dataset(1, args.shared_head, n_vocab, args.seed)[0] if args.shared_head else []
    tails = token_dataset(args.num_prompts, args.input_len - args.shared_head, n_vocab,
                          args.seed + 1 + round_no)
    return [head + t for t in tails]


async def run(args) -> list[dict]:
    model = Model(args.model)
    workers = [Worker(f"set{i}", model, engine_config(c)) for i, c in enumerate(args.configs)]
    for w in workers:
        w.start()
    try:
        results = [{"setting": c, "rounds": []} for c in args.configs]
        order = list(range(len(workers)))
        for r in range(args.rounds):
            prompts = prompts_for(args, model.n_vocab, r)
            for i in alternate(order, r):
                out = await run_round(workers[i], prompts, args)
                results[i]["rounds"].append(out)
                print(f"round {r + 1} {label(args.configs[i])}: {out['output_tok_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.stop()
    for res in results:
        rounds = res["rounds"]
        for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "gap_p99_ms"):
            res[key] = statistics.median(x[key] for x in rounds)
    return results


def label(setting: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "(defaults)"


def table(results: list[dict]) -> str:
    width = max(10, *(len(label(r["setting"])) for r in results))
    head = (f"{'setting':<{width}} {'tok/s per round':>20} {'median':>7} {'vs first':>8} "
            f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'gap p99':>8}")
    first = results[0]["output_tok_s"]

    def row(r: dict) -> str:
        per = ", ".join(f"{x['output_tok_s']:.1f}" for x in r["rounds"])
        return (f"{label(r['setting']):<{width}} {per:>20} {r['output_tok_s']:>7.1f} "
                f"{r['output_tok_s'] / first:>7.2f}x {r['ttft_p50_ms']:>7.0f}ms "
                f"{r['ttft_p99_ms']:>6.0f}ms {r['itl_p50_ms']:>6.0f}ms {r['gap_p99_ms']:>6.0f}ms")
    return ruled(head, [row(r) for r in results])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    config = {k: v for k, v in vars(args).items() if k != "configs"}
    finish(f"engine settings · {Path(args.model).name} · closed loop, {args.concurrency} "
           f"concurrent, {args.num_prompts} requests a round, in {args.input_len} (shared head "
           f"{args.shared_head}) / out {args.output_len} tokens · {args.rounds} rounds\n"
           + table(results), {"config": config, "results": results}, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
