"""The command-line options the benchmarks share, declared once. `parser()` starts a scenario's
parser with the shared options it names (a scenario may give one another default or help
text); `add()` puts shared options into a group of its own; the scenario adds the rest."""
from __future__ import annotations

import argparse
import math

from benchmarks.harness.datasets import TOKENS_PER_WORD
from benchmarks.harness.launch import DEFAULT_MODEL

CHAT = "/v1/chat/completions"
ENDPOINTS = ["/v1/completions", CHAT]
TARGET = ("base_url", "endpoint", "served_model")   # the server a client-side benchmark talks to


def _option(*flags: str, **spec) -> tuple[tuple[str, ...], dict]:
    return flags, spec


OPTIONS: dict[str, tuple[tuple[str, ...], dict]] = {
    # servers the benchmark starts
    "model": _option("--model", default=str(DEFAULT_MODEL), help="GGUF file"),
    "threads": _option("--threads", type=int, default=2, help="llama.cpp threads"),
    "parallel": _option("--parallel", type=int, default=16, help="llama-server -np"),
    "n_ctx": _option("--n-ctx", type=int, default=2048, help="context per sequence"),
    "our_env": _option("--our-env", action="append", default=[], metavar="KEY=VALUE",
                       help="extra environment for our server (PAGEDLLAMA_...)"),
    "peer_bin": _option("--peer-bin", default=None,
                        help="llama-server binary (default: $LLAMA_SERVER_BIN, "
                             ".peer/build/bin/llama-server, or llama-server on PATH)"),
    "a": _option("--a", default="ours", help="ours, llama-server or a loopback URL"),
    "b": _option("--b", default="llama-server", help="ours, llama-server or a loopback URL"),
    "a_env": _option("--a-env", action="append", default=[], metavar="PAGEDLLAMA_NAME=VALUE",
                     help="a setting for A when it is ours (repeat for more)"),
    "b_env": _option("--b-env", action="append", default=[], metavar="PAGEDLLAMA_NAME=VALUE",
                     help="a setting for B when it is ours (repeat for more)"),
    "kv_unified": _option("--kv-unified", action="store_true",
                          help="one KV pool for all sequences (default: split)"),
    "attention": _option("--attention", choices=("flash", "plain"), default="flash",
                         help="attention kernel (default: flash)"),
    # a server that is running already
    "base_url": _option("--base-url", default="http://127.0.0.1:8000"),
    "endpoint": _option("--endpoint", default="/v1/completions", choices=ENDPOINTS),
    "served_model": _option("--model", default=None,
                            help="default: the first id in /v1/models"),
    "warmup": _option("--warmup", type=int, default=1, help="unmeasured requests sent first"),
    "calibrate": _option("--calibrate", default="probe", choices=["probe", "approx"],
                         help="prompt length: probe the server's usage, or assume "
                              f"{TOKENS_PER_WORD} token per word"),
    # the workload
    "num_prompts": _option("--num-prompts", type=int, default=64, help="requests"),
    "concurrency": _option("--concurrency", type=int, default=16, help="requests at a time"),
    "input_len": _option("--input-len", type=int, default=64, help="prompt tokens"),
    "output_len": _option("--output-len", type=int, default=64,
                          help="tokens out per request (max_tokens)"),
    "num_prefixes": _option("--num-prefixes", type=int, default=4,
                            help="distinct system prompts"),
    "shared_len": _option("--shared-len", type=int, default=500,
                          help="tokens of each system prompt"),
    "prefix_len": _option("--prefix-len", type=int, default=512,
                          help="tokens of each system prompt"),
    "streams": _option("--streams", type=int, default=8,
                       help="streams running when the long prompt arrives"),
    "long_len": _option("--long-len", type=int, default=2000, help="tokens of the long prompt"),
    "stream_output_len": _option("--stream-output-len", type=int, default=1024,
                                 help="max_tokens of a stream (it is stopped earlier)"),
    "request_rate": _option("--request-rate", type=float, default=math.inf,
                            help="Poisson arrivals per second; inf = all at once"),
    "temperature": _option("--temperature", type=float, default=0.0,
                           help="every request's temperature (0: greedy, the default)"),
    "ignore_eos": _option("--ignore-eos", action="store_true"),
    "seed": _option("--seed", type=int, default=0),
    # the run
    "reps": _option("--reps", type=int, default=1,
                    help="alternating repetitions (median kept)"),
    "rounds": _option("--rounds", type=int, default=1, help="alternating rounds"),
    "quick": _option("--quick", action="store_true", help="a tiny run for tests"),
    "request_timeout": _option("--request-timeout", type=float, default=600.0),
    "time_limit": _option("--time-limit", type=float, default=1800.0,
                          help="seconds for each run"),
    "disable_tqdm": _option("--disable-tqdm", action="store_true"),
    "result_file": _option("--result-file", default=None, help="write the JSON result here"),
}


def add(group, *names: str, **changes):
    """Add the shared options `names` to a parser or group, in that order. A change is a new
    default, or a dict of argparse keywords (default, help, ...) for that option."""
    unknown = set(changes) - set(names)
    if unknown:
        raise TypeError(f"changes for options not added: {', '.join(sorted(unknown))}")
    for name in names:
        flags, spec = OPTIONS[name]
        change = changes.get(name, {})
        group.add_argument(*flags, **{**spec, **(change if isinstance(change, dict)
                                                 else {"default": change})})
    return group


def parser(module: str, doc: str | None, *names: str, **changes) -> argparse.ArgumentParser:
    """`python -m <module>`'s parser: the module's docstring above the options, and the shared
    options `names` (see add())."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return add(p, *names, **changes)
