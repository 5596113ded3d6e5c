"""The same greedy request twice: does the answer served from the prompt cache match?

For each of N prompts (random text of ~--input-len tokens, unique per prompt), the same request
(temperature 0) is sent twice, one after the other; the second finds the prompt in the server's
cache. Counts the prompts whose two answers are identical, and reports the cached prompt tokens
of the second request when the server says (usage.prompt_tokens_details or llama-server's
timings.cache_n).

    python -m benchmarks.repeat --base-url http://127.0.0.1:8000 --num-prompts 10
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from benchmarks import datasets as ds
from benchmarks.client import NotLoopback, add_target_args, make_client, payload, send
from benchmarks.metrics import write_result
from benchmarks.serve import is_chat, prepare, request_input


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.repeat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--input-len", type=int, default=300)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --output-len tokens (longer answers to compare)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calibrate", default="probe", choices=["probe", "approx"])
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--time-limit", type=float, default=1200.0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= 1000:
        p.error("--num-prompts must be in [1, 1000]")
    return args


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def scenario(base: str, endpoint: str, model: str, cal: ds.Calibration, *,
                   num_prompts: int, input_len: int, output_len: int, ignore_eos: bool,
                   seed: int, request_timeout: float, time_limit: float) -> dict:
    chat, url = is_chat(endpoint), base + endpoint
    convs = ds.random_dataset(num_prompts, input_len, cal, seed, kind="repeat")
    deadline = time.perf_counter() + time_limit
    pairs = []
    async with make_client(1, request_timeout) as client:
        for conv in convs:
            body = payload(model, request_input(conv, 0, chat), chat, output_len, ignore_eos)
            pair = []
            for _ in range(2):
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                pair.append(await send(client, url, body, chat, min(request_timeout, left)))
            if not pair:
                break
            pairs.append(pair)
    return report(pairs, num_prompts)


def report(pairs, num_prompts: int) -> dict:
    outs = [o for pair in pairs for o in pair]
    compared = [p for p in pairs if len(p) == 2 and p[0].ok and p[1].ok]
    prompts = []
    for pair in pairs:
        first, second = pair[0], pair[1] if len(pair) == 2 else None
        ok = second is not None and first.ok and second.ok
        prompts.append({
            "identical": ok and first.text == second.text,
            "first_difference_char": first_difference(first.text, second.text) if ok else None,
            "prompt_tokens": first.prompt_tokens,
            "output_tokens": [o.output_tokens for o in pair],
            "second_cached_tokens": second.cached_tokens if second else None,
            "errors": [o.error for o in pair if o.error],
            "first_text": first.text, "second_text": second.text if second else None})
    identical = sum(1 for p in prompts if p["identical"])
    completed = sum(1 for o in outs if o.ok)
    return {"num_prompts": num_prompts, "compared": len(compared), "identical": identical,
            "different": len(compared) - identical, "sent": len(outs), "completed": completed,
            "failed": len(outs) - completed,
            "total_output_tokens": sum(o.output_tokens for o in outs if o.ok),
            "prompts": prompts}


def summary(r: dict) -> str:
    cached = [p["second_cached_tokens"] for p in r["prompts"]
              if p["second_cached_tokens"] is not None]
    lines = [f"same greedy request twice: identical text for {r['identical']} of {r['compared']} "
             f"prompts ({r['different']} differ); requests completed {r['completed']}, failed "
             f"{r['failed']} of {r['sent']}"]
    if cached:
        lines.append(f"  second request's cached prompt tokens: {sum(cached) / len(cached):.0f} on "
                     f"average (prompts of ~{r['prompts'][0]['prompt_tokens']} tokens)")
    for i, p in enumerate(r["prompts"]):
        if p["first_difference_char"] is not None:
            lines.append(f"  prompt {i}: answers differ from character "
                         f"{p['first_difference_char']}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict:
    base, model, cal = await prepare(args)
    r = await scenario(base, args.endpoint, model, cal, num_prompts=args.num_prompts,
                       input_len=args.input_len, output_len=args.output_len,
                       ignore_eos=args.ignore_eos, seed=args.seed,
                       request_timeout=args.request_timeout, time_limit=args.time_limit)
    r.update(config={**vars(args), "model": model}, calibration=vars(cal))
    return r


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        r = asyncio.run(run(args))
    except (NotLoopback, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(r))
    if args.result_file:
        write_result(args.result_file, r)
    return 0 if r["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
