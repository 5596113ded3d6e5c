"""The Batch API at background priority (docs/api.md, "Batch API"): what a batch running beside
interactive chats costs them, and how fast a batch runs alone against a client sending the same
requests itself.

    python -m benchmarks.batch                        # starts our server (SmolLM2, 2 threads)
    python -m benchmarks.batch --base-url http://127.0.0.1:8000
    python -m benchmarks.batch --quick                # a tiny run (the test's)

First a client sends the batch's requests (`--batch-lines` of them, streamed) at each
concurrency of `--sweep`, to find its best. Then `--rounds` rounds on one server, each:
1. interactive chats: `--streams` clients, each sending `--interactive` short streamed chats one
   after another with `--think` seconds between them, alone and then while a batch of
   `--beside-lines` lines runs (created first and running before the chats start; cancelled
   after them): TTFT p50 / p95 and output tokens a second of the chats; how many batch lines
   finished meanwhile;
2. the batch alone, `--settle` seconds after the chats: `--batch-lines` lines, from creation to
   `completed`: lines and output tokens a second; then the client at its best concurrency
   sending the same requests.
Each side of a ratio is measured next to the other in the same round, so the machine's drift
over a run touches both alike. Reported: the ratios of each round, their median, and the ratios
of all rounds' chats pooled (TTFT percentiles of every chat).

Batch lines are chats of ~`--batch-input-len` tokens answering `--batch-output-len` tokens
(`ignore_eos`, greedy), so every run computes as many tokens; each run has prompts of its own
(the same lengths, other words), so that none finds another's prompts in the prefix cache.
The server started here gets a fresh PAGEDLLAMA_STATE_DIR (the batch store) and `--our-env`
settings; a server given by --base-url is used as it is (its Batch API must be free to run
this batch).
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack

import httpx
import numpy as np

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import RequestOutput, check_loopback, first_model, make_client, payload, send
from benchmarks.harness.launch import launched, our_server, parse_env, stop_servers_on_sigterm
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import calibrate, run_workload, warmup
from server.batch.runner import QUIET_S


def parse_args(argv: list[str] | None = None):
    p = parser("benchmarks.batch", __doc__, "model", "threads", "our_env", "quick")
    p.add_argument("--base-url", default=None, help="a running server (default: start ours)")
    p.add_argument("--streams", type=int, default=2, help="interactive clients")
    p.add_argument("--interactive", type=int, default=12, help="chats per interactive client")
    p.add_argument("--think", type=float, default=1.0, help="seconds between a client's chats")
    p.add_argument("--input-len", type=int, default=64, help="interactive prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="interactive answer tokens")
    p.add_argument("--settle", type=float, default=QUIET_S + 1.0,
                   help="seconds between the chats beside a batch and the batch alone (the "
                        f"runner starts lines {QUIET_S:g} s after the last interactive request)")
    p.add_argument("--batch-lines", type=int, default=48,
                   help="lines of the batch run alone (and of each client concurrency)")
    p.add_argument("--beside-lines", type=int, default=1000,
                   help="lines of the batch running beside the chats (cancelled after them)")
    p.add_argument("--batch-input-len", type=int, default=96)
    p.add_argument("--batch-output-len", type=int, default=64)
    p.add_argument("--sweep", default="4,8,16",
                   help="client concurrencies (1 and 2 were never the best: 2026-11-28)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of paired measurements")
    add(p, "seed", "request_timeout", "result_file", request_timeout=300.0)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.interactive, args.think = 1, 3, 0.2
        args.input_len, args.output_len = 24, 4
        args.batch_lines, args.batch_input_len, args.batch_output_len = 4, 24, 6
        args.beside_lines = 4
        args.sweep = "1,2"
        args.settle = QUIET_S
        args.rounds = 1
    args.concurrencies = [int(c) for c in args.sweep.split(",") if c.strip()]
    if not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--sweep: comma-separated concurrencies of at least 1")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def pct_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else None


async def interactive(base: str, model: str, args, cal: ds.Calibration, tag: str) -> dict:
    """`streams` closed-loop clients, each sending `interactive` short chats with think time."""
    convs = ds.random_dataset(args.streams * args.interactive, args.input_len, cal, args.seed, tag)
    outs: list[RequestOutput] = []

    async def one_client(i: int) -> None:
        for k in range(args.interactive):
            conv = convs[i * args.interactive + k]
            body = payload(model, ds.chat_messages(conv, 0), True, args.output_len, True)
            outs.append(await send(client, base + CHAT, body, True, args.request_timeout))
            await asyncio.sleep(args.think)

    start = time.perf_counter()
    async with make_client(args.streams, args.request_timeout) as client:
        await asyncio.gather(*(one_client(i) for i in range(args.streams)))
    duration = time.perf_counter() - start
    done = [o for o in outs if o.ok]
    return {**chat_figures([o.ttft for o in done], [o.tpot for o in done if o.tpot is not None],
                           sum(o.output_tokens for o in done), sum(o.latency for o in done)),
            "sent": len(outs), "completed": len(done), "duration_s": duration,
            "errors": sorted({o.error for o in outs if not o.ok})}


def chat_figures(ttfts: list[float], tpots: list[float], tokens: int, busy: float) -> dict:
    """The chats' figures: TTFT p50 / p95, TPOT p50, output tokens a second while a chat runs
    (think time left out: tokens while a chat waits); the TTFTs themselves, to pool rounds."""
    return {"ttft_p50_ms": pct_ms(ttfts, 50), "ttft_p95_ms": pct_ms(ttfts, 95),
            "tpot_p50_ms": pct_ms(tpots, 50), "output_tokens": tokens, "busy_s": busy,
            "tok_s_per_chat": tokens / busy if busy else 0.0, "ttfts_s": ttfts, "tpots_s": tpots}


def pooled(runs: list[dict]) -> dict:
    """The chats of several rounds as one run."""
    return chat_figures([t for r in runs for t in r["ttfts_s"]],
                        [t for r in runs for t in r["tpots_s"]],
                        sum(r["output_tokens"] for r in runs), sum(r["busy_s"] for r in runs))


def batch_file(model: str, args, cal: ds.Calibration, tag: str,
               lines: int | None = None) -> tuple[bytes, list[dict]]:
    convs = ds.random_dataset(lines or args.batch_lines, args.batch_input_len, cal, args.seed, tag)
    bodies = [payload(model, ds.chat_messages(c, 0), True, args.batch_output_len, True, stream=False)
              for c in convs]
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": b}
             for i, b in enumerate(bodies)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode(), bodies


async def create_batch(http: httpx.AsyncClient, data: bytes) -> str:
    f = await http.post("/v1/files", files={"file": ("batch.jsonl", data)}, data={"purpose": "batch"})
    f.raise_for_status()
    b = await http.post("/v1/batches", json={"input_file_id": f.json()["id"], "completion_window": "24h",
                                             "endpoint": CHAT})
    b.raise_for_status()
    return b.json()["id"]


async def batch_state(http: httpx.AsyncClient, batch_id: str) -> dict:
    r = await http.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    return r.json()


async def wait_batch(http: httpx.AsyncClient, batch_id: str, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        b = await batch_state(http, batch_id)
        if done(b) or b["status"] in ("failed", "expired", "cancelled", "completed"):
            return b
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {b['status']} after {timeout:.0f} s")
        await asyncio.sleep(0.1)


async def beside_batch(base: str, model: str, args, cal: ds.Calibration, data: bytes) -> dict:
    """The interactive chats while a batch runs (started and running before them)."""
    async with httpx.AsyncClient(base_url=base, timeout=60, trust_env=False) as http:
        batch_id = await create_batch(http, data)
        before = await wait_batch(http, batch_id, lambda b: b["request_counts"]["completed"] >= 1,
                                  args.request_timeout)
        chats = await interactive(base, model, args, cal, "beside")
        after = await batch_state(http, batch_id)
        if after["status"] == "in_progress":
            await http.post(f"/v1/batches/{batch_id}/cancel")
            await wait_batch(http, batch_id, lambda b: False, args.request_timeout)
    chats["batch_lines_done"] = after["request_counts"]["completed"] - before["request_counts"]["completed"]
    chats["batch_status_after"] = after["status"]
    return chats


async def batch_alone(base: str, data: bytes, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=60, trust_env=False) as http:
        t0 = time.perf_counter()
        batch_id = await create_batch(http, data)
        b = await wait_batch(http, batch_id, lambda b: False, args.request_timeout * args.batch_lines)
        took = time.perf_counter() - t0
    counts, usage = b["request_counts"], b.get("usage") or {}
    return {"status": b["status"], "seconds": took, "completed": counts["completed"],
            "failed": counts["failed"], "output_tokens": usage.get("output_tokens", 0),
            "lines_s": counts["completed"] / took, "tok_s": usage.get("output_tokens", 0) / took}


async def client_run(base: str, model: str, args, cal: ds.Calibration, concurrency: int,
                     tag: str) -> dict:
    """The batch's requests (as many, as long) sent streamed by a client, `concurrency` at once."""
    convs = ds.random_dataset(args.batch_lines, args.batch_input_len, cal, args.seed, tag)
    report, _ = await run_workload(base, CHAT, model, convs, max_concurrency=concurrency,
                                   output_len=args.batch_output_len, ignore_eos=True,
                                   request_timeout=args.request_timeout, progress=False)
    return {"tok_s": report["output_throughput"], "seconds": report["duration_s"],
            "completed": report["completed"], "failed": report["failed"]}


async def client_sweep(base: str, model: str, args, cal: ds.Calibration) -> dict:
    out = {}
    for c in args.concurrencies:
        out[c] = await client_run(base, model, args, cal, c, f"client-{c}")
        print(f"client at {c}: {out[c]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(alone: dict, beside: dict, batch: dict | None = None,
           client: dict | None = None) -> dict:
    out = {"ttft_p95_beside_over_alone": ratio(beside["ttft_p95_ms"], alone["ttft_p95_ms"]),
           "ttft_p50_beside_over_alone": ratio(beside["ttft_p50_ms"], alone["ttft_p50_ms"]),
           "chat_tok_s_beside_over_alone": ratio(beside["tok_s_per_chat"],
                                                 alone["tok_s_per_chat"])}
    if batch is not None and client is not None:
        out["batch_over_best_client"] = ratio(batch["tok_s"], client["tok_s"])
    return out


def median_ratios(rounds: list[dict]) -> dict:
    keys = rounds[0]["ratios"].keys()
    return {k: float(np.median([r["ratios"][k] for r in rounds if r["ratios"][k] is not None]))
            for k in keys}


async def one_round(base: str, model: str, args, cal: ds.Calibration, best_c: int, r: int) -> dict:
    alone = await interactive(base, model, args, cal, f"alone-{r}")
    beside = await beside_batch(base, model, args, cal, batch_file(
        model, args, cal, f"batch-beside-{r}", args.beside_lines)[0])
    # alone: after the runner's quiet time since the last chat (server/batch/runner.py, QUIET_S)
    await asyncio.sleep(args.settle)
    batch = await batch_alone(base, batch_file(model, args, cal, f"batch-alone-{r}")[0], args)
    client = await client_run(base, model, args, cal, best_c, f"client-best-{r}")
    out = {"interactive_alone": alone, "interactive_beside_batch": beside, "batch_alone": batch,
           "client_best": client, "ratios": ratios(alone, beside, batch, client)}
    print(f"round {r + 1}: " + ", ".join(f"{k} {fmt(v)}" for k, v in out["ratios"].items()),
          file=sys.stderr, flush=True)
    return out


async def run(base: str, args) -> dict:
    model = first_model(base)
    await warmup(base, CHAT, model, 2, args.seed)
    cal = await calibrate(base, CHAT, model, args.seed)
    sweep = await client_sweep(base, model, args, cal)
    best_c = max(sweep, key=lambda c: sweep[c]["tok_s"])
    rounds = [await one_round(base, model, args, cal, best_c, r) for r in range(args.rounds)]
    alone = pooled([r["interactive_alone"] for r in rounds])
    beside = pooled([r["interactive_beside_batch"] for r in rounds])
    return {
        "model": model, "client_sweep": sweep, "best_concurrency": best_c, "rounds": rounds,
        "pooled": {"interactive_alone": alone, "interactive_beside_batch": beside,
                   "ratios": ratios(alone, beside)},
        "ratios": median_ratios(rounds),
        "failed": sum(r["interactive_alone"]["sent"] - r["interactive_alone"]["completed"]
                      + r["interactive_beside_batch"]["sent"]
                      - r["interactive_beside_batch"]["completed"]
                      + r["batch_alone"]["failed"] + r["client_best"]["failed"] for r in rounds)
                  + sum(s["failed"] for s in sweep.values()),
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(r: dict, args) -> str:
    lines = [f"batch at background priority · {r['model']} · {args.streams} chat clients × {args.interactive} "
             f"(~{args.input_len} in / {args.output_len} out, think {args.think:g} s) · beside "
             f"them a batch of {args.beside_lines} lines, alone one of {args.batch_lines} (lines "
             f"~{args.batch_input_len} in / {args.batch_output_len} out) · {args.rounds} round(s)",
             "client sweep: " + ", ".join(f"{c} at a time {s['tok_s']:.1f} tok/s"
                                          for c, s in r["client_sweep"].items())
             + f"; best {r['best_concurrency']}",
             f"{'':28}{'TTFT p50':>10}{'TTFT p95':>10}{'tok/s a chat':>14}{'batch lines done':>18}"]
    for i, rd in enumerate(r["rounds"], 1):
        a, b, batch, c = (rd["interactive_alone"], rd["interactive_beside_batch"], rd["batch_alone"],
                          rd["client_best"])
        lines += [f"{f'{i}: chats alone':28}{fmt(a['ttft_p50_ms'], '.0f'):>8}ms"
                  f"{fmt(a['ttft_p95_ms'], '.0f'):>8}ms{a['tok_s_per_chat']:14.1f}",
                  f"{f'{i}: chats beside a batch':28}{fmt(b['ttft_p50_ms'], '.0f'):>8}ms"
                  f"{fmt(b['ttft_p95_ms'], '.0f'):>8}ms{b['tok_s_per_chat']:14.1f}"
                  f"{b['batch_lines_done']:18d}",
                  f"{i}: batch alone {batch['completed']} lines in {batch['seconds']:.1f} s, "
                  f"{batch['tok_s']:.1f} tok/s ({batch['status']}); the client at "
                  f"{r['best_concurrency']}: {c['tok_s']:.1f} tok/s",
                  f"{i}: ratios " + ", ".join(f"{k} {fmt(v)}x" for k, v in rd["ratios"].items())]
    p = r["pooled"]["ratios"]
    lines += [f"median of the rounds: TTFT p95 {fmt(r['ratios']['ttft_p95_beside_over_alone'])}x, "
              f"p50 {fmt(r['ratios']['ttft_p50_beside_over_alone'])}x, "
              f"tok/s a chat {fmt(r['ratios']['chat_tok_s_beside_over_alone'])}x; "
              f"batch / best client {fmt(r['ratios']['batch_over_best_client'])}x",
              f"every round's chats pooled: TTFT p95 {fmt(p['ttft_p95_beside_over_alone'])}x, "
              f"p50 {fmt(p['ttft_p50_beside_over_alone'])}x, "
              f"tok/s a chat {fmt(p['chat_tok_s_beside_over_alone'])}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    with ExitStack() as stack:
        if args.base_url:
            base = check_loopback(args.base_url)
        else:
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-batch-"))
            env = {**parse_env(args.our_env), "PAGEDLLAMA_STATE_DIR": state}
            base = stack.enter_context(launched(our_server(args.model, args.threads, env=env)))
        result = asyncio.run(run(base, args))
    finish(table(result, args), {"benchmark": "batch", "args": vars(args), **result}, args.result_file)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
