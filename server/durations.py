"""Durations as clients and settings write them: seconds, or Ollama's strings ("10m", "1h30m",
"-1"). Its own module, so that request bodies (server/openai/schemas.py) and settings
(server/config.py) both read them without importing each other."""
from __future__ import annotations

import math
import re

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")


def parse_keep_alive(value: object, where: str) -> float:
    """A keep-alive in seconds: a number, or Ollama's duration strings (`"10m"`, `"1h30m"`,
    `"45s"`, `"-1"`). Negative: never unload; 0: unload as soon as idle."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected seconds or a duration such as \"5m\"")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            body = text.removeprefix("-")   # one sign for the whole duration, as Go's
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{where}: {value!r:.40} is not seconds or a duration such as "
                                 "\"5m\", \"1h30m\" or \"-1\"") from None
            scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
            seconds = sum(float(n) * scale[u] for n, u in parts)
            seconds = -seconds if text.startswith("-") else seconds
    else:
        raise ValueError(f"{where}: expected seconds or a duration such as \"5m\"")
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: {value!r:.40} is not a finite duration")
    return -1.0 if seconds < 0 else seconds
