"""A long prompt arrives while streams are running: how long do the streams stall? The long
prompt's TTFT and the streams' inter-token gaps (p50, p99, the largest) while all of them run
and while the long prompt is in prefill (docs/benchmarks.md, "interference and repeat").

    python -m benchmarks.interference --base-url http://127.0.0.1:8000 --streams 8 --long-len 2000
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import RequestOutput, make_client, payload, send
from benchmarks.harness.options import TARGET, add, parser
from benchmarks.harness.workload import client_main, is_chat, request_input, run_scenario


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.interference", __doc__, *TARGET, "streams")
    p.add_argument("--stream-input-len", type=int, default=64)
    add(p, "stream_output_len", "long_len",
        stream_output_len={"help": "max_tokens of a stream (it is stopped earlier, see --tail)"})
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--settle-tokens", type=int, default=8,
                   help="chunks every stream has sent before the long prompt is sent")
    p.add_argument("--baseline", type=float, default=2.0,
                   help="seconds the settled streams run before the long prompt is sent")
    p.add_argument("--tail", type=float, default=1.0, help="seconds after the long request")
    add(p, "seed", "warmup", "calibrate", "time_limit", "result_file", time_limit=600.0)
    args = p.parse_args(argv)
    if not 1 <= args.streams <= 64:
        p.error("--streams must be in [1, 64]")
    return args


# what a stream asks for so that each token comes in a chunk (completions; chat)
TOKEN_CHUNKS = {False: {"logprobs": 1}, True: {"logprobs": True, "top_logprobs": 1}}


def pct_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else 0.0


async def scenario(base: str, endpoint: str, model: str, cal: ds.Calibration, *, streams: int,
                   stream_input_len: int, stream_output_len: int, long_len: int,
                   long_output_len: int, settle_tokens: int, tail: float, seed: int,
                   time_limit: float, baseline: float = 2.0) -> dict:
    chat, url = is_chat(endpoint), base + endpoint
    stream_convs = ds.random_dataset(streams, stream_input_len, cal, seed, "streams")
    long_conv = ds.random_dataset(1, long_len, cal, seed, "long")[0]
    outs = [RequestOutput() for _ in range(streams)]
    long_out = RequestOutput()
    deadline = time.perf_counter() + time_limit
    async with make_client(streams + 1, time_limit) as client:
        # the streams ask for logprobs so that every token comes in a chunk, with text or not
        # (a control token has none): the gaps are between tokens, not between texts
        tasks = [asyncio.create_task(send(
            client, url, payload(model, request_input(c, 0, chat), chat, stream_output_len, True,
                                 extra=TOKEN_CHUNKS[chat]),
            chat, time_limit, out)) for c, out in zip(stream_convs, outs)]
        # wait until every stream is running (a stream that ended already will not settle)
        while (min(len(o.chunk_times) for o in outs) < settle_tokens
               and time.perf_counter() < deadline and not any(t.done() for t in tasks)):
            await asyncio.sleep(0.02)
        t_settled = time.perf_counter()
        await asyncio.sleep(baseline)
        long_body = payload(model, request_input(long_conv, 0, chat), chat, long_output_len, True)
        await send(client, url, long_body, chat, max(1.0, deadline - time.perf_counter()),
                   long_out)
        await asyncio.sleep(tail)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return report(outs, long_out, streams, settle_tokens, tail, t_settled)


def report(outs: list[RequestOutput], long_out: RequestOutput, streams: int,
           settle_tokens: int, tail: float, t_settled: float | None = None) -> dict:
    t_send = long_out.start
    t_first = long_out.chunk_times[0] if long_out.chunk_times else long_out.end
    t_end = long_out.end
    gaps, window_gaps, per_stream_max, text_gaps = [], [], [], []
    during_prefill, max_gap_at = 0, None
    t_settled = long_out.start if t_settled is None else t_settled
    for o in outs:
        # gaps between tokens where the server sent every token (logprobs), else between texts
        arrivals = o.token_times or o.chunk_times
        times = [t for t in arrivals if t >= t_settled]
        g = [b - a for a, b in zip(times, times[1:])]
        gaps += g
        if g and max(g) >= max(gaps):   # where the largest gap began, relative to the long send
            max_gap_at = times[g.index(max(g))] - t_send
        per_stream_max.append(max(g, default=0.0))
        texts = [t for t in o.chunk_times if t >= t_settled]
        text_gaps += [b - a for a, b in zip(texts, texts[1:])]
        # a gap "during the long request" overlaps [sent, finished]
        window_gaps += [b - a for a, b in zip(arrivals, arrivals[1:])
                        if b > t_send and a < t_end]
        during_prefill += sum(1 for t in arrivals if t_send <= t <= t_first)
    # a stream that was stopped by us is fine; one that failed on its own, or that ended
    # (max_tokens) before the long request finished, does not measure what we want
    stream_ok = [(o.error in ("", "cancelled")) and len(o.chunk_times) >= settle_tokens
                 for o in outs]
    ended_early = sum(1 for o in outs if not o.error and o.end < t_end)
    completed = sum(stream_ok) + (1 if long_out.ok else 0)
    return {
        "streams": streams, "sent": streams + 1, "completed": completed,
        "failed": streams + 1 - completed,
        "streams_ended_before_long_finished": ended_early,
        "long_ok": long_out.ok, "long_error": long_out.error,
        "long_prompt_tokens": long_out.prompt_tokens, "long_output_tokens": long_out.output_tokens,
        "long_cached_tokens": long_out.cached_tokens,
        "long_ttft_s": long_out.ttft if long_out.chunk_times else None,
        "long_e2e_s": long_out.latency,
        "stream_output_tokens": [len(o.chunk_times) for o in outs],
        "stream_errors": [o.error for o in outs],
        "itl_p50_ms": pct_ms(gaps, 50), "itl_p99_ms": pct_ms(gaps, 99),
        "max_gap_s": max(gaps, default=0.0),
        # the same between chunks with text: a token without text (a control token) makes a
        # gap of two steps here that no step had
        "max_text_gap_s": max(text_gaps, default=0.0),
        "gaps_between": "tokens" if all(o.token_times for o in outs) else "texts",
        "max_gap_began_s_after_long_sent": max_gap_at,
        "during_long_itl_p50_ms": pct_ms(window_gaps, 50),
        "during_long_itl_p99_ms": pct_ms(window_gaps, 99),
        "during_long_max_gap_s": max(window_gaps, default=0.0),
        "per_stream_max_gap_s": per_stream_max,
        "stream_tokens_during_long_prefill": during_prefill,
        "stream_tok_s_during_long_prefill": (during_prefill / (t_first - t_send)
                                             if t_first > t_send else 0.0),
        "tail_s": tail, "baseline_s": t_send - t_settled,
    }


def summary(r: dict) -> str:
    ttft = "-" if r["long_ttft_s"] is None else f"{r['long_ttft_s']:.2f} s"
    return "\n".join([
        f"{r['streams']} streams + 1 long prompt ({r['long_prompt_tokens']} tokens): "
        f"completed {r['completed']}, failed {r['failed']} of {r['sent']}",
        f"  long prompt TTFT {ttft}, end-to-end {r['long_e2e_s']:.2f} s"
        + (f"  [error: {r['long_error']}]" if r["long_error"] else ""),
        f"  streams ITL p50 {r['itl_p50_ms']:.0f} ms, p99 {r['itl_p99_ms']:.0f} ms, "
        f"largest gap {r['max_gap_s']:.2f} s",
        f"  while the long prompt ran: ITL p50 {r['during_long_itl_p50_ms']:.0f} ms, p99 "
        f"{r['during_long_itl_p99_ms']:.0f} ms, largest gap {r['during_long_max_gap_s']:.2f} s; "
        f"{r['stream_tokens_during_long_prefill']} stream tokens during its prefill "
        f"({r['stream_tok_s_during_long_prefill']:.1f} tok/s)",
    ] + ([f"  WARNING: {r['streams_ended_before_long_finished']} stream(s) ended before the long "
          "request finished: raise --stream-output-len"]
         if r["streams_ended_before_long_finished"] else []))


async def run(args: argparse.Namespace) -> dict:
    return await run_scenario(
        args, scenario, streams=args.streams, stream_input_len=args.stream_input_len,
        stream_output_len=args.stream_output_len, long_len=args.long_len,
        long_output_len=args.long_output_len, settle_tokens=args.settle_tokens, tail=args.tail,
        seed=args.seed, time_limit=args.time_limit, baseline=args.baseline)


def main(argv: list[str] | None = None) -> int:
    return client_main(parse_args(argv), run, summary)


if __name__ == "__main__":
    sys.exit(main())
