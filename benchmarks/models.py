"""Memory and models on demand (docs/benchmarks.md, "models"; figures in docs/performance.md).

    python -m benchmarks.models memory      # resident memory after one request: our server
                                            # in several KV layouts, llama-server -np 16
    python -m benchmarks.models layouts     # the KV layouts on speed, prefix-cache hits and
                                            # memory: shared prefixes and multi-turn chats
    python -m benchmarks.models lifecycle   # load and unload times, cold and with the file in
                                            # the page cache: ours against llama-server's router
    python -m benchmarks.models kv          # a q8_0 KV cache against f16: sequences per GiB,
                                            # decode speed, KL divergence, greedy agreement

`memory` and `layouts` start each server in turn (llama-server from .peer/build/bin, same
slots and context per sequence). `lifecycle` serves the two model files of --models-dir from
both servers, `--models-max 1` for the router. `kv` runs in this process (engine.Context).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from benchmarks.harness import datasets as ds
from benchmarks.harness.launch import (
    ROOT,
    ServerSpec,
    find_peer_bin,
    free_port,
    launched,
    llama_server,
    our_server,
    server_process,
    stop_servers_on_sigterm,
)
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.workload import run_workload

MiB = 2**20
MODELS = ROOT / "models"
SMOL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"

# our server's KV layouts: (label, PAGEDLLAMA_* settings)
LAYOUTS = [
    ("split, no cache seqs (default)", {}),
    ("split + 4 cache seqs", {"PAGEDLLAMA_CACHE_SEQS": "4"}),
    ("split + 16 cache seqs (before)", {"PAGEDLLAMA_CACHE_SEQS": "16"}),
    ("unified", {"PAGEDLLAMA_KV_UNIFIED": "1"}),
    ("split, q8_0 KV", {"PAGEDLLAMA_KV_TYPE": "q8_0"}),
]


def peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process has had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def one_chat(base: str, model: str | None = None, max_tokens: int = 32) -> dict:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": max_tokens, "temperature": 0}
    if model:
        body["model"] = model
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def one_completion(base: str, model: str, max_tokens: int = 1) -> dict:
    """A plain completion (Gemma 3's file has no chat template)."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def servers(args) -> list[tuple[str, ServerSpec | None]]:
    """Our server in each layout asked for (--layouts), then llama-server with the same slots
    and context."""
    out: list[tuple[str, ServerSpec | None]] = []
    for name, env in (LAYOUTS[int(i)] for i in args.layouts.split(",")):
        out.append((f"ours: {name}", our_server(args.model, args.threads, args.n_ctx,
                                                env={"PAGEDLLAMA_MAX_SEQS": str(args.parallel),
                                                     **env})))
    peer = find_peer_bin(args.peer_bin)
    out.append((f"llama-server -np {args.parallel} -c {args.parallel * args.n_ctx}",
                llama_server(peer, args.model, args.threads, args.parallel, args.n_ctx)
                if peer else None))
    return out


def launched_servers(args, rows: list[dict]):
    """Each server of `servers` up in turn, as (name, spec, base URL); a llama-server that was
    not found gets a row saying so instead."""
    for name, spec in servers(args):
        if spec is None:
            rows.append({"server": name, "missing": "llama-server not found"})
            continue
        with launched(spec) as base:
            yield name, spec, base


# ---- memory -------------------------------------------------------------------------------------
def memory(args) -> dict:
    rows = []
    for name, spec, base in launched_servers(args, rows):
        proc = server_process(base)
        assert proc is not None
        start = proc.memory_info().rss
        one_completion(base, httpx.get(f"{base}/v1/models").json()["data"][0]["id"], 32)
        time.sleep(1.0)
        row = {"server": name, "rss_start": start, "rss": proc.memory_info().rss,
               "peak": peak_rss(proc.pid)}
        if spec.name == "pagedllama":
            health = httpx.get(f"{base}/health").json()
            (model,) = health["models"].values()
            row["estimate"] = model["memory"]["estimate"]
            row["base"] = health["memory"]["base"]
        rows.append(row)
        print(f"{name}: {row['rss'] / MiB:.0f} MiB", file=sys.stderr, flush=True)
    peer = next((r for r in rows if r["server"].startswith("llama-server") and "rss" in r), None)
    head = f"{'server':<44} {'after 1 request':>15} {'peak':>9} {'vs llama-server':>15} " \
           f"{'estimate':>9} {'KV est.':>8}"
    lines = []
    for r in rows:
        if "rss" not in r:
            lines.append(f"{r['server']:<44} {r['missing']}")
            continue
        ratio = f"{r['rss'] / peer['rss']:.2f}x" if peer else "-"
        est = r.get("estimate")
        lines.append(f"{r['server']:<44} {r['rss'] / MiB:>11.0f} MiB {r['peak'] / MiB:>5.0f} MiB "
                     f"{ratio:>15} " + (f"{est['total'] / MiB:>5.0f} MiB {est['kv'] / MiB:>4.0f} MiB"
                                        if est else ""))
    text = (f"resident memory after one request (32 tokens) · {Path(args.model).name} · "
            f"{args.parallel} sequences of {args.n_ctx} tokens\n" + ruled(head, lines))
    return {"text": text, "rows": rows}


# ---- layouts: speed, hits and memory ------------------------------------------------------------
def layouts(args) -> dict:
    rows = []
    for name, _spec, base in launched_servers(args, rows):
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        one_chat(base, model, 4)   # warm-up
        result = asyncio.run(_workloads_named(base, model, args))
        proc = server_process(base)
        rows.append({"server": name, **result, "rss": proc.memory_info().rss if proc else 0,
                     "peak": peak_rss(proc.pid) if proc else 0})
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    head = (f"{'server':<44} {'shared-prefix tok/s':>19} {'cached':>7} {'TTFT p99':>9} "
            f"{'chat tok/s':>10} {'cached':>7} {'TTFT p99':>9} {'peak RSS':>9}")
    lines = []
    for r in rows:
        if "missing" in r:
            lines.append(f"{r['server']:<44} {r['missing']}")
            continue
        s, c = r["shared-prefix"], r["chat"]
        lines.append(f"{r['server']:<44} {s['tok_s']:>19.1f} {s['cached_share']:>6.0%} "
                     f"{s['ttft_p99'] / 1000:>8.1f}s {c['tok_s']:>10.1f} {c['cached_share']:>6.0%} "
                     f"{c['ttft_p99'] / 1000:>8.1f}s {r['peak'] / MiB:>5.0f} MiB")
    text = (f"KV layouts · {Path(args.model).name} · {args.parallel} concurrent · shared-prefix: "
            f"{args.num_prompts} requests over {args.num_prefixes} system prompts of "
            f"~{args.shared_len} tokens; chat: conversations of {args.turns} turns, "
            f"{args.num_prompts} requests; {args.output_len} tokens out\n" + ruled(head, lines))
    return {"text": text, "rows": rows}


async def _workloads_named(base: str, model: str, args) -> dict:
    cal = ds.Calibration()
    shared = ds.shared_prefix_dataset(args.num_prompts, 32, args.shared_len, args.num_prefixes,
                                      cal, args.seed)
    chats = ds.chat_dataset(args.num_prompts, 48, args.turns, cal, args.seed)
    out = {}
    for name, convs in (("shared-prefix", shared), ("chat", chats)):
        report, _ = await run_workload(base, "/v1/chat/completions", model, convs,
                                       max_concurrency=args.parallel,
                                       output_len=args.output_len, ignore_eos=True,
                                       progress=False, time_limit=args.time_limit)
        prompt = report["total_input_tokens"] or 1
        out[name] = {"tok_s": report["output_throughput"], "ttft_p50": report["median_ttft_ms"],
                     "ttft_p99": report["p99_ttft_ms"], "completed": report["completed"],
                     "failed": report["failed"],
                     "cached_share": (report["total_cached_tokens"] or 0) / prompt}
    return out


# ---- lifecycle: load and unload times -----------------------------------------------------------
def cached_share(path: Path) -> float:
    """The share of a file's pages in the page cache (mincore over a mapping of it that reads
    nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        ok = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / n if ok else float("nan")


def evict(path: Path) -> float:
    """Ask the kernel to drop the file's pages from the page cache (pages another process has
    mapped stay); returns the share still cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_share(path)


def warm(path: Path) -> float:
    with open(path, "rb") as f:
        while f.read(16 * MiB):
            pass
    return cached_share(path)


def _poll(check, timeout: float = 300.0) -> float:
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("no change within the timeout")
        time.sleep(0.005)
    return time.perf_counter() - t0


def ours_lifecycle(base: str, model: str) -> dict:
    """Load (POST /models/{id}/load answers once loaded), first answer, unload."""
    t0 = time.perf_counter()
    httpx.post(f"{base}/models/{model}/load", timeout=300).raise_for_status()
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_completion(base, model)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    httpx.post(f"{base}/models/{model}/unload", timeout=300).raise_for_status()
    unload = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_completion(base, model)             # a request for the unloaded model loads it
    first_cold = time.perf_counter() - t0
    httpx.post(f"{base}/models/{model}/unload", timeout=300).raise_for_status()
    return {"load_s": load, "first_answer_s": first, "unload_s": unload,
            "request_that_loads_s": first_cold}


def router_status(base: str, model: str) -> str:
    for m in httpx.get(f"{base}/models", timeout=30).json()["data"]:
        if m["id"] == model:
            status = m["status"]
            return status["value"] if isinstance(status, dict) else status
    raise KeyError(model)


def router_lifecycle(base: str, model: str) -> dict:
    """llama-server's router: POST /models/load answers at once; the model is loaded when
    GET /models says so. Unload likewise."""
    t0 = time.perf_counter()
    httpx.post(f"{base}/models/load", json={"model": model}, timeout=300).raise_for_status()
    _poll(lambda: router_status(base, model) == "loaded")
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_completion(base, model)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    httpx.post(f"{base}/models/unload", json={"model": model}, timeout=300).raise_for_status()
    _poll(lambda: router_status(base, model) == "unloaded")
    unload = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_completion(base, model)             # autoload
    first_cold = time.perf_counter() - t0
    httpx.post(f"{base}/models/unload", json={"model": model}, timeout=300).raise_for_status()
    _poll(lambda: router_status(base, model) == "unloaded")
    return {"load_s": load, "first_answer_s": first, "unload_s": unload,
            "request_that_loads_s": first_cold}


def lifecycle(args) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="models-"))
    files = [SMOL, GEMMA]
    for f in files:
        (folder / f.name).symlink_to(f.resolve())
    names = [f.stem for f in files]
    ours = our_server(args.model, args.threads, args.n_ctx, env={
        "PAGEDLLAMA_MODELS_DIR": str(folder), "PAGEDLLAMA_MAX_SEQS": str(args.parallel)})
    peer = find_peer_bin(args.peer_bin)
    specs = [("ours", ours)]
    if peer:
        port = free_port()
        specs.append(("llama-server router", ServerSpec("llama-server", [
            str(peer), "--models-dir", str(folder), "--models-max", "1", "-t", str(args.threads),
            "-np", str(args.parallel), "-c", str(args.parallel * args.n_ctx),
            "--host", "127.0.0.1", "--port", str(port)], port)))
    rows = []
    for server, spec in specs:
        with launched(spec) as base:
            run = ours_lifecycle if server == "ours" else router_lifecycle
            for model, path in zip(names, files):
                for cache in ["cold", "warm"] * args.repeats:
                    share = evict(path) if cache == "cold" else warm(path)
                    t = run(base, model)
                    rows.append({"server": server, "model": model, "page_cache": cache,
                                 "cached_share": share, **t})
                    print(f"{server} {model} {cache} ({share:.0%} cached): {t}", file=sys.stderr,
                          flush=True)
    head = (f"{'server':<20} {'model':<32} {'file':<5} {'load':>7} {'1st answer':>10} "
            f"{'unload':>7} {'request that loads':>18}")
    lines = []
    for server, _ in specs:
        for model in names:
            for cache in ("cold", "warm"):
                sel = [r for r in rows if (r["server"], r["model"], r["page_cache"]) ==
                       (server, model, cache)]
                if not sel:
                    continue

                def med(key, sel=sel):
                    return statistics.median(r[key] for r in sel)
                share = statistics.median(r["cached_share"] for r in sel)
                lines.append(f"{server:<20} {model:<32} {cache:<5} {med('load_s'):>6.2f}s "
                             f"{med('first_answer_s'):>9.2f}s {med('unload_s'):>6.2f}s "
                             f"{med('request_that_loads_s'):>17.2f}s"
                             + (f"  ({share:.0%} of the file still cached)"
                                if cache == "cold" and share > 0.05 else ""))
    text = (f"load and unload · {args.parallel} sequences of {args.n_ctx} tokens · medians of "
            f"{args.repeats} · cold: the file's pages dropped from the page cache first\n"
            + ruled(head, lines))
    return {"text": text, "rows": rows}


# ---- kv: q8_0 against f16 ------------------------------------------------------------------------
KV_PROMPTS = [
    "Explain why the sky is blue in two sentences.", "Write a haiku about the sea.",
    "What is the capital of Australia?", "List three uses of copper.",
    "Summarise the plot of Hamlet briefly.", "How do vaccines work?",
    "Give me a recipe for pancakes.", "What is a prime number?",
    "Translate 'good morning' into French and Spanish.", "Why do cats purr?",
    "Describe a sunset to someone who cannot see.", "What causes earthquakes?",
    "Name the planets of the solar system.", "How does a bicycle stay upright?",
    "What is photosynthesis?", "Write a short apology for being late.",
]


def kv_quality(args) -> dict:
    """Greedy continuations with an f16 cache (flash attention: a q8_0 cache needs it); the q8_0
    cache teacher-forced along them (KL(f16 || q8_0) and argmax agreement per token) and
    generating on its own (whole answers equal to f16's)."""
    from engine import Model
    from engine.llama import Context, ContextConfig

    model = Model(args.model)
    out: dict = {"prompts": len(KV_PROMPTS), "tokens": args.kv_tokens}
    try:
        template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
        prompts = [model.tokenize(template.format(p), add_special=False) for p in KV_PROMPTS]
        ctxs = {t: Context(model, ContextConfig(n_ctx=1024, n_seq_max=1, n_batch=512,
                                                n_threads=args.threads, kv_unified=True,
                                                flash_attn=True, kv_type=t))
                for t in ("f16", "q8_0")}

        def run(ctx, prompt, forced=None):
            ctx.seq_rm(0)
            ctx.decode([(0, prompt, 0, 1)])
            tokens, dists, pos = [], [], len(prompt)
            for i in range(args.kv_tokens):
                logits = ctx.logits(-1).astype(np.float64)   # the batch's last row
                z = logits - logits.max()
                logp = z - np.log(np.exp(z).sum())
                dists.append(logp)
                tok = int(np.argmax(logits)) if forced is None else forced[i]
                tokens.append(tok)
                ctx.decode([(0, [tok], pos, 1)])
                pos += 1
            return tokens, dists

        kls, agree, same_answers, times = [], [], 0, {"f16": [], "q8_0": []}
        for prompt in prompts:
            t0 = time.perf_counter()
            ref_tokens, ref = run(ctxs["f16"], prompt)
            times["f16"].append(time.perf_counter() - t0)
            _, forced = run(ctxs["q8_0"], prompt, ref_tokens)
            t0 = time.perf_counter()
            own, _ = run(ctxs["q8_0"], prompt)
            times["q8_0"].append(time.perf_counter() - t0)
            same_answers += own == ref_tokens
            for p, q in zip(ref, forced):
                kls.append(float(np.sum(np.exp(p) * (p - q))))
                agree.append(int(np.argmax(p)) == int(np.argmax(q)))
        out |= {"kl_mean": statistics.fmean(kls), "kl_p99": float(np.percentile(kls, 99)),
                "kl_max": max(kls), "token_agreement": sum(agree) / len(agree),
                "same_answers": same_answers,
                "decode_tok_s_1_stream": {t: args.kv_tokens * len(v) / sum(v)
                                          for t, v in times.items()}}
        for c in ctxs.values():
            c.close()
    finally:
        model.close()
    return out


def kv_memory(args) -> dict:
    """KV bytes per cell by llama.cpp's own count (llama_state_seq_get_size of a filled
    sequence) against the estimate's; sequences of n_ctx per GiB."""
    from engine import EngineConfig
    from engine.memory import read_shape

    shape = read_shape(args.model)
    out = {}
    for kv_type in ("f16", "q8_0"):
        cell = shape.kv_cell_bytes(kv_type)
        per_seq = cell * args.n_ctx
        out[kv_type] = {"cell_bytes": cell, "seq_bytes": per_seq,
                        "seqs_per_gib": 2**30 / per_seq,
                        "default_kv_bytes": EngineConfig(n_ctx=args.n_ctx, kv_type=kv_type,
                                                         flash_attn=True).n_seq_max * per_seq}
    return out


def kv(args) -> dict:
    mem, quality = kv_memory(args), kv_quality(args)
    lines = [f"{t:<6} {m['cell_bytes'] / 1024:>8.1f} KiB {m['seq_bytes'] / MiB:>9.1f} MiB "
             f"{m['seqs_per_gib']:>9.1f} {quality['decode_tok_s_1_stream'][t]:>10.1f}"
             for t, m in mem.items()]
    head = f"{'KV':<6} {'per cell':>12} {'per sequence':>13} {'per GiB':>9} {'tok/s (1)':>10}"
    text = (f"KV cache types · {Path(args.model).name} · a sequence of {args.n_ctx} tokens\n"
            + ruled(head, lines) +
            f"\nq8_0 against f16 over {quality['prompts']} prompts x {quality['tokens']} greedy "
            f"tokens: KL mean {quality['kl_mean']:.2e}, p99 {quality['kl_p99']:.2e}, max "
            f"{quality['kl_max']:.2e}; argmax agreement {quality['token_agreement']:.1%}; "
            f"whole answers equal {quality['same_answers']} of {quality['prompts']}")
    return {"text": text, "memory": mem, "quality": quality}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("benchmarks.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["memory", "layouts", "lifecycle", "kv"])
    p.add_argument("--model", default=str(SMOL))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=16, help="sequences (llama-server -np)")
    p.add_argument("--n-ctx", type=int, default=2048, help="context per sequence")
    p.add_argument("--peer-bin", default=None)
    p.add_argument("--layouts", default=",".join(str(i) for i in range(len(LAYOUTS))),
                   help="our KV layouts to run, by index: " +
                   "; ".join(f"{i}: {name}" for i, (name, _) in enumerate(LAYOUTS)))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--shared-len", type=int, default=500)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    stop_servers_on_sigterm()
    with ExitStack():
        result = {"memory": memory, "layouts": layouts, "lifecycle": lifecycle,
                  "kv": kv}[args.what](args)
    result["config"] = vars(args)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    finish(result.pop("text"), result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
