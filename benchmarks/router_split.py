"""How sglang-router's cache_aware policy spreads shared prefixes over replicas, without a model.

benchmarks.cluster's workload (its --num-prefixes system prompts in the order its --seed
shuffles, --concurrency at a time) sent through the router to stand-in workers that answer at
once (after --delay seconds) and note which system prompt each request carried. Each burst gets
a fresh router and workers; printed per seed: how the requests split between the workers and
whether any prefix reached more than one. A run takes seconds, so the router's behaviour can be
counted over many arrival orders, which the model-backed benchmark (a minute a run) cannot.

    python -m benchmarks.router_split --seeds 0-9 --bursts 4
    python -m benchmarks.router_split --seeds 0-9 --bursts 4 --router-threads 1
    python -m benchmarks.router_split --seeds 0-9 --bursts 1 --concurrency 1
    python -m benchmarks.router_split --concurrency 1 --router-args "--cache-threshold 0.99"

--router-threads sets TOKIO_WORKER_THREADS for the router (its runtime's worker threads; by
default one per core): with 1, requests are routed one at a time. --concurrency 1 sends the
requests one after another (each new prefix then arrives at idle workers); --router-args passes
more router flags.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from benchmarks import datasets as ds
from benchmarks.cluster import conversations
from cluster.launch import ClusterSpec, free_cluster_port, router_command
from cluster.processes import spawn, stop, wait_http

MODEL = "stand-in"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0-3", help="a range (0-9) or a list (0,3,9)")
    p.add_argument("--bursts", type=int, default=2, help="runs per seed")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--shared-len", type=int, default=500)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--delay", type=float, default=0.3, help="seconds a stand-in takes to answer")
    p.add_argument("--router-threads", type=int, default=None)
    p.add_argument("--router-args", default="",
                   help='more router flags, e.g. "--cache-threshold 0.99"')
    p.add_argument("--serve", nargs=2, metavar=("PORT", "LOG"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def stand_in(log: Path, delay: float):
    """A worker that answers sglang-router's probes and chat completions, and appends each
    request's prefix tag (the system prompt's first sentence) to `log`."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {"served_model_name": MODEL, "models": [MODEL]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"is_generation": True}

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = await http.json()
        with log.open("a") as f:
            f.write(body["messages"][0]["content"].split(".")[0].replace(" ", "_") + "\n")
        await asyncio.sleep(delay)
        return {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


def serve(port: int, log: Path, delay: float) -> None:
    import uvicorn
    uvicorn.run(stand_in(log, delay), host="127.0.0.1", port=port, log_level="error")


async def send_all(url: str, convs: list[ds.Conversation], concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False) as client:
        async def one(conv: ds.Conversation) -> None:
            async with limit:
                messages = [{"role": "system", "content": conv.system},
                            {"role": "user", "content": conv.user_turns[0]}]
                r = await client.post("/v1/chat/completions",
                                      json={"model": MODEL, "messages": messages, "max_tokens": 1})
                r.raise_for_status()
        await asyncio.gather(*[one(c) for c in convs])


def burst(args, convs: list[ds.Conversation], workdir: Path) -> list[collections.Counter]:
    """One fresh router and set of stand-ins, the whole workload; per worker, its prefix tags."""
    port = free_cluster_port(args.replicas)
    spec = ClusterSpec(replicas=args.replicas, policy="cache_aware", port=port,
                       router_args=args.router_args.split())
    logs = [workdir / f"worker-{i}.txt" for i in range(args.replicas)]
    env = dict(os.environ)
    if args.router_threads is not None:
        env["TOKIO_WORKER_THREADS"] = str(args.router_threads)
    procs: list[subprocess.Popen] = []
    try:
        for p, log in zip(spec.replica_ports(), logs):
            log.write_text("")
            procs.append(spawn([sys.executable, "-m", "benchmarks.router_split", "--serve",
                                str(p), str(log), "--delay", str(args.delay)],
                               dict(os.environ), None, cwd=Path(__file__).resolve().parent.parent))
        for p, proc in zip(spec.replica_ports(), procs):
            wait_http(f"http://127.0.0.1:{p}/health", proc, 30.0, "a stand-in worker")
        router = spawn(router_command(spec), env, workdir / "router.log")
        procs.insert(0, router)
        wait_http(f"{spec.url}/readiness", router, 60.0, "the router")
        asyncio.run(send_all(spec.url, convs, args.concurrency))
    finally:
        stop(procs)
    return [collections.Counter(log.read_text().split()) for log in logs]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), Path(args.serve[1]), args.delay)
        return
    threads = args.router_threads or os.environ.get("TOKIO_WORKER_THREADS", "one per core")
    flags = f"; {args.router_args}" if args.router_args else ""
    print(f"sglang-router cache_aware, {args.replicas} stand-in workers, router worker threads: "
          f"{threads}{flags}; {args.num_prefixes} x ~{args.shared_len}-token prefixes, "
          f"{args.num_prompts} requests, {args.concurrency} concurrent")
    even = total = 0
    with tempfile.TemporaryDirectory(prefix="router-split-") as tmp:
        for seed in seeds_of(args.seeds):
            convs = conversations(args, seed)
            splits = []
            for _ in range(args.bursts):
                per = burst(args, convs, Path(tmp))
                counts = [sum(c.values()) for c in per]
                on_several = sum(1 for tag in set().union(*per) if sum(c[tag] > 0 for c in per) > 1)
                prefixes = [len(c) for c in per]
                splits.append(f"{'/'.join(map(str, counts))}"
                              + (f" ({on_several} prefix(es) on several)" if on_several else ""))
                total += 1
                even += len(set(prefixes)) == 1 and not on_several
            print(f"seed {seed}: requests per worker {', '.join(splits)}")
    print(f"prefixes spread evenly in {even} of {total} bursts")


if __name__ == "__main__":
    main()
