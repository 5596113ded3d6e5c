"""Running a workload against a server: prompt calibration, warm-up, conversations sent at a
rate or all at once with a bound on requests in flight, and the shared start and end of the
client-side benchmarks (`serve`, `interference`, `repeat`)."""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
from tqdm import tqdm

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import (
    NotLoopback,
    RequestOutput,
    check_loopback,
    complete,
    first_model,
    make_client,
    payload,
    send,
)
from benchmarks.harness.metrics import finish, summarize

MAX_PROMPTS = 10_000
MAX_CONCURRENCY = 256

T = TypeVar("T", bound=Sequence)


def alternate(order: T, i: int) -> T:
    """The order of side-by-side runs: as given in even rounds, reversed in odd ones (A B, B A,
    A B, ...), so that a machine whose speed drifts slows every side alike."""
    return order if i % 2 == 0 else order[::-1]


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def request_input(conv: ds.Conversation, turn: int, chat: bool):
    return ds.chat_messages(conv, turn) if chat else ds.completion_prompt(conv, turn)


async def calibrate(base_url: str, endpoint: str, model: str, seed: int = 0,
                    words: tuple[int, int] = (32, 256)) -> ds.Calibration:
    """Two probes of known word counts through the same endpoint give tokens per word and the
    fixed overhead (template, BOS) from usage.prompt_tokens; without usage: the approximation."""
    chat, rng = is_chat(endpoint), random.Random(f"calibrate:{seed}")
    counts = []
    async with make_client(2, 120.0) as client:
        for n in words:
            conv = ds.Conversation([ds.random_text(rng, n)])
            body = payload(model, request_input(conv, 0, chat), chat, 1, False, stream=False)
            try:
                usage = (await complete(client, base_url + endpoint, body)).get("usage") or {}
            except Exception:   # noqa: BLE001 - any failure means: use the approximation
                usage = {}
            if not usage.get("prompt_tokens"):
                return ds.Calibration()
            counts.append(int(usage["prompt_tokens"]))
    per_word = (counts[1] - counts[0]) / (words[1] - words[0])
    if per_word <= 0:
        return ds.Calibration()
    return ds.Calibration(per_word, counts[0] - per_word * words[0], "probe")


async def run_workload(base_url: str, endpoint: str, model: str,
                       conversations: list[ds.Conversation], *, max_concurrency: int,
                       request_rate: float = math.inf, output_len: int = 64,
                       ignore_eos: bool = False, temperature: float = 0.0, seed: int = 0,
                       request_timeout: float = 600.0, time_limit: float = 1800.0,
                       progress: bool = True, desc: str = "requests",
                       extra_body: dict | None = None,
                       headers_for: Callable[[ds.Conversation], dict[str, str]] | None = None,
                       ) -> tuple[dict, list[RequestOutput]]:
    """Conversations arrive as a Poisson process (request_rate per second; inf = all at once);
    each turn waits for a free slot of max_concurrency; `headers_for(conversation)` gives the
    HTTP headers of its requests. Returns (report, outputs)."""
    chat, url = is_chat(endpoint), base_url + endpoint
    n_requests = sum(len(c.user_turns) for c in conversations)
    if n_requests > MAX_PROMPTS:
        raise ValueError(f"{n_requests} requests: at most {MAX_PROMPTS}")
    max_concurrency = max(1, min(max_concurrency, MAX_CONCURRENCY))
    rng = random.Random(seed + 104729)
    arrivals, t = [], 0.0
    for _ in conversations:
        arrivals.append(t)
        if math.isfinite(request_rate) and request_rate > 0:
            t += rng.expovariate(request_rate)
    outputs: list[RequestOutput] = []
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=n_requests, desc=desc, unit="req", disable=not progress, file=sys.stderr,
               leave=False)
    start = time.perf_counter()
    deadline = start + time_limit

    async def conversation(conv: ds.Conversation, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        for turn in range(len(conv.user_turns)):
            async with sem:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                body = payload(model, request_input(conv, turn, chat), chat, output_len,
                               ignore_eos, temperature, extra=extra_body)
                out = await send(client, url, body, chat, min(request_timeout, left),
                                 headers=headers_for(conv) if headers_for else None)
            outputs.append(out)
            bar.update(1)
            if not out.ok:
                return
            conv.answers.append(out.text)

    async with make_client(max_concurrency, request_timeout) as client:
        await asyncio.gather(*(conversation(c, a) for c, a in zip(conversations, arrivals)))
    duration = max((o.end for o in outputs), default=start) - start
    bar.close()
    report = summarize(outputs, duration)
    rate = request_rate if math.isfinite(request_rate) else "inf"   # JSON has no infinity
    report.update(max_concurrency=max_concurrency, request_rate=rate,
                  planned=n_requests, requests=[o.record() for o in outputs])
    return report, outputs


async def prepare(args: argparse.Namespace) -> tuple[str, str, ds.Calibration]:
    """The checked base URL, the model, warm-up requests, and the calibration --calibrate asks
    for: what every client-side benchmark does first."""
    base = check_loopback(args.base_url)
    model = args.model or first_model(base)
    await warmup(base, args.endpoint, model, args.warmup, args.seed)
    cal = (await calibrate(base, args.endpoint, model, args.seed) if args.calibrate == "probe"
           else ds.Calibration())
    return base, model, cal


async def warmup(base_url: str, endpoint: str, model: str, n: int, seed: int) -> None:
    if n <= 0:
        return
    convs = ds.random_dataset(n, 32, ds.Calibration(), seed, "warmup")
    await run_workload(base_url, endpoint, model, convs, max_concurrency=n, output_len=8,
                       ignore_eos=True, request_timeout=120.0, time_limit=300.0,
                       progress=False)


async def run_scenario(args: argparse.Namespace, scenario: Callable[..., Awaitable[dict]],
                       **kwargs) -> dict:
    """prepare(), then scenario(base, endpoint, model, calibration, **kwargs); the result
    carries the configuration and the calibration."""
    base, model, cal = await prepare(args)
    r = await scenario(base, args.endpoint, model, cal, **kwargs)
    r.update(config={**vars(args), "model": model}, calibration=vars(cal))
    return r


def client_main(args: argparse.Namespace, run: Callable[[argparse.Namespace], Awaitable[dict]],
                show: Callable[[dict], str]) -> int:
    """Run against a server named by --base-url, print show(result) and write --result-file;
    exit 2 when the server is not loopback or not reachable, 1 when a request failed."""
    try:
        r = asyncio.run(run(args))
    except (NotLoopback, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finish(show(r), r, args.result_file)
    return 0 if r["failed"] == 0 else 1


def by_policy(args, run_policy, describe) -> dict:
    """`args.rounds` alternations of the comma-separated `args.policies`, each run by
    run_policy(policy, args, seed) (a report dict); `describe(report)` says one on stderr."""
    import sys
    policies = args.policies.split(",")
    result: dict = {"config": vars(args).copy(), "runs": {p: [] for p in policies}}
    for r in range(args.rounds):
        for policy in policies:
            report = run_policy(policy, args, args.seed + r)
            result["runs"][policy].append(report)
            print(f"round {r + 1} {describe(report)}", file=sys.stderr, flush=True)
    return result
