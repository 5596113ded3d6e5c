"""Summaries of a benchmark run (the fields `vllm bench serve` reports), text tables, and the
JSON result file every benchmark writes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.harness.client import RequestOutput

PERCENTILES = (50, 90, 99)


def stats_ms(values: list[float], name: str) -> dict:
    """mean/median/p90/p99 (and max) of seconds, as milliseconds; zeros when there are none."""
    a = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a))}
    for p in PERCENTILES[1:]:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p))
    out[f"max_{name}_ms"] = float(a.max())
    return out


def summarize(outputs: list[RequestOutput], duration: float) -> dict:
    done = [o for o in outputs if o.ok]
    input_tokens = sum(o.prompt_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    cached = [o.cached_tokens for o in done if o.cached_tokens is not None]
    report = {
        "sent": len(outputs), "completed": len(done), "failed": len(outputs) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(cached) if cached else None,
        "usage_reported": all(o.usage_reported for o in done) if done else None,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": ((input_tokens + output_tokens) / duration
                                   if duration > 0 else 0.0),
    }
    report.update(stats_ms([o.ttft for o in done], "ttft"))
    report.update(stats_ms([t for o in done if (t := o.tpot) is not None], "tpot"))
    report.update(stats_ms([g for o in done for g in o.itl], "itl"))
    report.update(stats_ms([o.latency for o in done], "e2el"))
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.ok:
            key = o.error.split("\n")[0][:120]
            errors[key] = errors.get(key, 0) + 1
    report["errors"] = errors
    return report


def ruled(head: str, rows: list[str]) -> str:
    """A text table: the header line, a rule as long, the rows."""
    return "\n".join([head, "-" * len(head), *rows])


def table(report: dict, title: str = "Serving Benchmark Result") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value, fmt: str = "{:.2f}") -> None:
        if value is None or isinstance(value, str):
            text = value or "-"
        else:
            text = fmt.format(value)
        lines.append(f"{label:<34}{text:>{w - 34}}")

    row("Successful requests:", report["completed"], "{}")
    row("Failed requests:", report["failed"], "{}")
    row("Benchmark duration (s):", report["duration_s"])
    row("Total input tokens:", report["total_input_tokens"], "{}")
    row("Total generated tokens:", report["total_output_tokens"], "{}")
    row("Cached prompt tokens:", report.get("total_cached_tokens"), "{}")
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^{w}}")
        for stat in ("mean", "median", "p90", "p99", "max"):
            row(f"{stat.capitalize() if stat in ('mean', 'median', 'max') else stat.upper()} "
                f"{name.upper()} (ms):", report[f"{stat}_{name}_ms"])
    if report.get("errors"):
        lines.append(f"{' Errors ':-^{w}}")
        for msg, n in report["errors"].items():
            lines.append(f"{n:>5} × {msg}")
    lines.append("=" * w)
    return "\n".join(lines)


def write_result(path: str | Path, result: dict) -> None:
    """--result-file: the run as JSON (parent folders made; values JSON cannot take as text)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


def finish(text: str, result: dict, path: str | None) -> None:
    """A benchmark's end: print its table, and write its result to --result-file when named."""
    print(text)
    if path:
        write_result(path, result)
