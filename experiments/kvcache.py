"""kvcache: generate N tokens with the KV cache and without it (every step clears the sequence
and re-evaluates the whole context), per-token latency against position, and the speedups.

One run per repeat generates the largest N; the figures for a smaller N are the first N tokens
of that run (the same work a separate run of N tokens does). Both modes generate exactly N
greedy tokens: end-of-generation is ignored so the two do the same number of steps.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib.ticker
from tqdm import tqdm

from benchmarks.tools import bench
from engine import Model
from experiments import common
from experiments.texts import STORY_PROMPT

SAVE_EVERY = 25
PUBLISHED = ("KV cache: 27 tok/s vs 1.1 tok/s without", 27.0, 1.1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=str, help="comma-separated N (default 50,200,500; quick 50)")
    p.add_argument("--threads", type=int, help="n_threads and n_threads_batch (default: cores)")


def settings(args) -> dict:
    tokens = [int(n) for n in args.tokens.split(",")] if args.tokens else ([50] if args.quick else [50, 200, 500])
    return {"tokens": sorted(tokens), "repeats": args.repeats or (1 if args.quick else 3),
            "threads": args.threads or common.n_cores()}


def run(args) -> dict:
    cfg = settings(args)
    info = common.machine_info()
    model = Model(args.model)
    prompt = model.tokenize(STORY_PROMPT)
    n_max = cfg["tokens"][-1]
    size = len(prompt) + n_max + 8
    ctx = bench.make_context(model, n_ctx=size, n_batch=size, n_threads=cfg["threads"])
    bench.generate_timed(ctx, prompt, 2)                                   # warm-up
    checkpoint = common.Checkpoint(args.out, "kvcache", {**cfg, "model": args.model, "prompt": prompt})
    resumed = checkpoint.load() is not None
    runs = collect(ctx, prompt, cfg, checkpoint)
    ctx.close()

    result = {"experiment": "kvcache", "settings": cfg, "model": str(args.model),
              "prompt_tokens": len(prompt), "machine": common.finish_machine_info(info),
              "by_tokens": [summarise(runs, n) for n in cfg["tokens"]],
              "per_position_ms": {mode: per_position(runs[mode]) for mode in runs},
              "same_tokens": agreement(runs),
              "sample_text": model.detokenize(runs["on"][0]["tokens"][:40]),
              "resumed_from_checkpoint": resumed, "runs": runs}
    model.close()
    markdown = report(result)
    print(markdown)
    common.write_outputs(Path(args.out), "kvcache", result, markdown, plot(result))
    checkpoint.discard()
    return result


def collect(ctx, prompt: list[int], cfg: dict, checkpoint: common.Checkpoint) -> dict:
    """{"on": [run per repeat], "off": [...]}, each run {"tokens", "seconds"}. Progress is saved
    after every run, and every SAVE_EVERY tokens of a run without the cache (its steps are
    independent, so a killed run continues where it stopped)."""
    data = checkpoint.load() or {"on": [], "off": [], "partial": None}
    n_max, repeats = cfg["tokens"][-1], cfg["repeats"]
    done = sum(len(r["tokens"]) for mode in ("on", "off") for r in data[mode])
    done += len(data["partial"]["tokens"]) if data["partial"] else 0
    bar = tqdm(total=2 * n_max * repeats, initial=done, desc="kvcache", unit="tok")
    for rep in range(repeats):
        for mode in ("on", "off"):
            if len(data[mode]) > rep:
                continue
            run = data["partial"] if data["partial"] and data["partial"]["mode"] == mode else \
                {"mode": mode, "tokens": [], "seconds": []}
            while len(run["tokens"]) < n_max:
                step = n_max - len(run["tokens"]) if mode == "on" else min(SAVE_EVERY, n_max - len(run["tokens"]))
                tokens, seconds = bench.generate_timed(ctx, prompt, step, kv_cache=mode == "on",
                                                       on_token=bar.update, start=run["tokens"])
                run["tokens"] += tokens
                run["seconds"] += seconds
                data["partial"] = run
                checkpoint.save(data)
            data[mode].append({"tokens": run["tokens"], "seconds": run["seconds"]})
            data["partial"] = None
            checkpoint.save(data)
    bar.close()
    return {"on": data["on"], "off": data["off"]}


def summarise(runs: dict, n: int) -> dict:
    """tok/s for the first n tokens (prompt prefill included) of every repeat, and the speedup."""
    rate = {mode: [n / sum(r["seconds"][:n]) for r in runs[mode]] for mode in runs}
    return {"tokens": n,
            "on_tok_s": common.summary(rate["on"]), "off_tok_s": common.summary(rate["off"]),
            "speedup": common.summary([a / b for a, b in zip(rate["on"], rate["off"])]),
            "on_ms_last": common.summary([1000 * r["seconds"][n - 1] for r in runs["on"]]),
            "off_ms_last": common.summary([1000 * r["seconds"][n - 1] for r in runs["off"]])}


def per_position(mode_runs: list[dict]) -> dict:
    """Per generated token: median, min and max milliseconds over the repeats."""
    columns = list(zip(*(r["seconds"] for r in mode_runs)))
    return {"median": [1000 * statistics.median(c) for c in columns],
            "min": [1000 * min(c) for c in columns], "max": [1000 * max(c) for c in columns]}


def agreement(runs: dict) -> list[int | None]:
    """Per repeat: the first position where the two modes chose different tokens (None: none).
    Step 0 is the same computation in both; later steps differ in how the context is split
    into llama_decode calls, which may change logits slightly (docs/prefix-cache.md, "Exact
    answers")."""
    firsts = []
    for on, off in zip(runs["on"], runs["off"]):
        diff = [i for i, (a, b) in enumerate(zip(on["tokens"], off["tokens"])) if a != b]
        firsts.append(diff[0] if diff else None)
    return firsts


def report(result: dict) -> str:
    cfg = result["settings"]
    rows = [[r["tokens"], common.fmt(r["on_tok_s"], 1), common.fmt(r["off_tok_s"], 1),
             common.fmt(r["speedup"], 1) + "×", common.fmt(r["on_ms_last"], 1),
             common.fmt(r["off_ms_last"], 0)] for r in result["by_tokens"]]
    table = common.markdown_table(
        ["N tokens", "with KV cache tok/s", "without tok/s", "speedup",
         "ms for token N, with", "ms for token N, without"], rows)
    claim, on, off = PUBLISHED
    claim_rows = [[f"\"{claim}\"", f"{on / off:.1f}×", "not stated", "–"]]
    claim_rows += [["measured here", f"{r['speedup']['median']:.1f}×", r["tokens"],
                    f"{r['on_tok_s']['median']:.1f} vs {r['off_tok_s']['median']:.1f} tok/s"]
                   for r in result["by_tokens"]]
    claims = common.markdown_table(["claim", "speedup", "N tokens", "tok/s with vs without"], claim_rows)
    diverged = result["same_tokens"]
    return "\n".join([
        f"kvcache: prompt {result['prompt_tokens']} tokens, {cfg['threads']} threads, greedy; "
        f"tok/s counts the prompt's prefill; median (min–max) of {cfg['repeats']} repeats; "
        f"load average {result['machine']['load_average_start'][0]:.1f} → "
        f"{result['machine']['load_average_end'][0]:.1f}", "", table, "", claims, "",
        "Without the cache token i costs a prefill of prompt + i tokens, so the speedup grows "
        "with N: a speedup quoted without N says little.",
        f"First position where the two modes' greedy tokens differ, per repeat: {diverged} "
        "(None = identical)."])


def plot(result: dict):
    fig, (ax_both, ax_on, ax_bar) = common.figure(3, width=4.2, height=3.3)
    p0 = result["prompt_tokens"]
    for mode, label, color in (("off", "without KV cache", "tab:red"), ("on", "with KV cache", "tab:blue")):
        series = result["per_position_ms"][mode]
        xs = [p0 + i for i in range(1, len(series["median"]))]      # step 0 = prompt prefill
        for ax in ((ax_both, ax_on) if mode == "on" else (ax_both,)):
            ax.plot(xs, series["median"][1:], color=color, label=label, linewidth=1)
            ax.fill_between(xs, series["min"][1:], series["max"][1:], color=color, alpha=0.25)
    ax_both.set_title("per-token latency", fontsize=10)
    ax_on.set_title("with KV cache only", fontsize=10)
    for ax in (ax_both, ax_on):
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per token")
        ax.set_ylim(bottom=0)
    ax_both.legend(fontsize=8)
    rows = result["by_tokens"]
    xs = range(len(rows))
    ax_bar.bar([x - 0.2 for x in xs], [r["on_tok_s"]["median"] for r in rows], 0.4, label="with", color="tab:blue")
    ax_bar.bar([x + 0.2 for x in xs], [r["off_tok_s"]["median"] for r in rows], 0.4, label="without", color="tab:red")
    for x, r in zip(xs, rows):
        ax_bar.annotate(f"{r['speedup']['median']:.0f}×", (x, r["on_tok_s"]["median"]), ha="center",
                        va="bottom", fontsize=8)
    ax_bar.set_xticks(list(xs), [str(r["tokens"]) for r in rows])
    ax_bar.set_xlabel("tokens generated (N)")
    ax_bar.set_ylabel("tok/s (median)")
    ax_bar.set_yscale("log")
    ax_bar.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_bar.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_bar.set_title("throughput and speedup", fontsize=10)
    ax_bar.legend(fontsize=8)
    fig.suptitle("KV cache on vs off (band = min–max over repeats)", fontsize=10)
    return fig
