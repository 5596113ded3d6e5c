"""A machine that is not ours alone: a steady load on our server (and llama-server when one is
found) alone, next to one busy process, alone again, and with --quota inside a CPU quota; the
throughput kept, how soon it recovers, and who used the cores in each phase
(docs/benchmarks.md, "neighbor").

    python -m benchmarks.neighbor [--peer-bin .peer/build/bin/llama-server] [--quota 1.5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil

from benchmarks.harness import datasets as ds
from benchmarks.harness.client import RequestOutput, first_model, make_client, payload, send
from benchmarks.harness.launch import (
    ServerSpec,
    cpu_seconds,
    env_items,
    find_peer_bin,
    launched,
    llama_server,
    our_server,
    server_process,
)
from benchmarks.harness.metrics import finish
from benchmarks.harness.options import CHAT, add, parser
from benchmarks.harness.workload import calibrate, warmup

NEIGHBOUR = [sys.executable, "-c", "while True: pass"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("benchmarks.neighbor", __doc__, "model", "threads", "parallel", "concurrency",
               "input_len", "output_len", concurrency=4, output_len=48)
    p.add_argument("--phase-seconds", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=3.0, help="seconds skipped at a phase start")
    p.add_argument("--quota", type=float, default=0.0, help="also run inside this CPU quota")
    add(p, "peer_bin")
    p.add_argument("--no-peer", action="store_true")
    add(p, "our_env", "seed", "result_file")
    return p.parse_args(argv)


# ---- load -------------------------------------------------------------------------------------------
async def steady_load(base: str, model: str, cal: ds.Calibration, args, seconds: float,
                      marks: dict[str, float], on_time) -> list[RequestOutput]:
    """--concurrency streams that start a new request as soon as one ends, for `seconds`.
    on_time(elapsed) is polled every 0.1 s (it starts and stops the neighbour)."""
    url, outs = base + CHAT, []
    start = time.perf_counter()
    marks["start"] = start
    stop_at = start + seconds
    rng = random.Random(args.seed)

    async def stream(client: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.perf_counter() < stop_at:
            conv = ds.random_dataset(1, args.input_len, cal, rng.randrange(1 << 30), f"n{k}-{i}")[0]
            body = payload(model, ds.chat_messages(conv, 0), True, args.output_len, True)
            out = await send(client, url, body, True, timeout=max(1.0, stop_at - time.perf_counter() + 60))
            outs.append(out)
            i += 1

    async def clock() -> None:
        while time.perf_counter() < stop_at:
            on_time(time.perf_counter() - start)
            await asyncio.sleep(0.1)

    async with make_client(args.concurrency, 600.0) as client:
        await asyncio.gather(clock(), *(stream(client, k) for k in range(args.concurrency)))
    return outs


def token_bins(outs: list[RequestOutput], start: float, seconds: float) -> list[int]:
    bins = [0] * (int(seconds) + 2)
    for out in outs:
        for t in out.chunk_times:
            i = int(t - start)
            if 0 <= i < len(bins):
                bins[i] += 1
    return bins


def threads_back(samples: list[tuple[float, list[int]]], on: float, off: float) -> float | None:
    """Seconds from `off` until the thread counts (samples of (elapsed, counts)) are again
    what they were before `on`; None when they never are, or nothing was sampled."""
    before = [counts for t, counts in samples if t < on]
    if not before:
        return None
    full = before[-1]
    return next((t - off for t, counts in samples if t >= off and counts == full), None)


async def poll_threads(base: str, seconds: float, samples: list) -> None:
    """Our contexts' thread counts from /health every 0.25 s for `seconds`, as (perf_counter
    time, counts); returns at once for a server without them (llama-server)."""
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while time.perf_counter() < end:
            try:
                health = (await client.get(f"{base}/health")).json()
            except (httpx.HTTPError, ValueError):
                return
            contexts = thread_contexts(health)
            if not contexts:
                return
            samples.append((time.perf_counter(), [c["threads"] for c in contexts]))
            await asyncio.sleep(0.25)


def rate(bins: list[int], t0: float, t1: float) -> float:
    seg = bins[int(t0):int(t1)]
    return sum(seg) / len(seg) if seg else 0.0


def recovery_time(bins: list[int], t_stop: float, target: float, width: int = 2) -> float | None:
    """Seconds after t_stop until a `width`-second window first averages >= target."""
    for i in range(int(t_stop), len(bins) - width + 1):
        if sum(bins[i:i + width]) / width >= target:
            return max(0.0, i - t_stop)
    return None


# ---- who used the CPU ----------------------------------------------------------------------------
class CpuLedger:
    """Cumulative CPU seconds of the machine, the server, this client and the neighbour."""

    def __init__(self, server: psutil.Process | None):
        self.server, self.me = server, psutil.Process()
        self.neighbour: float = 0.0          # CPU seconds of neighbours that have ended
        self.marks: list[tuple[float, dict]] = []

    def mark(self, neighbour: psutil.Process | None = None) -> None:
        busy = psutil.cpu_times()
        self.marks.append((time.perf_counter(), {
            "machine": busy.user + busy.nice + busy.system + busy.irq + busy.softirq
                       + getattr(busy, "steal", 0.0),
            "server": cpu_seconds(self.server), "client": cpu_seconds(self.me),
            "neighbour": self.neighbour + cpu_seconds(neighbour)}))

    def phases(self) -> list[dict]:
        out = []
        for (t0, a), (t1, b) in zip(self.marks, self.marks[1:]):
            cores = {k: (b[k] - a[k]) / (t1 - t0) for k in a}
            cores["background"] = max(0.0, cores["machine"] - cores["server"] - cores["client"]
                                      - cores["neighbour"])
            out.append({k: round(v, 2) for k, v in cores.items()})
        return out


# ---- the neighbour and the quota ---------------------------------------------------------------------
class Neighbour:
    def __init__(self):
        self.proc: subprocess.Popen | None = None

    @property
    def ps(self) -> psutil.Process | None:
        return psutil.Process(self.proc.pid) if self.proc else None

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(NEIGHBOUR)

    def stop(self, ledger: CpuLedger | None = None) -> None:
        if self.proc is not None:
            if ledger is not None:
                ledger.neighbour += cpu_seconds(self.ps)
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def cgroup_root() -> tuple[str, Path] | None:
    """('v2', /sys/fs/cgroup) or ('v1', the cpu controller's mount) when we may make cgroups."""
    if os.geteuid() != 0:
        return None
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text():
        return "v2", v2
    for cand in (Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu")):
        if (cand / "cpu.cfs_quota_us").exists():
            return "v1", cand
    return None


@contextmanager
def quota_cgroup(cores: float):
    """A fresh cgroup limited to `cores` CPUs; yields a command prefix that runs a process in
    it (a shell that moves itself into the cgroup, then execs)."""
    found = cgroup_root()
    if found is None:
        raise RuntimeError("a CPU quota needs root and a cgroup cpu controller")
    kind, root = found
    path = root / f"pagedllama-bench-{os.getpid()}"
    path.mkdir(exist_ok=True)
    period = 100_000
    if kind == "v2":
        try:
            (root / "cgroup.subtree_control").write_text("+cpu")
        except OSError:
            pass
        (path / "cpu.max").write_text(f"{int(cores * period)} {period}")
    else:
        (path / "cpu.cfs_period_us").write_text(str(period))
        (path / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
    try:
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# ---- one server -----------------------------------------------------------------------------------
def thread_contexts(health: dict) -> list[dict]:
    """The contexts of a /health answer that report threads (ours); [] for other servers."""
    contexts = [c for m in health.get("models", {}).values() for c in m.get("contexts", [])]
    return contexts if contexts and "threads" in contexts[0] else []


def our_thread_figures(base: str) -> dict:
    try:
        health = httpx.get(f"{base}/health", timeout=5.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return {}
    contexts = thread_contexts(health)
    if not contexts:
        return {}
    return {"threads_now": [c["threads"] for c in contexts],
            "thread_changes": sum(c.get("thread_changes", 0) for c in contexts)}


async def ready(base: str, args) -> tuple[str, ds.Calibration]:
    """The server's model, its chat calibration, and warm-up requests."""
    model = first_model(base)
    cal = await calibrate(base, CHAT, model, args.seed)
    await warmup(base, CHAT, model, args.concurrency, args.seed)
    return model, cal


async def neighbour_run(base: str, args) -> dict:
    model, cal = await ready(base, args)
    T, neighbour, marks = args.phase_seconds, Neighbour(), {}
    phases = {"neighbour_on": None, "neighbour_off": None}
    ledger = CpuLedger(server_process(base))

    def on_time(elapsed: float) -> None:
        if not ledger.marks:
            ledger.mark()
        if phases["neighbour_on"] is None and elapsed >= T:
            ledger.mark()
            neighbour.start()
            phases["neighbour_on"] = elapsed
        elif phases["neighbour_off"] is None and elapsed >= 2 * T:
            ledger.mark(neighbour.ps)
            neighbour.stop(ledger)
            phases["neighbour_off"] = elapsed

    polled: list[tuple[float, list[int]]] = []
    try:
        outs, _ = await asyncio.gather(steady_load(base, model, cal, args, 3 * T, marks, on_time),
                                       poll_threads(base, 3 * T, polled))
        ledger.mark()
    finally:
        neighbour.stop()
    bins = token_bins(outs, marks["start"], 3 * T)
    on, off = phases["neighbour_on"] or T, phases["neighbour_off"] or 2 * T
    samples = [(t - marks["start"], counts) for t, counts in polled]
    alone = rate(bins, args.settle, on)
    shared = rate(bins, on + args.settle, off)
    after = rate(bins, off + args.settle, 3 * T)
    return {"alone_tok_s": alone, "shared_tok_s": shared, "after_tok_s": after,
            "kept": shared / alone if alone else None,
            "recovery_s": recovery_time(bins, off, 0.95 * alone),
            "threads_back_s": threads_back(samples, on, off) if samples else None,
            "errors": sum(1 for o in outs if not o.ok and o.error != "cancelled"),
            "bins": bins, "neighbour_on_s": on, "neighbour_off_s": off,
            "cpu_cores_by_phase": ledger.phases(),
            **our_thread_figures(base)}


async def quota_run(base: str, args) -> dict:
    model, cal = await ready(base, args)
    marks: dict[str, float] = {}
    seconds = args.phase_seconds
    outs = await steady_load(base, model, cal, args, seconds, marks, lambda _: None)
    bins = token_bins(outs, marks["start"], seconds)
    return {"quota_tok_s": rate(bins, args.settle, seconds), **our_thread_figures(base)}


def with_prefix(spec: ServerSpec, prefix: list[str]) -> ServerSpec:
    return ServerSpec(spec.name, prefix + spec.cmd, spec.port, spec.env, spec.cwd)


def servers(args) -> list[tuple[str, callable]]:
    env = env_items(args.our_env)
    out = [("pagedllama", lambda: our_server(args.model, args.threads, env=env))]
    peer = None if args.no_peer else find_peer_bin(args.peer_bin)
    if peer is not None:
        out.append(("llama-server", lambda: llama_server(peer, args.model, args.threads,
                                                         args.parallel)))
    return out


def run(args) -> dict:
    results = {}
    for name, make in servers(args):
        with launched(make()) as base:
            print(f"{name}: alone / neighbour / alone, {args.phase_seconds:.0f} s each",
                  file=sys.stderr)
            results[name] = asyncio.run(neighbour_run(base, args))
        if args.quota > 0:
            with ExitStack() as stack:
                prefix = stack.enter_context(quota_cgroup(args.quota))
                base = stack.enter_context(launched(with_prefix(make(), prefix)))
                print(f"{name}: inside a quota of {args.quota} cores", file=sys.stderr)
                q = asyncio.run(quota_run(base, args))
            r = results[name]
            r["quota_tok_s"] = q["quota_tok_s"]
            r["quota_kept"] = q["quota_tok_s"] / r["alone_tok_s"] if r["alone_tok_s"] else None
        print(summary_line(name, results[name]), file=sys.stderr)
    return results


def summary_line(name: str, r: dict) -> str:
    rec = f"{r['recovery_s']:.1f} s" if r.get("recovery_s") is not None else "not within the phase"
    line = (f"{name}: alone {r['alone_tok_s']:.1f} tok/s, next to a busy process "
            f"{r['shared_tok_s']:.1f} ({100 * (r['kept'] or 0):.0f}% kept), after "
            f"{r['after_tok_s']:.1f}; back to 95% in {rec}")
    if "quota_tok_s" in r:
        line += f"; quota {r['quota_tok_s']:.1f} ({100 * (r['quota_kept'] or 0):.0f}% kept)"
    if "thread_changes" in r:
        line += f"; thread changes {r['thread_changes']}"
    if r.get("threads_back_s") is not None:
        line += f"; threads back {r['threads_back_s']:.1f} s after it stops"
    cpu = r.get("cpu_cores_by_phase") or []
    if cpu:
        line += "\n  cores used (alone / neighbour / after): " + " / ".join(
            f"server {c['server']}, client {c['client']}, neighbour {c['neighbour']}, "
            f"background {c['background']}" for c in cpu)
    return line


def table(results: dict, args) -> str:
    cols = ["alone tok/s", "next to a busy process", "kept", "back to 95% after it stops",
            "threads back"]
    if args.quota > 0:
        cols += [f"quota {args.quota:g} cores", "kept"]
    lines = ["| server | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        rec = f"{r['recovery_s']:.1f} s" if r.get("recovery_s") is not None else "–"
        back = r.get("threads_back_s")
        cells = [f"{r['alone_tok_s']:.1f}", f"{r['shared_tok_s']:.1f}",
                 f"{100 * (r['kept'] or 0):.0f}%", rec, "–" if back is None else f"{back:.1f} s"]
        if args.quota > 0:
            cells += [f"{r.get('quota_tok_s', 0):.1f}", f"{100 * (r.get('quota_kept') or 0):.0f}%"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if len(results) == 2:
        ours, peer = results.get("pagedllama"), results.get("llama-server")
        if ours and peer and peer["shared_tok_s"]:
            lines.append(f"\nnext to a busy process, pagedllama / llama-server: "
                         f"{ours['shared_tok_s'] / peer['shared_tok_s']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    finish(table(results, args), {"args": vars(args), "results": results}, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
