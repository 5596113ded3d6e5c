"""Chunked prefill against no chunking: the `interference` scenario (streams running when a
long prompt arrives) against our server restarted with each prefill grid of --chunks and with
chunking off, alternating; the streams' gaps and the long prompt's TTFT next to the targets
(docs/benchmarks.md, "interference and repeat").

    python -m benchmarks.chunking [--chunks 16,32,64] [--reps 1] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from benchmarks import interference
from benchmarks.harness.launch import launched, our_server, stop_servers_on_sigterm
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import alternate

TARGET_RATIO = 2.0    # the streams' ITL p99 <= 2x their p50 with chunking
TARGET_GAP_S = 1.0    # no stream waits more than 1 s for its next token
FIGURES = ["itl_p50_ms", "itl_p99_ms", "max_gap_s", "during_long_itl_p50_ms",
           "during_long_itl_p99_ms", "long_ttft_s", "stream_tok_s_during_long_prefill"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.chunking", __doc__, "model", "threads", "n_ctx")
    p.add_argument("--chunks", default="16,32,64", help="prefill grids to try (chunking on)")
    p.add_argument("--no-off", action="store_true", help="skip the chunking-off run")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="with chunking on")
    add(p, "streams", "long_len", "stream_output_len", "reps", "seed", "time_limit", "quick",
        "result_file", time_limit={"default": 900.0, "help": "per run"})
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.streams, args.long_len, args.stream_output_len = "32", 2, 300, 400
        args.n_ctx = 512
    args.chunk_list = [int(c) for c in args.chunks.split(",") if c.strip()]
    if any(c < 1 or c + args.streams > args.max_batch_tokens for c in args.chunk_list):
        p.error("every chunk must be >= 1 and chunk + streams <= --max-batch-tokens")
    if args.long_len + 32 > args.n_ctx:
        p.error("--long-len must leave room for its output in --n-ctx")
    return args


def settings(args) -> dict[str, dict[str, str]]:
    out = {f"chunk {c}": {"PAGEDLLAMA_PREFILL_CHUNK": str(c),
                          "PAGEDLLAMA_MAX_BATCH_TOKENS": str(args.max_batch_tokens)}
           for c in args.chunk_list}
    if not args.no_off:
        # one grid cell covers any prompt, and the budget takes it whole next to the decodes
        out["off"] = {"PAGEDLLAMA_PREFILL_CHUNK": str(args.n_ctx),
                      "PAGEDLLAMA_MAX_BATCH_TOKENS": str(args.n_ctx + 16 + args.streams)}
    return out


# --quick: the streams settle after 2 tokens and run 0.3 s before the long prompt, 0.2 s after
QUICK_INTERFERENCE = ("--settle-tokens", "2", "--baseline", "0.3", "--tail", "0.2")


def one_run(args, env: dict[str, str]) -> dict:
    spec = our_server(args.model, args.threads, args.n_ctx, {"PAGEDLLAMA_MAX_SEQS": "16", **env})
    with launched(spec) as base:
        iargs = interference.parse_args([
            "--base-url", base, "--streams", str(args.streams), "--long-len", str(args.long_len),
            "--stream-output-len", str(args.stream_output_len), "--seed", str(args.seed),
            "--time-limit", str(args.time_limit), *(QUICK_INTERFERENCE if args.quick else ())])
        return asyncio.run(interference.run(iargs))


def table(summary: dict[str, dict]) -> str:
    head = (f"{'setting':>9} {'ITL p50':>8} {'p99':>7} {'p99/p50':>8} {'largest gap':>12} "
            f"{'p50 during long':>16} {'long TTFT':>10}")
    rows = [f"{name:>9} {s['itl_p50_ms']:>6.0f}ms {s['itl_p99_ms']:>5.0f}ms "
            f"{s['p99_over_p50']:>7.1f}x {s['max_gap_s']:>11.2f}s "
            f"{s['during_long_itl_p50_ms']:>14.0f}ms {s['long_ttft_s']:>9.1f}s"
            for name, s in summary.items()]
    rows.append(f"targets: p99/p50 <= {TARGET_RATIO:.0f}x with chunking (llama-server measured "
                f"here: 3.1x); largest gap <= {TARGET_GAP_S:.0f} s (llama-server: 6.5 s)")
    return ruled(head, rows)


def run(args) -> dict:
    envs = settings(args)
    runs: dict[str, list[dict]] = {name: [] for name in envs}
    for rep in range(args.reps):
        for name, env in alternate(list(envs.items()), rep):
            print(f"[{rep + 1}/{args.reps}] {name}", file=sys.stderr, flush=True)
            runs[name].append(one_run(args, env))
    summary = {}
    for name, rs in runs.items():
        ok = [r for r in rs if r["failed"] == 0 and r["long_ttft_s"] is not None]
        if not ok:
            summary[name] = {k: float("nan") for k in FIGURES} | {"p99_over_p50": float("nan"),
                                                                  "failed": True}
            continue
        s = {k: statistics.median(r[k] for r in ok) for k in FIGURES}
        s["p99_over_p50"] = s["itl_p99_ms"] / s["itl_p50_ms"] if s["itl_p50_ms"] else float("nan")
        s["meets_ratio_target"] = s["p99_over_p50"] <= TARGET_RATIO
        s["meets_gap_target"] = s["max_gap_s"] <= TARGET_GAP_S
        s["failed"] = len(rs) - len(ok)
        summary[name] = s
    return {"config": dict(vars(args)), "settings": envs,
            "runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    result = run(args)
    finish(f"chunked prefill · {Path(args.model).name} · {args.threads} threads · {args.streams} "
           f"streams + one {args.long_len}-token prompt · {args.reps} rep(s), median\n"
           + table(result["summary"]), result, args.result_file)
    return 0 if not any(s.get("failed") for s in result["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
