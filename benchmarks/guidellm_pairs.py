"""guidellm as the client, against two servers started fresh one after the other in alternating
order (A B, B A, ...): per concurrency level each round's A/B throughput ratio and their median,
and each server's CPU per output token. guidellm and its tokenizer live in `.gl/`
(docs/benchmarks.md, "guidellm against both servers").

    python -m benchmarks.guidellm_pairs                          # ours vs llama-server, 1/4/16
    python -m benchmarks.guidellm_pairs --streams 16 --prompt-tokens 16 --output-tokens 32 \\
        --prefix-tokens 512 --requests 32                        # the shared-prefix workload
    python -m benchmarks.guidellm_pairs --a ours --a-env PAGEDLLAMA_ADAPTIVE_THREADS=0 --b ours
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from benchmarks.harness.client import first_model
from benchmarks.harness.launch import ROOT, cpu_seconds, label, server_process, start_server
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import add, parser
from benchmarks.harness.workload import alternate

GUIDELLM = ROOT / ".gl" / "bin" / "guidellm"
TOKENIZER = ROOT / ".gl" / "tokenizer"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sides = ["ours", "llama-server"]
    p = parser("benchmarks.guidellm_pairs", __doc__, "a", "b", "a_env", "b_env", "rounds",
               a={"choices": sides, "help": None}, b={"choices": sides, "help": None},
               rounds={"default": 2, "help": "rounds of one run of each server"})
    p.add_argument("--streams", default="1,4,16", help="guidellm's concurrent levels, in order")
    p.add_argument("--requests", type=int, default=48, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=0,
                   help="one shared system prompt of this many tokens (0: none)")
    add(p, "model", "threads", "parallel")
    p.add_argument("--guidellm", default=str(GUIDELLM))
    p.add_argument("--tokenizer", default=str(TOKENIZER))
    add(p, "seed", "result_file", seed=42)
    args = p.parse_args(argv)
    args.levels = [int(s) for s in args.streams.split(",")]
    for side in ("a", "b"):
        if getattr(args, f"{side}_env") and getattr(args, side) != "ours":
            p.error(f"--{side}-env sets our server's settings; --{side} is not ours")
    return args


def run_order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order the runs happen: A B, B A, A B, ..."""
    return [(r, side) for r in range(rounds) for side in alternate(("A", "B"), r)]


def guidellm_command(args, base_url: str, model: str, out: Path) -> list[str]:
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    if args.prefix_tokens:
        data += f",prefix_tokens={args.prefix_tokens},prefix_count=1"
    streams = ",".join(f"streams[{i}]={n}" for i, n in enumerate(args.levels))
    return [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={base_url},model={model}",
            "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
            "--seed", f"kind=static,value={args.seed}",
            "--data", data, "--profile", f"kind=concurrent,{streams}",
            # every request finishes: a cut run counts whole waves (docs/benchmarks.md)
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--constraint", "kind=max_duration,seconds=600",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def read_levels(report: dict) -> list[dict]:
    """Per concurrency level of a guidellm JSON report: output tok/s (mean over the level),
    output tokens, ITL and TTFT medians and p99s in ms."""
    levels = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]

        def stat(name: str, key: str = "median", m: dict = m) -> float:
            ok = m[name]["successful"]
            return ok["percentiles"]["p99"] if key == "p99" else ok[key]
        levels.append({
            "streams": bench["config"]["strategy"]["streams"],
            "tok_s": stat("output_tokens_per_second", "mean"),
            "output_tokens": m["output_token_count"]["successful"]["total_sum"],
            "itl_p50": stat("inter_token_latency_ms"), "itl_p99": stat("inter_token_latency_ms", "p99"),
            "ttft_p50": stat("time_to_first_token_ms"), "ttft_p99": stat("time_to_first_token_ms", "p99"),
        })
    return levels


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_one(what: str, env: list[str], args, out: Path) -> dict:
    """One server, started fresh, under one guidellm run (every level)."""
    with ExitStack() as stack:
        base_url = start_server(stack, what, env, args)
        model = first_model(base_url)
        server = server_process(base_url)
        server0, client0 = cpu_seconds(server), children_cpu()
        done = subprocess.run(guidellm_command(args, base_url, model, out), cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                              capture_output=True, text=True)
        server_cpu = cpu_seconds(server) - server0
        client_cpu = children_cpu() - client0
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-2000:]}")
    levels = read_levels(json.loads(out.read_text()))
    tokens = sum(level["output_tokens"] for level in levels)
    return {"levels": levels, "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
            "server_cpu_ms_per_token": 1000 * server_cpu / max(1, tokens)}


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per level: each round's A/B throughput ratio and their median, and the medians of each
    side's figures over its runs."""
    rows = []
    for i, level in enumerate(runs["A"][0]["levels"]):
        a = [run["levels"][i] for run in runs["A"]]
        b = [run["levels"][i] for run in runs["B"]]
        ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b)]
        row = {"streams": level["streams"], "ratios": ratios,
               "ratio_median": statistics.median(ratios)}
        for side, vals in (("a", a), ("b", b)):
            for key in ("tok_s", "itl_p50", "itl_p99", "ttft_p50", "ttft_p99"):
                row[f"{side}_{key}"] = statistics.median(v[key] for v in vals)
        rows.append(row)
    return rows


def table(rows: list[dict], runs: dict[str, list[dict]], names: dict[str, str]) -> str:
    lines = [f"A = {names['A']}, B = {names['B']}; guidellm, rounds of one run each, "
             "alternated (A B, B A, ...); medians",
             f"{'streams':>7} {'A/B per round':>22} {'median':>7} {'A tok/s':>8} {'B tok/s':>8} "
             f"{'ITL p50 A/B ms':>15} {'ITL p99 A/B ms':>15} {'TTFT p50 A/B ms':>16}"]
    for r in rows:
        per_round = " ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(f"{r['streams']:>7} {per_round:>22} {r['ratio_median']:>6.3f}x "
                     f"{r['a_tok_s']:>8.1f} {r['b_tok_s']:>8.1f} "
                     f"{r['a_itl_p50']:>7.1f}/{r['b_itl_p50']:<7.1f} "
                     f"{r['a_itl_p99']:>7.1f}/{r['b_itl_p99']:<7.1f} "
                     f"{r['a_ttft_p50']:>7.0f}/{r['b_ttft_p50']:<8.0f}")
    for side in ("A", "B"):
        cpu = ", ".join(f"{run['server_cpu_ms_per_token']:.1f}" for run in runs[side])
        client = ", ".join(f"{run['client_cpu_s']:.0f}" for run in runs[side])
        lines.append(f"{side}: server CPU ms per output token (each run) {cpu}; "
                     f"guidellm CPU s {client}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.guidellm).exists():
        raise SystemExit(f"{args.guidellm} not found: docs/benchmarks.md, "
                         "'guidellm against both servers', installs it")
    sides = {"A": (args.a, args.a_env), "B": (args.b, args.b_env)}
    names = {side: label(what, env) for side, (what, env) in sides.items()}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r, side in run_order(args.rounds):
            run = run_one(*sides[side], args, Path(tmp) / f"{side}{r}.json")
            runs[side].append(run)
            print(f"round {r + 1} {side} ({names[side]}): "
                  + ", ".join(f"{lv['streams']} streams {lv['tok_s']:.1f} tok/s"
                              for lv in run["levels"]), flush=True)
    rows = summarize(runs)
    finish(table(rows, runs, names), {"benchmark": "guidellm_pairs", "args": vars(args),
                                      "servers": names, "rows": rows, "runs": runs},
           args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
