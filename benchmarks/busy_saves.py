"""What copying finished turns' prefixes to the cache tiers costs the streams that run meanwhile
(scheduler/save_pacing.py): one context on the real model, --streams long streams decoding and
--turns requests with --turn-len-token prompts (distinct) finishing beside them one after another,
once with copies between steps (the pacer on) and once without (target 0: copies wait for idle
time). Per run: the copies made while busy, a copy's seconds (and per token), the largest step
plus copy, the mean wall time between two steps of the streams, and the snapshot files written
before the streams ended.

    nice -n 19 python -m benchmarks.busy_saves [--streams 4] [--turns 4] [--turn-len 1500]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.launch import DEFAULT_MODEL
from engine import EngineConfig, Model, Request, SamplingParams, Worker
from kvcache import PrefixStore


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser("benchmarks.busy_saves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-len", type=int, default=400, help="tokens each stream decodes")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=1500, help="prompt tokens of each turn")
    return p.parse_args(argv)


async def one_run(worker: Worker, model: Model, args, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = range(1000, min(model.n_vocab, 20000))

    def prompt(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    streams = [Request(prompt(32), SamplingParams(max_tokens=args.stream_len, temperature=0,
                                                  ignore_eos=True))
               for _ in range(args.streams)]
    queues = [worker.submit(r) for r in streams]
    gaps: list[float] = []
    tiers = worker.context.tiers
    assert tiers is not None
    written: list[int] = []   # turns saved when the first stream ended

    async def follow(q) -> None:
        last = None
        while True:
            event = await q.get()
            now = time.perf_counter()
            if last is not None and event.text:
                gaps.append(now - last)
            last = now
            if event.finish_reason:
                written.append(tiers.store.counts["ram"].written)
                return

    followers = [asyncio.create_task(follow(q)) for q in queues]
    await asyncio.sleep(1.0)
    for _ in range(args.turns):
        q = worker.submit(Request(prompt(args.turn_len), SamplingParams(max_tokens=4,
                                                                        temperature=0)))
        while not (await q.get()).finish_reason:
            pass
    await asyncio.gather(*followers)
    return {"written_before_streams_ended": min(written),
            "mean_gap_s": sum(gaps) / len(gaps) if gaps else 0.0,
            "max_gap_s": max(gaps, default=0.0)}


def run(args, busy: bool, directory: Path, seed: int) -> dict:
    model = Model(Path(args.model))
    store = PrefixStore(ram_limit=1 << 30, disk_dir=directory, disk_limit=1 << 32,
                        min_tokens=512)
    cfg = EngineConfig(n_ctx=args.turn_len + 512, max_seqs=args.streams + 2,
                       n_threads=args.threads, max_batch_tokens=256)
    worker = Worker("busy-saves", model, cfg, tiers=store)
    if not busy:
        worker.pacer.target_s = 0.0     # copies only after a second of idle time
    worker.start()
    try:
        out = asyncio.run(one_run(worker, model, args, seed))
    finally:
        pacer = worker.pacer
        worker.stop()
        store.close()
        model.close()
    out.update(busy=busy, copies=pacer.copies,
               copy_s=pacer.copy_s / pacer.copies if pacer.copies else 0.0,
               token_us=pacer.token_s * 1e6, max_step_plus_copy_s=pacer.max_gap_s)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for busy in (True, False):
        with tempfile.TemporaryDirectory(prefix="pagedllama-busy-saves-") as d:
            r = run(args, busy, Path(d), seed=1)
        print(f"{'copies between steps' if busy else 'idle-time copies only':<22}: "
              f"{r['copies']} copies while busy, {r['copy_s'] * 1000:.0f} ms each "
              f"({r['token_us']:.0f} us a token), largest step + copy "
              f"{r['max_step_plus_copy_s'] * 1000:.0f} ms; the streams' gap between two tokens "
              f"{r['mean_gap_s'] * 1000:.0f} ms mean, {r['max_gap_s'] * 1000:.0f} ms max; "
              f"{r['written_before_streams_ended']} of {args.turns} turns saved before the "
              f"streams ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
