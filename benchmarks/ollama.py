"""Ollama's /api/chat and OpenAI's /v1/chat/completions side by side on one server: the same
concurrent streams (greedy, the same prompts in a rep) through each route, reps alternating
(Ollama first, then OpenAI first, ...) so that a machine whose speed drifts slows both alike;
each route's output tokens a second, the Ollama/OpenAI ratio of each rep and their median.

Both routes run the same engine, so the ratio shows what Ollama's shaping (NDJSON lines, its
statistics) costs against OpenAI's (SSE chunks). Greedy answers to the same prompt are the same
on both routes, so both generate the same tokens: the report checks it. Ollama has no
`ignore_eos`, so an answer may end before --output-len on both (the tokens counted are those
generated: `eval_count`, `usage.completion_tokens`). The server started here has its prefix cache
off (PAGEDLLAMA_PREFIX_CACHING=0), so the route that goes second in a rep computes the same
prompts again; --base-url runs against a server running already (start it so for the same).

    python -m benchmarks.ollama                              # 16 streams of 64 tokens, 4 reps
    python -m benchmarks.ollama --concurrency 4 --output-len 16 --reps 2   # a smoke run
    python -m benchmarks.ollama --base-url http://127.0.0.1:11434
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import ExitStack

import httpx

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import (
    RequestOutput,
    check_loopback,
    first_model,
    make_client,
    payload,
    send,
)
from benchmarks.harness.launch import launched, our_server
from benchmarks.harness.metrics import finish, summarize
from benchmarks.harness.options import CHAT, parser
from benchmarks.harness.workload import alternate

OLLAMA = "/api/chat"
ROUTES = ("ollama", "openai")
NS = 1e-9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.ollama", __doc__, "model", "threads", "n_ctx", "concurrency",
               "input_len", "output_len", "seed", "request_timeout", "result_file")
    p.add_argument("--reps", type=int, default=4,
                   help="reps; each runs both routes, their order alternating (default 4)")
    p.add_argument("--base-url", default=None,
                   help="a loopback server running already (default: start one here)")
    return p.parse_args(argv)


def ollama_body(model: str, messages: list[dict], output_len: int) -> dict:
    return {"model": model, "messages": messages, "stream": True,
            "options": {"temperature": 0, "num_predict": output_len}}


async def send_ollama(client: httpx.AsyncClient, url: str, body: dict,
                      timeout: float) -> RequestOutput:
    """A streamed /api/chat request, timed line by line: one RequestOutput as the OpenAI
    client's, its tokens from the last line's `eval_count` and `prompt_eval_count`."""
    out = RequestOutput(start=time.perf_counter())
    parts: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    out.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return out
                async for line in resp.aiter_lines():
                    if line.strip():
                        _read_line(json.loads(line), time.perf_counter(), out, parts)
    except TimeoutError:
        out.error = f"timed out after {timeout:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.perf_counter()
        out.text = "".join(parts)
    if not out.error and out.finish_reason is None:
        out.error = "stream ended without done: true"
    out.ok = not out.error
    return out


def _read_line(obj: dict, now: float, out: RequestOutput, parts: list[str]) -> None:
    if obj.get("error"):
        out.error = f"stream error: {str(obj['error'])[:300]}"
        return
    text = (obj.get("message") or {}).get("content")
    if text:
        out.chunk_times.append(now)
        parts.append(text)
    if obj.get("done"):
        out.finish_reason = obj.get("done_reason")
        out.usage_reported = True
        out.output_tokens = int(obj.get("eval_count") or 0)
        out.prompt_tokens = int(obj.get("prompt_eval_count") or 0)


async def one_run(base: str, route: str, model: str, convs: list[ds.Conversation],
                  output_len: int, timeout: float) -> tuple[dict, list[str]]:
    """Every conversation at once through one route: the report and the answers."""
    async with make_client(len(convs), timeout) as client:
        start = time.perf_counter()
        if route == "ollama":
            jobs = [send_ollama(client, base + OLLAMA,
                                ollama_body(model, ds.chat_messages(c, 0), output_len), timeout)
                    for c in convs]
        else:
            jobs = [send(client, base + CHAT,
                         payload(model, ds.chat_messages(c, 0), True, output_len, False),
                         True, timeout) for c in convs]
        outputs = await asyncio.gather(*jobs)
    duration = max((o.end for o in outputs), default=start) - start
    return summarize(list(outputs), duration), [o.text for o in outputs]


async def run(base: str, model: str, args) -> dict:
    cal = ds.Calibration()
    warm = ds.random_dataset(args.concurrency, args.input_len, cal, args.seed, kind="warm")
    for route in ROUTES:   # warm-up, not recorded
        await one_run(base, route, model, warm, 4, args.request_timeout)
    reps: dict[str, list[dict]] = {r: [] for r in ROUTES}
    same_answers = []
    for i in range(args.reps):
        convs = ds.random_dataset(args.concurrency, args.input_len, cal, args.seed + i)
        texts = {}
        for route in alternate(ROUTES, i):
            report, texts[route] = await one_run(base, route, model, convs, args.output_len,
                                                 args.request_timeout)
            reps[route].append(report)
            print(f"rep {i + 1} {route}: {report['output_throughput']:.1f} tok/s, "
                  f"{report['total_output_tokens']} tokens"
                  + (f", {report['failed']} failed" if report["failed"] else ""),
                  file=sys.stderr, flush=True)
        same_answers.append(texts["ollama"] == texts["openai"])
    return summarize_reps(reps, same_answers)


def summarize_reps(reps: dict[str, list[dict]], same_answers: list[bool]) -> dict:
    out: dict = {r: {"tok_s": [x["output_throughput"] for x in reps[r]],
                     "output_tokens": [x["total_output_tokens"] for x in reps[r]],
                     "ttft_ms": [x["median_ttft_ms"] for x in reps[r]],
                     "median_tok_s": statistics.median(x["output_throughput"] for x in reps[r]),
                     "median_ttft_ms": statistics.median(x["median_ttft_ms"] for x in reps[r]),
                     "failed": sum(x["failed"] for x in reps[r])} for r in ROUTES}
    ratios = [a / b for a, b in zip(out["ollama"]["tok_s"], out["openai"]["tok_s"]) if b > 0]
    out["ratios"] = ratios
    out["median_ratio"] = statistics.median(ratios) if ratios else None
    out["same_answers"] = same_answers
    return out


def table(result: dict, args) -> str:
    lines = [f"ollama vs openai routes · {args.reps} reps · {args.concurrency} concurrent "
             f"streams · in ~{args.input_len} / out <= {args.output_len} tokens · greedy",
             f"{'route':24}{'tok/s p50':>10}{'TTFT p50':>10}  tok/s per rep",
             ]
    for route, name in (("ollama", "/api/chat"), ("openai", "/v1/chat/completions")):
        r = result[route]
        per_rep = " ".join(f"{x:.1f}" for x in r["tok_s"])
        lines.append(f"{name:24}{r['median_tok_s']:10.1f}{r['median_ttft_ms']:8.0f}ms  "
                     f"{per_rep}" + (f"  {r['failed']} failed" if r["failed"] else ""))
    ratio = result["median_ratio"]
    lines.append("ollama/openai tok/s per rep: " + " ".join(f"{x:.2f}" for x in result["ratios"])
                 + "; median " + (f"{ratio:.3f}x" if ratio is not None else "n/a"))
    same = result["same_answers"]
    lines.append(f"the same answers on both routes in {sum(same)} of {len(same)} reps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        if args.base_url:
            base = check_loopback(args.base_url)
        else:
            env = {"PAGEDLLAMA_MAX_SEQS": str(args.concurrency),
                   "PAGEDLLAMA_PREFIX_CACHING": "0"}
            base = stack.enter_context(launched(our_server(args.model, args.threads,
                                                           args.n_ctx, env=env)))
        model = first_model(base)
        result = asyncio.run(run(base, model, args))
    finish(table(result, args), {"benchmark": "ollama", "args": vars(args), "model": model,
                                 **result}, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
