"""The same greedy request twice, the second served from the prompt cache: are the two answers
identical? Also the second request's cached prompt tokens when the server reports them
(docs/benchmarks.md, "interference and repeat").

    python -m benchmarks.repeat --base-url http://127.0.0.1:8000 --num-prompts 10
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import make_client, payload, send
from benchmarks.harness.options import TARGET, parser
from benchmarks.harness.workload import client_main, is_chat, request_input, run_scenario


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.repeat", __doc__, *TARGET, "num_prompts", "input_len", "output_len",
               "ignore_eos", "seed", "warmup", "calibrate", "request_timeout", "time_limit",
               "result_file", num_prompts=10, input_len=300, request_timeout=300.0,
               time_limit=1200.0,
               ignore_eos={"help": "always generate --output-len tokens (longer answers to "
                                   "compare)"})
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
    return await run_scenario(
        args, scenario, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, ignore_eos=args.ignore_eos, seed=args.seed,
        request_timeout=args.request_timeout, time_limit=args.time_limit)


def main(argv: list[str] | None = None) -> int:
    return client_main(parse_args(argv), run, summary)


if __name__ == "__main__":
    sys.exit(main())
