"""Our server and llama.cpp's llama-server at the sizes people run: for each model file, one
server at a time, the same threads and llama.cpp, the time to first token of a fresh ~1,500-token
prompt, the decode rate of one stream after a short prompt and at deeper contexts, the total rate
of concurrent short chats, and the peak resident memory of the server's processes.

    make shapes SHAPES=llama-3.2-1b                # models/shapes/: random weights, real shapes
    python -m benchmarks.sizes                     # SmolLM2 and every file in models/shapes/
    python -m benchmarks.sizes --models models/shapes/llama-3.2-1b-Q4_K_M.gguf --depths 1500
    python -m benchmarks.sizes --quick --servers ours   # a few seconds a measurement: a check

The files of benchmarks/tools/shapes.py have random weights: their text is meaningless, so every
request here is greedy and decodes a fixed number of tokens (`ignore_eos`, `max_tokens`), on both
servers; the time and memory are those of the shape. Every prompt is new to the server that gets
it (a fresh server per setting, prompts of random words that share no prefix), so nothing comes
from a cache. Two settings per model and server: one sequence with a context that holds the
deepest prompt (the prompt and decode measurements), and `--streams` sequences of `--chat-ctx`
tokens (the concurrent chats; llama-server `-np` slots of the same size). Our server runs with
its defaults but for those two and no disk tier (`--our-env` adds settings); its speculative
decoding finds little to copy in random text, so whatever it would gain on a real model's
answers is not in these figures.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import RequestOutput, first_model, make_client, payload, send
from benchmarks.harness.launch import (
    DEFAULT_MODEL,
    ROOT,
    ServerSpec,
    env_items,
    find_peer_bin,
    launched,
    llama_server,
    our_server,
    server_process,
    stop_servers_on_sigterm,
)
from benchmarks.harness.metrics import finish, ruled
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import alternate, calibrate, run_workload, warmup
from engine.gguf_info import gguf_facts

PARTS = ("prompt", "decode", "concurrent", "memory")
SERVERS = ("ours", "peer")
COMPLETIONS = "/v1/completions"
SHAPES_DIR = ROOT / "models" / "shapes"
MARGIN = 64   # context cells beyond prompt + output (template, BOS)
MiB = 2**20
RANDOM_NOTE = ("random weights: the text is meaningless; greedy, ignore_eos, a fixed number of "
               "tokens; the speed and memory are the shape's")


# --quick: short prompts, few tokens, 4 streams (a check that everything runs, not a measurement)
QUICK = {"prompt_len": 200, "depths": "400", "short_len": 32, "decode_tokens": 16, "streams": 4,
         "chat_prompts": 4, "chat_output_len": 8, "chat_ctx": 512}


@dataclass(frozen=True)
class Setting:
    """How both servers are started for a group of measurements."""
    name: str          # "long" or "concurrent"
    parallel: int      # our MAX_SEQS, llama-server -np
    n_ctx: int         # context per sequence


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.sizes", __doc__, "peer_bin", "threads", "our_env")
    p.add_argument("--models", nargs="+", default=None,
                   help="GGUF files (default: SmolLM2 and every .gguf in models/shapes/)")
    p.add_argument("--servers", default="ours,peer", help="ours, peer (llama-server) or both")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"measurements, of {', '.join(PARTS)}")
    g = p.add_argument_group("sizes")
    g.add_argument("--prompt-len", type=int, default=1500, help="tokens of the fresh prompt")
    g.add_argument("--depths", default="1500,8000",
                   help="prompt tokens before the decode rate is measured (a short prompt of "
                        "--short-len is always measured too)")
    g.add_argument("--short-len", type=int, default=64, help="the short prompt's tokens")
    g.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded at each depth")
    g.add_argument("--streams", type=int, default=16, help="concurrent chats; llama-server -np")
    g.add_argument("--chat-prompts", type=int, default=32, help="chats sent, --streams at a time")
    g.add_argument("--chat-input-len", type=int, default=64)
    g.add_argument("--chat-output-len", type=int, default=64)
    g.add_argument("--chat-ctx", type=int, default=2048, help="context per sequence of the chats")
    add(p, "quick", "seed", "request_timeout", "result_file",
        request_timeout={"default": 1800.0, "help": "seconds per request (a deep prompt on a "
                                                    "large shape takes minutes)"})
    p.add_argument("--out", dest="result_file", help="the same as --result-file")
    if p.parse_args(argv).quick:   # smaller defaults; what the command line gives stays
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers: of {', '.join(SERVERS)}")
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts: of {', '.join(PARTS)}")
    args.depths = sorted({int(d) for d in args.depths.split(",") if d.strip()})
    if any(d <= 0 for d in args.depths) or args.prompt_len <= 0 or args.decode_tokens < 2:
        p.error("--depths and --prompt-len must be positive, --decode-tokens at least 2")
    if args.chat_input_len + args.chat_output_len + MARGIN > args.chat_ctx:
        p.error("--chat-ctx must hold --chat-input-len + --chat-output-len")
    args.models = [Path(m) for m in args.models] if args.models else default_models()
    missing = [str(m) for m in args.models if not m.is_file()]
    if missing:
        p.error(f"no such model file: {', '.join(missing)}")
    return args


def default_models() -> list[Path]:
    return [DEFAULT_MODEL, *sorted(SHAPES_DIR.glob("*.gguf"))]


def now() -> str:
    """The local date and time of day, as the reports carry it."""
    return datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


# ---- the settings ----------------------------------------------------------------------------
def round_up(n: int, to: int = 256) -> int:
    return -(-n // to) * to


def depths_held(args, trained: int | None) -> tuple[list[int], list[int]]:
    """The depths a sequence of the model's trained context holds, and those it does not."""
    fits = [d for d in args.depths
            if not trained or d + args.decode_tokens + MARGIN <= trained]
    return fits, [d for d in args.depths if d not in fits]


def settings(args, trained: int | None, depths: list[int]) -> list[Setting]:
    out = []
    if {"prompt", "decode"} & set(args.parts):
        longest = max([args.prompt_len, args.short_len, *depths])
        n_ctx = round_up(longest + args.decode_tokens + MARGIN)
        out.append(Setting("long", 1, min(n_ctx, trained) if trained else n_ctx))
    if {"concurrent", "memory"} & set(args.parts):
        out.append(Setting("concurrent", args.streams, args.chat_ctx))
    return out


def server_spec(side: str, model: Path, setting: Setting, args, peer_bin: Path | None
                ) -> ServerSpec:
    if side == "ours":
        # no disk tier: a prompt cached by an earlier server would not be fresh
        env = {"PAGEDLLAMA_MAX_SEQS": str(setting.parallel), "PAGEDLLAMA_CACHE_DIR": "",
               **env_items(args.our_env)}
        return our_server(model, args.threads, setting.n_ctx, env)
    assert peer_bin is not None
    return llama_server(peer_bin, model, args.threads, setting.parallel, setting.n_ctx)


# ---- resident memory -------------------------------------------------------------------------
def tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in tree(proc):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tree_peak(proc: psutil.Process) -> int:
    """The sum of each process's own peak (VmHWM in /proc): the peak of a one-process server,
    an upper bound for several."""
    total = 0
    for p in tree(proc):
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, psutil.Error):
            pass
    return total


class MemoryWatch:
    """Samples the resident memory of a server's process tree while it runs."""

    def __init__(self, proc: psutil.Process, every: float = 0.25):
        self.proc, self.every = proc, every
        self.sampled_peak = self.at_start = tree_rss(proc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sampled_peak = max(self.sampled_peak, tree_rss(self.proc))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        end = tree_rss(self.proc)
        return {"rss_start": self.at_start, "rss_end": end,
                "peak": max(tree_peak(self.proc), self.sampled_peak, end)}


# ---- the measurements ------------------------------------------------------------------------
async def one(base: str, model: str, prompt: str, max_tokens: int, timeout: float
              ) -> RequestOutput:
    """One streamed, greedy completion of exactly max_tokens tokens (ignore_eos)."""
    async with make_client(1, timeout) as client:
        body = payload(model, prompt, False, max_tokens, ignore_eos=True)
        return await send(client, base + COMPLETIONS, body, False, timeout)


def prompt_text(cal: ds.Calibration, tokens: int, kind: str, seed: int) -> str:
    """A prompt of about `tokens` tokens of random words, its own for each kind."""
    conv, = ds.random_dataset(1, tokens, cal, seed, kind)
    return str(conv.user_turns[0])


def checked(out: RequestOutput, what: str, max_tokens: int) -> RequestOutput:
    if not out.ok:
        raise RuntimeError(f"{what}: {out.error}")
    if out.output_tokens != max_tokens:
        raise RuntimeError(f"{what}: {out.output_tokens} tokens, not {max_tokens}")
    return out


def decode_rate(out: RequestOutput) -> float | None:
    """Tokens a second after the first: (tokens - 1) / (end - first token's arrival)."""
    tpot = out.tpot
    return 1.0 / tpot if tpot else None


def measure_long(base: str, model: str, cal: ds.Calibration, depths: list[int], args) -> dict:
    r: dict = {}
    run = lambda prompt, n: asyncio.run(one(base, model, prompt, n, args.request_timeout))
    if "prompt" in args.parts:
        out = checked(run(prompt_text(cal, args.prompt_len, "sizes-prompt", args.seed), 4),
                      "prompt", 4)
        r["prompt"] = {"prompt_tokens": out.prompt_tokens, "ttft_s": out.ttft,
                       "prompt_tok_s": out.prompt_tokens / out.ttft if out.ttft else None}
        print(f"    prompt of {out.prompt_tokens} tokens: TTFT {out.ttft:.2f} s", flush=True)
    if "decode" in args.parts:
        r["decode"] = []
        for depth in [args.short_len, *depths]:
            text = prompt_text(cal, depth, f"sizes-decode-{depth}", args.seed)
            out = checked(run(text, args.decode_tokens), f"decode at {depth}", args.decode_tokens)
            rate = decode_rate(out)
            r["decode"].append({"depth": depth, "prompt_tokens": out.prompt_tokens,
                                "ttft_s": out.ttft, "output_tokens": out.output_tokens,
                                "decode_tok_s": rate, "text": out.text[:200]})
            print(f"    decode after {out.prompt_tokens} tokens: {rate or 0:.2f} tok/s "
                  f"(TTFT {out.ttft:.2f} s)", flush=True)
    return r


def measure_concurrent(base: str, model: str, cal: ds.Calibration, args) -> dict:
    if "concurrent" not in args.parts:   # memory alone: the memory after one chat
        convs = ds.chat_dataset(1, args.chat_input_len, 1, cal, args.seed)
        n = 1
    else:
        convs = ds.chat_dataset(args.chat_prompts, args.chat_input_len, 1, cal, args.seed)
        n = args.streams
    report, _ = asyncio.run(run_workload(
        base, CHAT, model, convs, max_concurrency=n, output_len=args.chat_output_len,
        ignore_eos=True, seed=args.seed, request_timeout=args.request_timeout,
        time_limit=args.request_timeout, progress=False, desc="chats"))
    keep = ("sent", "completed", "failed", "duration_s", "total_input_tokens",
            "total_output_tokens", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "errors")
    r = {k: report[k] for k in keep}
    if report["failed"]:
        raise RuntimeError(f"chats: {report['failed']} failed: {report['errors']}")
    if "concurrent" in args.parts:
        print(f"    {n} chat streams: {r['output_throughput']:.2f} tok/s, TTFT p50 "
              f"{r['median_ttft_ms'] / 1000:.2f} s", flush=True)
    return {"concurrent": r} if "concurrent" in args.parts else {"one_chat": r}


def run_setting(spec: ServerSpec, setting: Setting, depths: list[int],
                cal: ds.Calibration | None, args) -> tuple[dict, ds.Calibration]:
    """Start the server, measure what `setting` is for, stop it; with its peak memory."""
    t0 = time.perf_counter()
    with ExitStack() as stack:
        base = stack.enter_context(launched(spec))
        up = time.perf_counter() - t0
        proc = server_process(base)
        watch = MemoryWatch(proc) if proc else None
        model = first_model(base)
        asyncio.run(warmup(base, COMPLETIONS, model, 1, args.seed))
        if cal is None:   # once a model, so that both servers get the same prompts
            cal = asyncio.run(calibrate(base, COMPLETIONS, model, args.seed))
        if setting.name == "long":
            r = measure_long(base, model, cal, depths, args)
        else:
            r = measure_concurrent(base, model, cal, args)
        memory = watch.stop() if watch else {}
    r.update(memory=memory, startup_s=up, cmd=spec.cmd,
             env={k: v for k, v in spec.env.items() if k.startswith("PAGEDLLAMA_")})
    if memory:
        print(f"    peak resident memory {memory['peak'] / MiB:.0f} MiB", flush=True)
    return r, cal


def measure_model(path: Path, index: int, args, peer_bin: Path | None) -> dict:
    facts = gguf_facts(path)
    trained = facts.get("context_length")
    depths, beyond = depths_held(args, trained)
    result: dict = {"model": str(path), "name": path.name, "facts": facts,
                    "random_weights": is_random(facts), "started": now(), "depths": depths,
                    "depths_beyond_context": beyond, "settings": {}}
    sides = [s for s in args.servers if s == "ours" or peer_bin is not None]
    cal = None
    for i, setting in enumerate(settings(args, trained, depths)):
        runs: dict = {}
        for side in alternate(sides, index + i):
            print(f"  {side}: {setting.parallel} sequence(s) of {setting.n_ctx} tokens", flush=True)
            spec = server_spec(side, path, setting, args, peer_bin)
            runs[side], cal = run_setting(spec, setting, depths, cal, args)
        result["settings"][setting.name] = {"parallel": setting.parallel,
                                            "n_ctx": setting.n_ctx, **runs}
    result["finished"] = now()
    result["calibration"] = vars(cal) if cal else None
    return result


def is_random(facts: dict) -> bool:
    return "(random weights)" in (facts.get("name") or "")


# ---- the table -------------------------------------------------------------------------------
def comparison_rows(result: dict) -> list[dict]:
    """The table's rows: label, our value, the peer's, ours / the peer's, and whether lower is
    better. A value a server did not measure is None."""
    rows: list[dict] = []
    long, conc = (result["settings"].get(k, {}) for k in ("long", "concurrent"))

    def add_row(label: str, values: dict[str, float | None], lower: bool) -> None:
        ours, peer = values.get("ours"), values.get("peer")
        ratio = ours / peer if ours is not None and peer else None
        rows.append({"label": label, "ours": ours, "peer": peer, "ratio": ratio,
                     "lower_is_better": lower})

    def each(setting: dict, get) -> dict[str, float | None]:
        out = {}
        for side in SERVERS:
            try:
                out[side] = get(setting[side])
            except (KeyError, IndexError, TypeError):
                out[side] = None
        return out

    def tokens(setting: dict, get) -> int | None:
        return next((v for v in each(setting, get).values() if v), None)

    if any("prompt" in long.get(s, {}) for s in SERVERS):
        n = tokens(long, lambda r: r["prompt"]["prompt_tokens"])
        add_row(f"prompt of {n:,} tokens: TTFT s", each(long, lambda r: r["prompt"]["ttft_s"]),
                True)
        add_row("  prompt tok/s", each(long, lambda r: r["prompt"]["prompt_tok_s"]), False)
    depths = next((len(long[s]["decode"]) for s in SERVERS if "decode" in long.get(s, {})), 0)
    for i in range(depths):
        n = tokens(long, lambda r, i=i: r["decode"][i]["prompt_tokens"])
        add_row(f"decode, 1 stream, after {n:,} tokens: tok/s",
                each(long, lambda r, i=i: r["decode"][i]["decode_tok_s"]), False)
    if any("concurrent" in conc.get(s, {}) for s in SERVERS):
        add_row(f"{conc['parallel']} chat streams: total tok/s",
                each(conc, lambda r: r["concurrent"]["output_throughput"]), False)
        add_row(f"{conc['parallel']} chat streams: TTFT p50 s",
                each(conc, lambda r: r["concurrent"]["median_ttft_ms"] / 1000), True)
    for setting in (long, conc):
        if setting:
            n = setting["parallel"]
            add_row(f"peak memory MiB, {n} sequence{'s' if n > 1 else ''} of {setting['n_ctx']:,}",
                    each(setting, lambda r: r["memory"]["peak"] / MiB), True)
    return rows


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:,.0f}"


def table(result: dict, peer_name: str = "llama-server") -> str:
    rows = comparison_rows(result)
    facts = result["facts"]
    labels = [r["label"] + (" (lower is better)" if r["lower_is_better"] else "") for r in rows]
    width = max(map(len, labels), default=0)
    head = f"{'':<{width}} {'pagedllama':>11} {peer_name[:12]:>12} {'ratio':>7}"
    lines = [f"{label:<{width}} {fmt(r['ours']):>11} {fmt(r['peer']):>12} "
             f"{(fmt(r['ratio']) + '×') if r['ratio'] is not None else '-':>7}"
             for label, r in zip(labels, rows)]
    title = (f"{result['name']} · {facts['parameters'] / 1e9:.2f} B parameters, "
             f"{facts['file_size'] / MiB:,.0f} MiB · {result['started']} – {result['finished']}")
    notes = []
    if result.get("random_weights"):
        notes.append(RANDOM_NOTE)
    if result.get("depths_beyond_context"):
        notes.append(f"depths {', '.join(map(str, result['depths_beyond_context']))} skipped: "
                     f"beyond the model's trained context ({facts.get('context_length')})")
    return "\n".join([title, *notes, ruled(head, lines)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    peer_bin = find_peer_bin(args.peer_bin) if "peer" in args.servers else None
    if "peer" in args.servers and peer_bin is None:
        print("llama-server not found (scripts/build_llama_server.sh builds it; --peer-bin "
              "PATH): our server alone", flush=True)
    started = now()
    results = []
    for i, path in enumerate(args.models):
        print(f"{path.name}:", flush=True)
        results.append(measure_model(path, i, args, peer_bin))
    peer_name = "llama-server"
    text = "\n\n".join(table(r, peer_name) for r in results)
    finish(f"\npagedllama and {peer_name} ({peer_bin or 'not run'}) · {args.threads} threads · "
           f"one server at a time · {started} – {now()}\n\n{text}",
           {"config": {**vars(args), "models": [str(m) for m in args.models]},
            "peer_bin": str(peer_bin) if peer_bin else None, "started": started,
            "finished": now(), "results": results,
            "comparison": {r["name"]: comparison_rows(r) for r in results}},
           args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
