"""What every experiment shares: repeated timings summarised as median and spread, machine facts,
markdown tables, and writing JSON + PNG + markdown to the output folder."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def summary(samples: list[float]) -> dict:
    """Median and spread (min, max, and the spread as a share of the median) of repeated samples."""
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {"median": med, "min": lo, "max": hi, "n": len(samples),
            "spread_pct": 100 * (hi - lo) / med if med else 0.0, "samples": list(samples)}


def fmt(stat: dict, digits: int = 0) -> str:
    """"123 (118–130)": median with the min–max range; the range is omitted for one sample."""
    m = f"{stat['median']:.{digits}f}"
    return m if stat["n"] < 2 else f"{m} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def n_cores() -> int:
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    from engine import llama_cpp_version
    return {"cpu": cpu_model(), "cores": n_cores(), "load_average_start": os.getloadavg(),
            "llama_cpp_python": llama_cpp_version(), "python": platform.python_version(),
            "started": dt.datetime.now().isoformat(timespec="seconds")}


def finish_machine_info(info: dict) -> dict:
    info["load_average_end"] = os.getloadavg()
    info["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    return info


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(out: Path, name: str, result: dict, markdown: str, figure) -> dict[str, Path]:
    """<out>/<name>.json, .png and .md (the table(s) as printed)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "png": out / f"{name}.png", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    figure.savefig(paths["png"], dpi=80, bbox_inches="tight")
    plt.close(figure)
    _shrink_png(paths["png"])
    paths["md"].write_text(markdown + "\n")
    return paths


def _shrink_png(path: Path) -> None:
    """Plots have few colours: a 256-colour palette keeps them a few times smaller."""
    from PIL import Image
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value)}")


class Checkpoint:
    """Raw measurements saved as they come (<out>/<name>.partial.json), so that a long run which
    is killed resumes where it stopped when run again with the same settings."""

    def __init__(self, out: Path, name: str, key: dict):
        self.path = Path(out) / f"{name}.partial.json"
        self.key = json.loads(json.dumps(key, default=_jsonable))

    def load(self):
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return saved["data"] if saved.get("key") == self.key else None

    def save(self, data) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "data": data}, default=_jsonable))
        tmp.replace(self.path)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def figure(n_panels: int, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False,
                             layout="constrained")
    return fig, list(axes[0])
