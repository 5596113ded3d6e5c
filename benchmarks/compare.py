"""Our server and another OpenAI-compatible server (by default llama.cpp's llama-server), both
started here, the same workloads (random-1, random-16, shared-prefix, interference, repeat)
against each in alternating order with the same prompts; ours/peer ratios next to the targets
(docs/benchmarks.md, "compare"). Without a peer binary the comparison is skipped (exit 0).

    python -m benchmarks.compare --threads 2 --parallel 16
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks import interference, repeat
from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model
from benchmarks.harness.launch import (
    command_exists,
    env_items,
    find_peer_bin,
    launched,
    llama_server,
    our_server,
    peer_from_template,
    stop_servers_on_sigterm,
)
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import alternate, calibrate, run_workload, warmup

WORKLOADS = ("random-1", "random-16", "shared-prefix", "interference", "repeat")

# (workload, metric, label, kind, target): kind "ratio≥"/"ratio≤" compare ours/peer,
# "abs≤" compares our value with the target, "all" wants every prompt identical
TARGETS = [
    ("random-1", "output_throughput", "random, 1 stream: output tok/s", "ratio≥", 1.0),
    ("random-16", "output_throughput", "random, N streams: output tok/s", "ratio≥", 1.0),
    ("shared-prefix", "request_throughput", "shared prefix: throughput req/s", "ratio≥", 3.0),
    ("shared-prefix", "p99_ttft_ms", "shared prefix: TTFT p99 ms", "ratio≤", 0.2),
    ("interference", "max_gap_s", "long prompt arrives: largest gap s", "abs≤", 1.0),
    ("repeat", "identical", "same request twice: identical", "all", None),
]
INFO = [   # printed without a target
    ("random-1", "median_tpot_ms", "random, 1 stream: TPOT p50 ms"),
    ("random-16", "median_ttft_ms", "random, N streams: TTFT p50 ms"),
    ("random-16", "median_tpot_ms", "random, N streams: TPOT p50 ms"),
    ("shared-prefix", "output_throughput", "shared prefix: output tok/s"),
    ("shared-prefix", "median_ttft_ms", "shared prefix: TTFT p50 ms"),
    ("interference", "itl_p99_ms", "long prompt arrives: ITL p99 ms"),
    ("interference", "long_ttft_s", "long prompt arrives: its TTFT s"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.compare", __doc__, "peer_bin")
    p.add_argument("--peer-cmd", default=None,
                   help="any server's command instead, with {port} {model} {threads} {parallel} "
                        "{ctx} {ctx_total} filled in")
    p.add_argument("--peer-args", default="", help="extra arguments for llama-server")
    p.add_argument("--peer-name", default=None, help="the peer's name in the report")
    add(p, "model", "threads", "parallel", "n_ctx", "our_env",
        parallel={"help": "streams; llama-server -np"},
        n_ctx={"help": "context per sequence, both servers"})
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    add(p, "reps", "seed", "endpoint")
    g = add(p.add_argument_group("workload sizes"), "input_len", "output_len", output_len=128)
    g.add_argument("--single-prompts", type=int, default=8, help="random-1 requests")
    g.add_argument("--concurrent-prompts", type=int, default=64, help="random-16 requests")
    add(g, "prefix_len", "num_prefixes", prefix_len=1024)
    g.add_argument("--question-len", type=int, default=32)
    g.add_argument("--prefix-output-len", type=int, default=32)
    g.add_argument("--prefix-prompts", type=int, default=64)
    g.add_argument("--interference-streams", type=int, default=8)
    g.add_argument("--interference-stream-output-len", type=int, default=1024,
                   help="max_tokens of a running stream (stopped 1 s after the long request)")
    add(g, "long_len")
    g.add_argument("--repeat-prompts", type=int, default=10)
    g.add_argument("--repeat-input-len", type=int, default=300)
    g.add_argument("--repeat-output-len", type=int, default=64)
    add(p, "request_timeout", "time_limit", "result_file", "disable_tqdm",
        time_limit={"default": 1200.0, "help": "seconds per workload run"})
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if not 1 <= args.reps <= 10:
        p.error("--reps must be in [1, 10]")
    if "interference" in args.workloads and args.interference_streams >= args.parallel:
        p.error("--interference-streams must be below --parallel: the long prompt needs a free "
                "slot on a server with --parallel slots")
    return args


def peer_spec(args):
    """The peer's ServerSpec, or None with the reason it is missing."""
    if args.peer_cmd:
        spec = peer_from_template(args.peer_cmd, args.model, args.threads, args.parallel,
                                  args.n_ctx)
        if not command_exists(spec.cmd):
            return None, f"the peer command {spec.cmd[0]!r} was not found"
        spec.name = args.peer_name or "peer"
        return spec, ""
    binary = find_peer_bin(args.peer_bin)
    if binary is None:
        where = (args.peer_bin or os.environ.get("LLAMA_SERVER_BIN")
                 or ".peer/build/bin/llama-server (nor llama-server on PATH)")
        return None, f"no llama-server binary at {where}"
    spec = llama_server(binary, args.model, args.threads, args.parallel, args.n_ctx,
                        args.peer_args.split())
    spec.name = args.peer_name or spec.name
    return spec, ""


async def run_one(workload: str, base: str, model: str, cal: ds.Calibration, seed: int,
                  args) -> dict:
    common = dict(request_timeout=args.request_timeout, time_limit=args.time_limit,
                  progress=not args.disable_tqdm, seed=seed)
    if workload in ("random-1", "random-16"):
        single = workload == "random-1"
        n = args.single_prompts if single else args.concurrent_prompts
        convs = ds.random_dataset(n, args.input_len, cal, seed)
        report, _ = await run_workload(base, args.endpoint, model, convs,
                                       max_concurrency=1 if single else args.parallel,
                                       output_len=args.output_len, ignore_eos=True,
                                       desc=workload, **common)
        return report
    if workload == "shared-prefix":
        convs = ds.shared_prefix_dataset(args.prefix_prompts, args.question_len, args.prefix_len,
                                         args.num_prefixes, cal, seed)
        report, _ = await run_workload(base, args.endpoint, model, convs,
                                       max_concurrency=args.parallel,
                                       output_len=args.prefix_output_len, ignore_eos=True,
                                       desc=workload, **common)
        return report
    if workload == "interference":
        return await interference.scenario(
            base, args.endpoint, model, cal, streams=args.interference_streams,
            stream_input_len=args.input_len,
            stream_output_len=args.interference_stream_output_len, long_len=args.long_len,
            long_output_len=16, settle_tokens=8, tail=1.0, seed=seed, time_limit=args.time_limit)
    if workload == "repeat":
        return await repeat.scenario(
            base, args.endpoint, model, cal, num_prompts=args.repeat_prompts,
            input_len=args.repeat_input_len, output_len=args.repeat_output_len,
            ignore_eos=False, seed=seed, request_timeout=args.request_timeout,
            time_limit=args.time_limit)
    raise ValueError(workload)


def brief(workload: str, r: dict) -> str:
    if workload == "interference":
        return (f"largest gap {r['max_gap_s']:.2f} s, long TTFT {r['long_ttft_s'] or 0:.2f} s, "
                f"failed {r['failed']}")
    if workload == "repeat":
        return f"identical {r['identical']}/{r['compared']}, failed {r['failed']}"
    return (f"{r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms p99 "
            f"{r['p99_ttft_ms']:.0f} ms, failed {r['failed']}")


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def comparison(results: dict, workloads: list[str], peer_name: str) -> tuple[str, list[dict]]:
    rows = []
    for wl, key, label, kind, target in TARGETS:
        if wl not in workloads:
            continue
        ours, peer = (median_of(results[s][wl], key) for s in ("ours", "peer"))
        ratio = ours / peer if ours is not None and peer not in (None, 0) else None
        if kind == "all":
            n = median_of(results["ours"][wl], "compared") or 0
            target_text, met = f"{n:.0f}/{n:.0f}", ours is not None and n > 0 and ours == n
        elif kind == "abs≤":
            target_text, met = f"≤ {target} (ours)", ours is not None and ours <= target
        else:
            target_text = f"{kind[-1]} {target}×"
            met = ratio is not None and (ratio >= target if kind == "ratio≥" else ratio <= target)
        rows.append({"label": label, "ours": ours, "peer": peer, "ratio": ratio,
                     "target": target_text, "met": met})
    for wl, key, label in INFO:
        if wl in workloads:
            ours, peer = (median_of(results[s][wl], key) for s in ("ours", "peer"))
            ratio = ours / peer if ours is not None and peer not in (None, 0) else None
            rows.append({"label": label, "ours": ours, "peer": peer, "ratio": ratio,
                         "target": "", "met": None})
    head = (f"{'':<38} {'pagedllama':>11} {peer_name[:11]:>11} {'ratio':>7} {'target':>14} "
            f"{'met':>4}")

    def f(v):
        return "-" if v is None else f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"

    def line(r: dict) -> str:
        met = "" if r["met"] is None else ("yes" if r["met"] else "no")
        return (f"{r['label']:<38} {f(r['ours']):>11} {f(r['peer']):>11} "
                f"{f(r['ratio']):>7} {r['target']:>14} {met:>4}")
    return ruled(head, [line(r) for r in rows]), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    peer, why = peer_spec(args)
    if peer is None:
        print(f"SKIPPED: {why}. Build llama-server with scripts/build_llama_server.sh (see "
              "docs/benchmarks.md), then pass --peer-bin PATH or set LLAMA_SERVER_BIN; or give "
              "any OpenAI-compatible server with --peer-cmd.")
        return 0
    # as many sequences as llama-server has slots (unless --our-env says otherwise)
    env = {"PAGEDLLAMA_MAX_SEQS": str(args.parallel), **env_items(args.our_env)}
    ours = our_server(args.model, args.threads, args.n_ctx, env)
    results = {"ours": {w: [] for w in args.workloads}, "peer": {w: [] for w in args.workloads}}
    with ExitStack() as stack:
        t0 = time.perf_counter()
        bases = {"ours": stack.enter_context(launched(ours)),
                 "peer": stack.enter_context(launched(peer))}
        print(f"servers up in {time.perf_counter() - t0:.0f} s: {' '.join(peer.cmd)}", flush=True)
        models = {side: first_model(base) for side, base in bases.items()}
        for side in ("ours", "peer"):
            asyncio.run(warmup(bases[side], args.endpoint, models[side], 2, args.seed))
        # one calibration (against ours) so that both servers get exactly the same prompts
        cal = asyncio.run(calibrate(bases["ours"], args.endpoint, models["ours"], args.seed))
        for rep in range(args.reps):
            for i, wl in enumerate(args.workloads):
                for side in alternate(("ours", "peer"), rep + i):
                    t0 = time.perf_counter()
                    r = asyncio.run(run_one(wl, bases[side], models[side], cal,
                                            args.seed + 101 * rep, args))
                    results[side][wl].append(r)
                    print(f"[rep {rep + 1}] {wl:<14} {side:<5} {brief(wl, r)} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    text, rows = comparison(results, args.workloads, peer.name)
    finish(f"\npagedllama vs {peer.name} · {Path(args.model).name} · {args.threads} threads · "
           f"{args.parallel} streams/slots · context {args.n_ctx} per sequence · "
           f"{args.reps} rep(s), median\n{text}",
           {"config": vars(args), "peer_cmd": peer.cmd, "our_env": ours.env,
            "calibration": vars(cal), "comparison": rows, "results": results},
           args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
