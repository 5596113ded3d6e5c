"""Serving benchmark for an OpenAI-compatible server, modelled on `vllm bench serve`.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --dataset random \
        --num-prompts 64 --max-concurrency 16 --input-len 64 --output-len 64 --ignore-eos

Every request streams (SSE); TTFT is the time to the first chunk with text, ITL the gaps between
text chunks, TPOT (E2E − TTFT)/(output tokens − 1). Token counts come from the server's usage
(stream_options.include_usage); a server that sends none is counted one token per chunk.
Bounded: at most MAX_PROMPTS requests, --request-timeout per request, --time-limit in all, and
only loopback servers.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmarks import datasets as ds
from benchmarks.client import (NotLoopback, RequestOutput, add_target_args, check_loopback, complete,
                               first_model, make_client, payload, send)
from benchmarks.metrics import summarize, table, write_result

MAX_PROMPTS = 10_000
MAX_CONCURRENCY = 256


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def request_input(conv: ds.Conversation, turn: int, chat: bool):
    return ds.chat_messages(conv, turn) if chat else ds.completion_prompt(conv, turn)


# ---- calibration --------------------------------------------------------------------------------
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


def build_dataset(name: str, n: int, input_len: int, cal: ds.Calibration, seed: int, *,
                  prefix_len: int = 512, num_prefixes: int = 4, turns: int = 3):
    if name == "random":
        return ds.random_dataset(n, input_len, cal, seed)
    if name == "shared-prefix":
        return ds.shared_prefix_dataset(n, input_len, prefix_len, num_prefixes, cal, seed)
    if name == "chat":
        return ds.chat_dataset(n, input_len, turns, cal, seed)
    raise ValueError(f"unknown dataset {name!r}")


# ---- running a workload -------------------------------------------------------------------------
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


# ---- the command --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "chat"])
    p.add_argument("--num-prompts", type=int, default=64, help="requests (chat: all turns)")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf = all at once")
    p.add_argument("--input-len", type=int, default=64,
                   help="prompt tokens (shared-prefix: the unique question; chat: each user turn)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: system prompt tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=3, help="chat: user turns per conversation")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--calibrate", default="probe", choices=["probe", "approx"],
                   help="prompt length: probe the server's usage, or assume "
                        f"{ds.TOKENS_PER_WORD} token per word")
    p.add_argument("--sweep-concurrency", default=None,
                   help="comma list, e.g. 1,4,16: one run per value, and a PNG plot")
    p.add_argument("--result-file", default=None, help="write the JSON report here")
    p.add_argument("--plot-file", default=None,
                   help="sweep plot (default: the result file with .png, or serve-sweep.png)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds for each run")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if not 1 <= args.max_concurrency <= MAX_CONCURRENCY:
        p.error(f"--max-concurrency must be in [1, {MAX_CONCURRENCY}]")
    return args


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(not 1 <= v <= MAX_CONCURRENCY for v in values):
        raise ValueError(f"bad --sweep-concurrency {text!r}")
    return values


async def run(args: argparse.Namespace) -> dict:
    base, model, cal = await prepare(args)
    sweep = (concurrency_list(args.sweep_concurrency) if args.sweep_concurrency
             else [args.max_concurrency])
    runs = []
    for i, c in enumerate(sweep):
        # fresh prompts for every run: the previous run's prompts are in the prefix cache
        convs = build_dataset(args.dataset, args.num_prompts, args.input_len, cal,
                              args.seed + 1000 * i,
                              prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                              turns=args.turns)
        report, _ = await run_workload(
            base, args.endpoint, model, convs, max_concurrency=c, request_rate=args.request_rate,
            output_len=args.output_len, ignore_eos=args.ignore_eos,
            temperature=args.temperature, seed=args.seed, request_timeout=args.request_timeout,
            time_limit=args.time_limit, progress=not args.disable_tqdm,
            desc=f"{args.dataset} c={c}")
        runs.append(report)
        print(table(report, f"{args.dataset} · concurrency {c}"), flush=True)
    config = dict(vars(args))
    config.update(model=model, base_url=base, request_rate=str(args.request_rate))
    return {"config": config, "calibration": vars(cal), "runs": runs}


def plot_sweep(result: dict, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    c = [r["max_concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(c, [r["output_throughput"] for r in runs], "o-")
    axes[0].set_ylabel("output tok/s")
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        axes[1].plot(c, [r[key] / 1000 for r in runs], "o-", label=label)
    axes[1].set_ylabel("seconds")
    for key, label in (("median_tpot_ms", "TPOT p50"), ("p99_itl_ms", "ITL p99"),
                       ("max_itl_ms", "ITL max")):
        axes[2].plot(c, [r[key] for r in runs], "o-", label=label)
    axes[2].set_ylabel("ms")
    cfg = result["config"]
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(v) for v in c])
        ax.set_xlabel("max concurrency")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"{cfg['model']} · {cfg['dataset']} · in {cfg['input_len']} / out "
                 f"{cfg['output_len']} tokens · {cfg['endpoint']}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_concurrency:
        try:
            concurrency_list(args.sweep_concurrency)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        result = asyncio.run(run(args))
    except (NotLoopback, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.result_file:
        write_result(args.result_file, result)
    if args.sweep_concurrency:
        plot = args.plot_file or (str(Path(args.result_file).with_suffix(".png"))
                                  if args.result_file else "serve-sweep.png")
        print(f"wrote {plot_sweep(result, plot)}")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
