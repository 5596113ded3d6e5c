"""threads: sweep n_threads and n_threads_batch from 1 past the core count; prefill and decode
tok/s at batch 1 and batch 8; name the best setting for this machine.

llama.cpp runs a ubatch of one token on n_threads and anything larger on n_threads_batch, so
decode at batch 1 follows n_threads while prefill and decode at batch 8 follow n_threads_batch;
the full grid shows it rather than assuming it.
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from tqdm import tqdm

from benchmarks.tools import bench
from engine import Model
from experiments import common
from experiments.texts import PASSAGES

MAX_DECODE_SECONDS = 10.0
METRICS = {  # name: (label, batch size, follows n_threads_batch?)
    "prefill_b1": ("prefill, batch 1", 1, True),
    "prefill_b8": ("prefill, batch 8", 8, True),
    "decode_b1": ("decode, batch 1", 1, False),
    "decode_b8": ("decode, batch 8", 8, True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-threads", type=int, help="sweep 1..N (default: 2 x cores; quick: cores + 1)")
    p.add_argument("--diagonal", action="store_true",
                   help="only n_threads == n_threads_batch (default in --quick)")
    p.add_argument("--prompt-tokens", type=int, help="prefill length per sequence (default 128; quick 16)")
    p.add_argument("--decode-steps", type=int, help="decode steps measured (default 32; quick 4)")


def settings(args) -> dict:
    cores = common.n_cores()
    quick = args.quick
    return {
        "max_threads": args.max_threads or (cores + 1 if quick else 2 * cores),
        "diagonal": args.diagonal or quick,
        "prompt_tokens": args.prompt_tokens or (16 if quick else 128),
        "decode_steps": args.decode_steps or (4 if quick else 32),
        "repeats": args.repeats or (1 if quick else 3),
        "cores": cores,
    }


def measure(ctx, metric: str, prompt: list[int], steps: int) -> float:
    """tok/s of one measurement. Decode stops early after MAX_DECODE_SECONDS: with more threads
    than free cores a step can take seconds (threads spin at barriers waiting for a descheduled
    peer), and the rate is clear long before."""
    _, batch, _ = METRICS[metric]
    if metric.startswith("prefill"):
        return batch * len(prompt) / bench.time_prefill(ctx, prompt, batch)
    seconds, done = bench.time_decode(ctx, prompt, batch, steps, max_seconds=MAX_DECODE_SECONDS)
    return batch * done / seconds


def run(args) -> dict:
    cfg = settings(args)
    info = common.machine_info()
    threads = range(1, cfg["max_threads"] + 1)
    grid = [(t, t) for t in threads] if cfg["diagonal"] else list(itertools.product(threads, threads))
    model = Model(args.model)
    prompt = model.tokenize(" ".join(PASSAGES))[:cfg["prompt_tokens"]]
    p, d = cfg["prompt_tokens"], cfg["decode_steps"]
    ctx = bench.make_context(model, n_ctx=max(512, 8 * (p + d + 8)), n_batch=8 * p, n_seq_max=8)
    measure(ctx, "prefill_b8", prompt, 0)                      # warm-up, not recorded
    checkpoint = common.Checkpoint(args.out, "threads", {**cfg, "model": args.model})
    samples = checkpoint.load() or {key(cell, m): [] for cell in grid for m in METRICS}
    bar = tqdm(total=cfg["repeats"] * len(grid) * len(METRICS), desc="threads", unit="run",
               initial=sum(map(len, samples.values())))
    for rep in range(cfg["repeats"]):
        # each repeat walks the whole grid (rotated), so slow drifts in load spread over settings
        order = grid[rep % len(grid):] + grid[:rep % len(grid)]
        for cell in order:
            if all(len(samples[key(cell, m)]) > rep for m in METRICS):  # resumed from a checkpoint
                continue
            bench.set_threads(ctx, *cell)
            for metric in METRICS:
                samples[key(cell, metric)].append(measure(ctx, metric, prompt, d))
                bar.update()
            checkpoint.save(samples)
    bar.close()
    ctx.close()
    model.close()

    rows = [{"n_threads": nt, "n_threads_batch": ntb,
             **{m: common.summary(samples[key((nt, ntb), m)]) for m in METRICS}} for nt, ntb in grid]
    best = pick_best(rows)
    result = {"experiment": "threads", "settings": cfg, "model": str(args.model),
              "machine": common.finish_machine_info(info), "rows": rows, "best": best}
    markdown = report(result)
    print(markdown)
    common.write_outputs(Path(args.out), "threads", result, markdown, plot(result))
    checkpoint.discard()
    return result


def key(cell: tuple[int, int], metric: str) -> str:
    return f"{cell[0]},{cell[1]},{metric}"


def pick_best(rows: list[dict]) -> dict:
    """Per metric the fastest cell; overall the cell with the best geometric mean of the four
    metrics, each relative to its own maximum."""
    best = {}
    for m in METRICS:
        top = max(rows, key=lambda r: r[m]["median"])
        best[m] = {"n_threads": top["n_threads"], "n_threads_batch": top["n_threads_batch"],
                   "tok_s": top[m]["median"]}
    peak = {m: max(r[m]["median"] for r in rows) for m in METRICS}
    score = lambda r: math.prod(r[m]["median"] / peak[m] for m in METRICS) ** (1 / len(METRICS))  # noqa: E731
    top = max(rows, key=score)
    best["overall"] = {"n_threads": top["n_threads"], "n_threads_batch": top["n_threads_batch"],
                       "score": score(top)}
    return best


def report(result: dict) -> str:
    cfg, rows, best = result["settings"], result["rows"], result["best"]
    headers = ["n_threads", "n_threads_batch"] + [f"{METRICS[m][0]} tok/s" for m in METRICS]
    table = common.markdown_table(headers, [[r["n_threads"], r["n_threads_batch"]]
                                            + [common.fmt(r[m]) for m in METRICS] for r in rows])
    o = best["overall"]
    lines = [f"threads: {cfg['cores']} cores, prefill {cfg['prompt_tokens']} tokens per sequence, "
             f"decode {cfg['decode_steps']} steps; median (min–max) of {cfg['repeats']} repeats; "
             f"load average {fmt_load(result['machine'])}", "", table, "",
             f"Best overall: n_threads={o['n_threads']}, n_threads_batch={o['n_threads_batch']} "
             "(geometric mean of the four speeds, each relative to its best)."]
    for m in METRICS:
        b = best[m]
        lines.append(f"- fastest {METRICS[m][0]}: n_threads={b['n_threads']}, "
                     f"n_threads_batch={b['n_threads_batch']} ({b['tok_s']:.0f} tok/s)")
    lines.append(claim_2_vs_4(rows))
    return "\n".join(lines)


def fmt_load(machine: dict) -> str:
    s, e = machine["load_average_start"][0], machine.get("load_average_end", [float("nan")])[0]
    return f"{s:.1f} → {e:.1f}"


def claim_2_vs_4(rows: list[dict]) -> str:
    """The published claim "2 threads beat 4", checked on the diagonal cells when both exist."""
    cell = {(r["n_threads"], r["n_threads_batch"]): r for r in rows}
    if (2, 2) not in cell or (4, 4) not in cell:
        return "- claim \"2 threads beat 4\": not measured (needs the 2 and 4 thread settings)."
    parts = [f"{METRICS[m][0]} {cell[(2, 2)][m]['median']:.0f} vs {cell[(4, 4)][m]['median']:.0f}"
             for m in METRICS]
    return "- claim \"2 threads beat 4\" (2 vs 4 threads, tok/s): " + "; ".join(parts)


def plot(result: dict):
    rows, cores = result["rows"], result["settings"]["cores"]
    fig, axes = common.figure(len(METRICS), width=3.8, height=3.2)
    for ax, (m, (label, _, follows_batch)) in zip(axes, METRICS.items()):
        x_key, line_key = ("n_threads_batch", "n_threads") if follows_batch else ("n_threads", "n_threads_batch")
        diagonal = result["settings"]["diagonal"]
        for line in [None] if diagonal else sorted({r[line_key] for r in rows}):
            pts = sorted(((r[x_key], r[m]) for r in rows if diagonal or r[line_key] == line),
                         key=lambda p: p[0])
            xs = [x for x, _ in pts]
            med = [s["median"] for _, s in pts]
            err = [[s["median"] - s["min"] for _, s in pts], [s["max"] - s["median"] for _, s in pts]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3,
                        label=None if diagonal else f"{line_key}={line}")
        ax.set_xticks(sorted({r[x_key] for r in rows}))
        ax.axvline(cores, color="grey", linestyle="--", linewidth=1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("threads (both)" if diagonal else x_key)
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        if not diagonal:
            ax.legend(fontsize=7)
    fig.suptitle(f"Thread sweep ({cores} cores, dashed line); median, bars = min–max", fontsize=10)
    return fig
