"""The sampling values a request may tune and a models file's per-model `defaults` may preset,
defined once: `TUNABLE`, each value's JSON type and range. A request body's fields are made from
it (server/openai/bodies.py: SamplingFields, through tunable_fields), a models file's defaults
are checked against the same (server/config.py), and the engine's `SamplingParams`
(engine/sampling.py) holds them, with its defaults for a value nobody set. This module imports
no API module."""
from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any

from pydantic import BaseModel, Field, create_model

from engine.sampling import SamplingParams

INT32_MAX = 2**31 - 1
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]   # ints are still accepted

# name -> (JSON type, range); in this order in a models file's error messages
TUNABLE: dict[str, tuple[Any, dict[str, float]]] = {
    "temperature": (Float, {"ge": 0.0, "le": 2.0}),
    "top_k": (Int, {"ge": -1, "le": INT32_MAX}),
    "top_p": (Float, {"gt": 0.0, "le": 1.0}),
    "min_p": (Float, {"ge": 0.0, "le": 1.0}),
    # at least 1e-6: a smaller divisor overflows float32 logits (and 5e-324 is 0 there)
    "repetition_penalty": (Float, {"ge": 1e-6, "le": 10.0}),
    "presence_penalty": (Float, {"ge": -2.0, "le": 2.0}),
    "frequency_penalty": (Float, {"ge": -2.0, "le": 2.0}),
}
assert set(TUNABLE) <= {f.name for f in fields(SamplingParams)}, "the engine holds each"


def tunable(name: str) -> Any:
    """A body's field for a tunable value: optional (None: the model's default, else the
    engine's), within its range."""
    return Field(None, **TUNABLE[name][1])


def tunable_fields() -> dict[str, Any]:
    """The tunable values as a model's fields (pydantic's create_model), each as `tunable`."""
    return {name: (kind | None, tunable(name)) for name, (kind, _) in TUNABLE.items()}


# the tunable values, each optional, checked as a request's are (a models file's defaults)
Tuned: type[BaseModel] = create_model("Tuned", **tunable_fields())
