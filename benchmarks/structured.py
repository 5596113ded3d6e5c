"""Structured output, measured against our server: throughput with a JSON schema, unconstrained
and with logprobs; how many answers over varied schemas validate; and the TTFT of an n=4
request against an n=1 request with a prompt of the same length (docs/api.md has the figures).

    python -m benchmarks.structured [--requests 32] [--schema-requests 200] [--only n]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
import jsonschema

from benchmarks.harness.client import complete, first_model, make_client
from benchmarks.harness.launch import launched, our_server
from benchmarks.harness.options import add, parser

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 12}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
     "required": ["ok", "n"]},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "pop": {"type": "integer"}},
        "required": ["name", "pop"]}}, "required": ["city"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "event"},
                                      "when": {"type": "string", "maxLength": 10}},
     "required": ["kind", "when"]},
]
PROMPTS = ["Describe a person.", "Give me a point.", "Pick a colour.", "Tag this post.",
           "Is it ok?", "Tell me about a city.", "List some numbers.", "When is the event?"]


def body(model: str, i: int, schema: dict | None, max_tokens: int, temperature: float) -> dict:
    b = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
         "max_tokens": max_tokens, "temperature": temperature, "seed": i}
    if schema is not None:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema, "strict": True}}
    return b


async def run_all(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    async with make_client(concurrency, 600) as client:
        async def one(b: dict) -> dict:
            async with sem:
                return await complete(client, url, b)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(b) for b in bodies))
        return out, time.perf_counter() - t0


def tok_s(results: list[dict], seconds: float) -> float:
    return sum(r["usage"]["completion_tokens"] for r in results) / seconds


def validates(result: dict, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(result["choices"][0]["message"]["content"]), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


LONG = ("The history of the printing press begins with movable type in East Asia and continues "
        "with Gutenberg's press in Mainz, which spread across Europe within decades and changed "
        "how books, pamphlets and newspapers were made, sold and read. ") * 10


async def ttft(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float]:
    """Seconds to the first token of any choice, and to the first token of every choice."""
    t0, first = time.perf_counter(), {}
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            for c in json.loads(line[5:])["choices"]:
                if c.get("text"):
                    first.setdefault(c["index"], time.perf_counter() - t0)
    assert len(first) == body["n"], first
    return min(first.values()), max(first.values())


async def n_ttft(base: str, model: str, reps: int) -> None:
    url = f"{base}/v1/completions"
    async with make_client(2, 600) as client:
        async def one(n: int, salt: str) -> tuple[float, float]:
            return await ttft(client, url, {"model": model, "prompt": f"{salt}. {LONG}",
                                            "max_tokens": 8, "temperature": 0.8, "n": n,
                                            "stream": True})
        await one(4, "warm up")
        prompt_tokens = (await complete(client, url, {"model": model, "prompt": f"x. {LONG}",
                                                      "max_tokens": 1}))["usage"]["prompt_tokens"]
        t1, t4 = [], []
        for r in range(reps):
            t1.append(await one(1, f"Run {r} alone"))
            t4.append(await one(4, f"Run {r} forks"))
    m1 = statistics.median(a for a, _ in t1)
    m4, m4_all = statistics.median(a for a, _ in t4), statistics.median(b for _, b in t4)
    print(f"n=4 vs n=1 TTFT, {prompt_tokens}-token prompt, {reps} pairs, medians: n=1 "
          f"{m1:.3f} s, n=4 {m4:.3f} s (every choice {m4_all:.3f} s), ratio {m4 / m1:.2f}x "
          f"(every choice {m4_all / m1:.2f}x; target <= 1.2x)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.structured", __doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--schema-requests", type=int, default=200)
    p.add_argument("--only", choices=["n"], help="n: only the n=4 vs n=1 TTFT comparison")
    add(p, "reps", reps={"default": 5, "help": "n=1/n=4 pairs for --only n"})
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    with launched(our_server()) as base:
        url, model = f"{base}/v1/chat/completions", first_model(base)
        if args.only == "n":
            await n_ttft(base, model, args.reps)
            return
        await run_all(url, [body(model, i, PERSON, 8, 0.8) for i in range(4)], 4)   # warm up
        n = args.requests
        free, t_free = await run_all(url, [body(model, i, None, 48, 0.8) for i in range(n)], 16)
        con, t_con = await run_all(url, [body(model, i, PERSON, 48, 0.8) for i in range(n)], 16)
        a, b = tok_s(free, t_free), tok_s(con, t_con)
        print(f"16 concurrent, {n} requests: unconstrained {a:.1f} tok/s, json_schema {b:.1f} "
              f"tok/s, ratio {b / a:.2f}x (target >= 0.8x)")
        lp_bodies = [{**body(model, i, None, 48, 0.8), "logprobs": True, "top_logprobs": 5}
                     for i in range(n)]
        lp, t_lp = await run_all(url, lp_bodies, 16)
        print(f"16 concurrent, {n} requests with logprobs (top 5): {tok_s(lp, t_lp):.1f} tok/s, "
              f"ratio {tok_s(lp, t_lp) / a:.2f}x (target >= 0.9x)")
        print(f"  completion tokens: unconstrained {sum(r['usage']['completion_tokens'] for r in free)}, "
              f"constrained {sum(r['usage']['completion_tokens'] for r in con)}")
        m = args.schema_requests
        schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(m)]
        res, t = await run_all(url, [body(model, i, s, 128, 0.8) for i, s in enumerate(schemas)], 16)
        ok = sum(validates(r, s) for r, s in zip(res, schemas))
        cut = sum(r["choices"][0]["finish_reason"] == "length" for r in res)
        cut_by = [sum(r["choices"][0]["finish_reason"] == "length"
                      for r, s in zip(res, schemas) if s is sch) for sch in SCHEMAS]
        if cut:
            print("  cut by max_tokens, per schema:", cut_by)
            longest = max((r for r in res if r["choices"][0]["finish_reason"] == "length"),
                          key=lambda r: r["usage"]["completion_tokens"])
            print("  e.g.:", repr(longest["choices"][0]["message"]["content"])[:160])
        for r, s in zip(res, schemas):
            if not validates(r, s) and r["choices"][0]["finish_reason"] != "length":
                print("  failed:", json.dumps(s)[:80], "->", repr(r["choices"][0]["message"]["content"])[:120])
        print(f"{m} requests over {len(SCHEMAS)} schemas: {ok} validate, {cut} cut by max_tokens, "
              f"{m - ok - cut} other failures ({t:.1f} s, {tok_s(res, t):.1f} tok/s)")
        await n_ttft(base, model, args.reps)


def main(argv: list[str] | None = None) -> int:
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
