"""quant: a quantization ladder built with llama.cpp's own quantizer from one F16 source; size,
load time, RSS, prefill and decode speed, and quality against the source (KL divergence of
next-token distributions, top-1 agreement, perplexity) over fixed texts.

The source is the shipped model dequantized to F16 with the gguf package; the shipped model is
itself quantized (Q4_1 for SmolLM2), so the quality columns measure the error each quant type
ADDS to that source, not the distance from the original full-precision weights.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.tools import bench, quantize
from engine import Model
from experiments import common
from experiments.texts import PASSAGES

LADDER = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_1", "IQ4_NL", "Q4_0", "Q3_K_M", "Q2_K"]
QUICK_LADDER = ["Q8_0", "Q4_0"]
DEFAULT_LADDER_DIR = Path(__file__).resolve().parents[1] / "models" / "ladder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--types", type=str, help=f"comma-separated (default {','.join(LADDER)}; "
                                              f"quick {','.join(QUICK_LADDER)})")
    p.add_argument("--ladder-dir", type=Path, default=DEFAULT_LADDER_DIR,
                   help="where the F16 source and the quantized files are cached and reused")
    p.add_argument("--threads", type=int, help="threads for inference and quantization (default: cores)")


def settings(args) -> dict:
    quick = args.quick
    return {"types": args.types.split(",") if args.types else (QUICK_LADDER if quick else LADDER),
            "repeats": args.repeats or (1 if quick else 3),
            "threads": args.threads or common.n_cores(),
            "prefill_tokens": 32 if quick else 256, "decode_steps": 8 if quick else 64,
            "quality_texts": 2 if quick else len(PASSAGES),
            "quality_max_tokens": 48 if quick else 512,
            "ladder_dir": str(args.ladder_dir)}


# ---- building the ladder ----------------------------------------------------------------------

def ladder_paths(source_model: Path, ladder_dir: Path, types: list[str]) -> dict[str, Path]:
    stem = source_model.name.removesuffix(".gguf")
    paths = {"F16": ladder_dir / f"{stem}.F16.gguf"}
    paths.update({t: ladder_dir / f"{stem}.requant.{t}.gguf" for t in types})
    return paths


def _fresh(path: Path, source: Path) -> bool:
    return path.is_file() and path.stat().st_mtime >= source.stat().st_mtime


def build_ladder(source_model: Path, paths: dict[str, Path], threads: int) -> dict[str, dict]:
    """Make the F16 source and each quantized file unless a fresh one is cached."""
    built = {}
    for name, path in tqdm(paths.items(), desc="quant: build ladder", unit="file"):
        if _fresh(path, source_model if name == "F16" else paths["F16"]):
            built[name] = {"seconds": None, "cached": True}
        elif name == "F16":
            built[name] = {"seconds": quantize.dequantize_to_f16(source_model, path), "cached": False}
        else:
            built[name] = {"seconds": quantize.quantize(paths["F16"], path, name, threads), "cached": False}
    return built


# ---- quality ----------------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def compare(ref_logp: np.ndarray, logits: np.ndarray, tokens: list[int]) -> dict:
    """KL(source || model) per position, top-1 agreement and the model's NLL of the text."""
    logq = log_softmax(logits).astype(np.float32).astype(np.float64)   # same rounding as ref_logp
    kl = (np.exp(ref_logp) * (ref_logp - logq)).sum(axis=1)
    top1 = ref_logp.argmax(axis=1) == logq.argmax(axis=1)
    nll = -logq[np.arange(len(tokens) - 1), tokens[1:]]
    return {"kl": kl, "top1": top1, "nll": nll}


def quality(per_text: list[dict]) -> dict:
    kl = np.concatenate([t["kl"] for t in per_text])
    text_means = [float(t["kl"].mean()) for t in per_text]
    nll = np.concatenate([t["nll"] for t in per_text])
    return {"kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_text_means": text_means,
            "kl_text_min": min(text_means), "kl_text_max": max(text_means),
            "top1_pct": 100 * float(np.concatenate([t["top1"] for t in per_text]).mean()),
            "ppl": float(np.exp(nll.mean())), "positions": int(kl.size)}


# ---- the experiment ---------------------------------------------------------------------------

def run(args) -> dict:
    cfg = settings(args)
    info = common.machine_info()
    source_model = args.model.resolve()
    paths = ladder_paths(source_model, Path(args.ladder_dir), cfg["types"])
    built = build_ladder(source_model, paths, cfg["threads"])
    entries = describe(source_model, paths, built, cfg["types"])
    bar = tqdm(total=len(entries) * (1 + 3 * cfg["repeats"]), desc="quant: measure", unit="step")
    loaded = [load(e["path"], cfg) for e in entries]     # all loaded at once: speed runs interleave
    measure_quality(entries, loaded, bar)
    samples = measure_speed(entries, loaded, cfg, bar)
    bar.close()
    for model, ctx, _ in loaded:
        ctx.close()
        model.close()
    for e, s in zip(entries, samples):
        summarise(e, s)
    result = {"experiment": "quant", "settings": cfg, "source_model": str(source_model),
              "machine": common.finish_machine_info(info), "entries": entries,
              "quality_positions": entries[0]["quality"]["positions"]}
    markdown = report(result)
    print(markdown)
    common.write_outputs(Path(args.out), "quant", result, markdown, plot(result))
    return result


def describe(source_model: Path, paths: dict[str, Path], built: dict, types: list[str]) -> list[dict]:
    """The rows: the F16 source, the shipped model for reference, then the ladder; each with
    the tensor types its file really holds."""
    entries = [{"label": "F16", "role": "source", "path": paths["F16"], "build": built["F16"]},
               {"label": f"{quantize.tensor_mix(source_model)['declared_type']} (shipped)",
                "role": "shipped", "path": source_model, "build": None}]
    entries += [{"label": t, "role": "ladder", "path": paths[t], "build": built[t]} for t in types]
    for e in entries:
        e.update(quantize.tensor_mix(e["path"]))
    return entries


def load(path: Path, cfg: dict):
    """(model, context, tokens of the quality texts) for one file."""
    model = Model(path)
    tokens = [model.tokenize(PASSAGES[i])[:cfg["quality_max_tokens"]] for i in range(cfg["quality_texts"])]
    longest = max(cfg["prefill_tokens"], max(len(t) for t in tokens))
    ctx = bench.make_context(model, n_ctx=longest + cfg["decode_steps"] + 32, n_batch=longest,
                             n_threads=cfg["threads"])
    return model, ctx, tokens


def measure_quality(entries: list[dict], loaded: list, bar) -> None:
    _, source_ctx, source_tokens = loaded[0]
    ref = [log_softmax(bench.position_logits(source_ctx, t)).astype(np.float32) for t in source_tokens]
    for e, (_, ctx, tokens) in zip(entries, loaded):
        assert tokens == source_tokens, "all ladder files must share the source's tokenizer"
        e["quality"] = quality([compare(r, bench.position_logits(ctx, t), t) for r, t in zip(ref, tokens)])
        bar.update()


def measure_speed(entries: list[dict], loaded: list, cfg: dict, bar) -> list[dict]:
    """Per entry: prefill and decode tok/s in this process, load probes in fresh processes;
    each repeat visits every entry (in a rotated order) so drifts in load spread over all."""
    prompt = loaded[0][0].tokenize(" ".join(PASSAGES))[:cfg["prefill_tokens"]]
    n = len(entries)
    samples = [{"prefill": [], "decode": [], "probe": []} for _ in entries]
    for rep in range(cfg["repeats"]):
        order = list(range(n))[rep % n:] + list(range(n))[:rep % n]
        for i in order:
            ctx = loaded[i][1]
            samples[i]["prefill"].append(len(prompt) / bench.time_prefill(ctx, prompt))
            bar.update()
            seconds, steps = bench.time_decode(ctx, prompt[:16], 1, cfg["decode_steps"])
            samples[i]["decode"].append(steps / seconds)
            bar.update()
        for i in order:
            samples[i]["probe"].append(bench.probe_load_subprocess(entries[i]["path"], cfg["threads"]))
            bar.update()
    return samples


def summarise(e: dict, s: dict) -> None:
    e["prefill_tok_s"] = common.summary(s["prefill"])
    e["decode_tok_s"] = common.summary(s["decode"])
    e["load_s"] = common.summary([p["load_s"] for p in s["probe"]])
    e["rss_mib"] = common.summary([p["rss_generated_mib"] for p in s["probe"]])
    e["rss_anon_mib"] = common.summary([p["rss_anon_mib"] for p in s["probe"]])
    e["rss_start_mib"] = min(p["rss_start_mib"] for p in s["probe"])
    e["generated_text"] = s["probe"][0]["generated_text"]
    e["path"] = str(e["path"])


def mix_text(e: dict) -> str:
    """Tensor types held, by share of weights (F32 norms omitted)."""
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in e["weight_share"].items() if k != "F32" and v >= 0.005)


def report(result: dict) -> str:
    cfg, entries = result["settings"], result["entries"]
    rows = []
    for e in entries:
        q = e["quality"]
        kl = "0 (reference)" if e["role"] == "source" else \
            f"{q['kl_mean']:.4f} ({q['kl_text_min']:.4f}–{q['kl_text_max']:.4f})"
        rows.append([e["label"], f"{e['file_bytes'] / 2**20:.0f}", f"{e['bpw_all']:.2f}", mix_text(e),
                     e["token_embd_type"], common.fmt(e["load_s"], 2),
                     f"{e['rss_mib']['median']:.0f} / {e['rss_anon_mib']['median']:.0f}",
                     common.fmt(e["prefill_tok_s"]), common.fmt(e["decode_tok_s"]), kl,
                     f"{q['top1_pct']:.1f}", f"{q['ppl']:.2f}"])
    table = common.markdown_table(
        ["type", "MiB", "bpw", "tensor types held (share of weights)", "token_embd", "load s",
         "RSS / anon MiB", f"prefill tok/s (pp{cfg['prefill_tokens']})", f"decode tok/s (tg{cfg['decode_steps']})",
         "KL mean (per-text range)", "top-1 %", "PPL"], rows)
    ladder = [e for e in entries if e["role"] != "shipped"]
    growing = [f"{a['label']} → {b['label']} ({a['file_bytes'] / 2**20:.0f} → {b['file_bytes'] / 2**20:.0f} MiB)"
               for a, b in zip(ladder, ladder[1:]) if b["file_bytes"] >= a["file_bytes"]]
    m = result["machine"]
    lines = [f"quant: {cfg['threads']} threads; quality over {result['quality_positions']} positions of "
             f"{cfg['quality_texts']} fixed texts against the F16 source (itself the dequantized shipped "
             f"model); speed median (min–max) of {cfg['repeats']} repeats; load time (page cache warm) and "
             f"RSS (total / anonymous) after loading and generating 8 tokens in a fresh process; "
             f"load average {m['load_average_start'][0]:.1f} → "
             f"{m['load_average_end'][0]:.1f}", "", table, "",
             "File sizes shrink at every step down the ladder." if not growing else
             "Steps down the ladder where the file does NOT shrink (K-quant fallbacks): " + "; ".join(growing) + ".",
             f"A fresh process holds {result['entries'][0]['rss_start_mib']:.0f} MiB before loading "
             "(Python, numpy, llama.cpp); the anonymous part beyond that is memory llama.cpp "
             "allocated (repacked weights, KV cache, buffers), the rest are mapped file pages.",
             "Built now (seconds): " + (", ".join(f"{e['label']} {e['build']['seconds']:.1f}"
                                                   for e in entries if e["build"] and not e["build"]["cached"])
                                        or "none, all cached") + "."]
    for e in entries:
        if e["role"] == "ladder" and e["label"] != (e["declared_type"] or e["label"]):
            lines.append(f"- {e['label']}: file declares {e['declared_type']}")
    for e in entries:
        if e["label"] in ("Q4_0", "Q4_K_M"):
            q, src = e["quality"], entries[0]["quality"]
            lines.append(f"- claim \"Q4 is fine\" — {e['label']}: top-1 agreement {q['top1_pct']:.1f}%, "
                         f"mean KL {q['kl_mean']:.3f}, PPL {q['ppl']:.2f} vs {src['ppl']:.2f} for the source.")
    return "\n".join(lines)


def plot(result: dict):
    entries = result["entries"]
    fig, axes = common.figure(2, width=6.0, height=4.2)
    source = entries[0]
    others = [e for e in entries if e["role"] != "source"]
    kls = [max(e["quality"]["kl_mean"], 1e-6) for e in others]
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "decode tok/s")):
        med = [e[key]["median"] for e in others]
        err = [[e[key]["median"] - e[key]["min"] for e in others], [e[key]["max"] - e[key]["median"] for e in others]]
        ax.errorbar(kls, med, yerr=err, fmt="o", capsize=3)
        for k, (x, y, e) in enumerate(zip(kls, med, others)):
            ax.annotate(e["label"], (x, y), textcoords="offset points", fontsize=7,
                        xytext=(5, 4) if k % 2 else (5, -10))
        ax.axhline(source[key]["median"], color="grey", linestyle="--", linewidth=1)
        ax.annotate("F16 source", (min(kls), source[key]["median"]), fontsize=7, color="grey",
                    textcoords="offset points", xytext=(0, 3))
        ax.set_xscale("log")
        ax.set_xlabel("mean KL divergence from the F16 source (log)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    fig.suptitle("Speed against quality (up and left is better; bars = min–max)", fontsize=10)
    return fig
