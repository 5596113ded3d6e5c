"""Speculative decoding without a draft model: our server with it (PAGEDLLAMA_SPECULATIVE=ngram)
against ours without it (off), llama-server without, and llama-server with its draftless types
(--spec-type ngram-mod, ngram-simple), on an extractive set (answers that copy their prompts:
benchmarks/data/extractive.jsonl) and on random chat prompts, at several stream counts, greedy
and sampled.

All servers are up at once and take turns, as `benchmarks.paired` does: each round gives every
server the same slice of requests, in an order that alternates between rounds, so that a machine
whose speed drifts slows every server alike; ratios are taken within a round, and their median
reported. Per server and setting: output tok/s end to end (the slice's output tokens over its
wall time), the decode phase of a stream (output tokens after the first over the time after the
first token, per request, averaged), TPOT p50, the drafted tokens' acceptance and the tokens a
sequence gets per step (output tokens over sequence-steps: output minus accepted drafts), the
server's CPU time per output token, and whether greedy answers are the same on every run.

    python -m benchmarks.speculative                                  # everything (about 1 h)
    python -m benchmarks.speculative --workloads extractive --streams 1 --modes greedy --rounds 4
    python -m benchmarks.speculative --servers ours,ours-off --streams 16
"""
from __future__ import annotations

import asyncio
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import first_model
from benchmarks.harness.launch import (
    cpu_seconds,
    find_peer_bin,
    launched,
    llama_server,
    our_server,
    server_process,
)
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import alternate, run_workload

# name -> (kind, our settings or llama-server's extra arguments)
SERVERS: dict[str, tuple[str, dict[str, str] | list[str]]] = {
    "ours": ("ours", {"PAGEDLLAMA_SPECULATIVE": "ngram"}),
    "ours-off": ("ours", {"PAGEDLLAMA_SPECULATIVE": "off"}),
    "llama-server": ("llama-server", []),
    "llama-server ngram-mod": ("llama-server", ["--spec-type", "ngram-mod"]),
    "llama-server ngram-simple": ("llama-server", ["--spec-type", "ngram-simple"]),
}
BASELINE = "ours-off"
# sampled runs: what llama-server samples with by default, sent to every server
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# requests a slice holds, by stream count
SLICE = {1: 8, 4: 16, 16: 32}


def parse_args(argv: list[str] | None = None):
    p = parser("benchmarks.speculative", __doc__, "model", "threads", "n_ctx", "seed",
               "result_file")
    p.add_argument("--servers", default=",".join(SERVERS),
                   help=f"comma-separated, of: {', '.join(SERVERS)}")
    p.add_argument("--workloads", default="extractive,random",
                   help="extractive (benchmarks/data/extractive.jsonl) and/or random chat")
    p.add_argument("--streams", default="1,4,16", help="concurrent streams, comma-separated")
    p.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled")
    p.add_argument("--rounds", type=int, default=4, help="slices each server runs per setting")
    p.add_argument("--slice", type=int, default=None,
                   help="requests a slice (default: 8, 16, 32 at 1, 4, 16 streams)")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens (default: 200 extractive, 128 random)")
    p.add_argument("--random-input-len", type=int, default=64)
    add(p.add_argument_group("our server"), "our_env", "peer_bin")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; one of {', '.join(SERVERS)}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.streams = [int(x) for x in args.streams.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    return args


@dataclass
class Slice:
    """One server's run of one slice."""
    report: dict
    texts: list[str | None]          # per request: its answer, None where it failed
    decode_tok_s: list[float]        # per request: output tokens after the first / time after
    cpu_s: float
    drafted: int | None
    accepted: int | None

    @property
    def output_tokens(self) -> int:
        return self.report["total_output_tokens"]


@dataclass
class Setting:
    workload: str
    mode: str
    streams: int
    slices: dict[str, list[Slice]] = field(default_factory=dict)


async def spec_counts(base: str) -> tuple[int, int] | None:
    """Our server's drafted and accepted tokens so far (/stats); None for another server."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            r = await client.get(f"{base}/stats")
        if r.status_code != 200:
            return None
        stats = r.json()
        return int(stats["spec_draft_tokens"]), int(stats["spec_accepted_tokens"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def conversations(workload: str, n: int, round_: int, args) -> list[ds.Conversation]:
    if workload == "extractive":
        pool = ds.extractive_dataset()
        start = (round_ * n) % len(pool)
        return [pool[(start + i) % len(pool)] for i in range(n)]
    return ds.random_dataset(n, args.random_input_len, ds.Calibration(), args.seed + round_,
                             kind="speculative")


async def run_slice(name: str, base: str, model: str, convs: list[ds.Conversation], setting,
                    args) -> Slice:
    fresh = [ds.Conversation(list(c.user_turns), c.system, c.plain, c.tag) for c in convs]
    extractive = setting.workload == "extractive"
    output_len = args.output_len or (200 if extractive else 128)
    sampling = SAMPLED if setting.mode == "sampled" else {"temperature": 0.0}
    proc = server_process(base)
    cpu0, counts0 = cpu_seconds(proc), await spec_counts(base)
    report, outputs = await run_workload(
        base, CHAT, model, fresh, max_concurrency=setting.streams, output_len=output_len,
        ignore_eos=not extractive, temperature=sampling["temperature"],
        extra_body={k: v for k, v in sampling.items() if k != "temperature"},
        seed=args.seed, progress=False)
    cpu1, counts1 = cpu_seconds(proc), await spec_counts(base)
    decode = [(o.output_tokens - 1) / (o.end - o.chunk_times[0]) for o in outputs
              if o.ok and o.output_tokens > 1 and o.chunk_times and o.end > o.chunk_times[0]]
    if counts0 is not None and counts1 is not None:
        drafted, accepted = counts1[0] - counts0[0], counts1[1] - counts0[1]
    elif any(o.drafted is not None for o in outputs):
        drafted = sum(o.drafted or 0 for o in outputs)
        accepted = sum(o.draft_accepted or 0 for o in outputs)
    else:
        drafted = accepted = None
    texts = [c.answers[0] if c.answers else None for c in fresh]
    return Slice(report, texts, decode, cpu1 - cpu0, drafted, accepted)


async def run(bases: dict[str, str], models: dict[str, str], args) -> list[Setting]:
    for name, base in bases.items():   # warm-up, not recorded
        warm = ds.random_dataset(4, 32, ds.Calibration(), args.seed, kind="warm")
        await run_workload(base, CHAT, models[name], warm, max_concurrency=4, output_len=8,
                           ignore_eos=True, progress=False)
    settings = []
    for workload in args.workloads:
        for mode in args.modes:
            for streams in args.streams:
                setting = Setting(workload, mode, streams, {n: [] for n in bases})
                n = args.slice or SLICE.get(streams, 2 * streams)
                for r in range(args.rounds):
                    convs = conversations(workload, n, r, args)
                    for name in alternate(list(bases), r):
                        s = await run_slice(name, bases[name], models[name], convs, setting, args)
                        setting.slices[name].append(s)
                        print(f"{workload} {mode} {streams} streams, round {r + 1}, {name}: "
                              f"{s.report['output_throughput']:.1f} tok/s"
                              + (f", {s.report['failed']} failed" if s.report["failed"] else ""),
                              file=sys.stderr, flush=True)
                settings.append(setting)
    return settings


def summarize(setting: Setting) -> dict:
    out = {}
    base = setting.slices.get(BASELINE)
    for name, slices in setting.slices.items():
        tok_s = [s.report["output_throughput"] for s in slices]
        decode = [x for s in slices for x in s.decode_tok_s]
        out_tokens = sum(s.output_tokens for s in slices)
        drafted = [s.drafted for s in slices if s.drafted is not None]
        accepted = [s.accepted for s in slices if s.accepted is not None]
        acc = sum(accepted) / sum(drafted) if drafted and sum(drafted) else None
        per_step = (out_tokens / (out_tokens - sum(accepted))
                    if accepted and out_tokens > sum(accepted) else None)
        row = {"tok_s": statistics.median(tok_s),
               "decode_tok_s": statistics.mean(decode) if decode else None,
               "tpot_p50_ms": statistics.median(s.report["median_tpot_ms"] for s in slices),
               "acceptance": acc, "drafted": sum(drafted) if drafted else None,
               "tokens_per_step": per_step,
               "cpu_ms_per_token": 1000 * sum(s.cpu_s for s in slices) / max(1, out_tokens),
               "failed": sum(s.report["failed"] for s in slices)}
        if base is not None:
            ratios = [a.report["output_throughput"] / b.report["output_throughput"]
                      for a, b in zip(slices, base) if b.report["output_throughput"] > 0]
            dec = [statistics.mean(a.decode_tok_s) / statistics.mean(b.decode_tok_s)
                   for a, b in zip(slices, base) if a.decode_tok_s and b.decode_tok_s]
            row["ratio"] = statistics.median(ratios) if ratios else None
            row["ratios"] = ratios
            row["decode_ratio"] = statistics.median(dec) if dec else None
        out[name] = row
    return out


def identical(settings: list[Setting], a: str, b: str) -> tuple[int, int]:
    """Greedy requests whose answers from servers a and b (every run of each: all stream
    counts and rounds) are one and the same text; and how many requests were compared. An
    extractive request is the same request at every stream count. A request that failed in any
    run has no answer to compare there: it is compared, and never identical."""
    pool = len(ds.extractive_dataset())
    texts: dict[tuple, set[str | None]] = {}
    for st in settings:
        if st.mode != "greedy" or a not in st.slices or b not in st.slices:
            continue
        for r, (sa, sb) in enumerate(zip(st.slices[a], st.slices[b])):
            n = len(sa.texts)
            for i in range(n):
                key = (("extractive", (r * n + i) % pool) if st.workload == "extractive"
                       else (st.workload, st.streams, r, i))
                texts.setdefault(key, set()).update({sa.texts[i], sb.texts[i]})
    return sum(1 for v in texts.values() if len(v) == 1 and None not in v), len(texts)


def table(settings: list[Setting], args) -> str:
    lines = []
    for st in settings:
        rows = summarize(st)
        lines.append(f"\n{st.workload} · {st.mode} · {st.streams} stream(s) · {args.rounds} "
                     f"rounds of {args.slice or SLICE.get(st.streams, 2 * st.streams)}")
        lines.append(f"{'server':28}{'tok/s':>8}{'× off':>7}{'decode/s':>10}{'× off':>7}"
                     f"{'TPOT p50':>10}{'accept':>8}{'tok/step':>9}{'CPU ms/tok':>11}")
        for name, r in rows.items():
            def f(v, fmt):
                width = int(fmt.split(".")[0])
                return format(v, fmt) if v is not None else "n/a".rjust(width)
            lines.append(f"{name:28}{r['tok_s']:8.1f}{f(r.get('ratio'), '7.2f')}"
                         f"{f(r['decode_tok_s'], '10.1f')}{f(r.get('decode_ratio'), '7.2f')}"
                         f"{r['tpot_p50_ms']:8.1f}ms{f(r['acceptance'], '8.2f')}"
                         f"{f(r['tokens_per_step'], '9.2f')}{r['cpu_ms_per_token']:11.1f}"
                         + (f"  {r['failed']} failed" if r["failed"] else ""))
    names = list(settings[0].slices) if settings else []
    pairs = [(a, b) for a, b in (("ours", "ours-off"),
                                 ("llama-server ngram-mod", "llama-server"),
                                 ("llama-server ngram-simple", "llama-server"))
             if a in names and b in names]
    for a, b in pairs:
        same, n = identical(settings, a, b)
        if n:
            lines.append(f"greedy answers identical, {a} and {b} (every run): {same} of {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        bases = {}
        for name in args.servers:
            kind, extra = SERVERS[name]
            if kind == "ours":
                env = dict(extra) if isinstance(extra, dict) else {}
                for item in args.our_env:
                    k, _, v = item.partition("=")
                    env[k] = v
                spec = our_server(args.model, args.threads, args.n_ctx, env=env)
            else:
                binary = find_peer_bin(args.peer_bin)
                if binary is None:
                    raise SystemExit("llama-server not found (scripts/build_llama_server.sh)")
                spec = llama_server(binary, args.model, args.threads, 16, args.n_ctx,
                                    extra=list(extra) + ["--metrics"])
            spec.name = name.replace(" ", "-")
            bases[name] = stack.enter_context(launched(spec))
        models = {name: first_model(url) for name, url in bases.items()}
        settings = asyncio.run(run(bases, models, args))
    result = {"benchmark": "speculative", "args": vars(args),
              "settings": [{"workload": s.workload, "mode": s.mode, "streams": s.streams,
                            "servers": summarize(s)} for s in settings]}
    finish(table(settings, args), result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
