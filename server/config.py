"""Configuration from environment variables, and the optional models file (YAML)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from engine import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSpec:
    name: str
    path: Path
    engine: EngineConfig
    contexts: int = 1                       # replicas: llama.cpp contexts of this model
    defaults: dict = field(default_factory=dict)   # per-model default sampling values
    gpu_layers: int | None = None           # layers offloaded with a GPU build (-1: all)
    chat_template: Path | None = None       # a Jinja chat template file instead of the GGUF's


@dataclass
class EdgeLimits:
    """What the HTTP edge accepts (server/http/edge.py, server/http/protocol.py)."""
    max_body_bytes: int = 192 * 1024   # 413 above this, before the body is parsed
    read_timeout: float = 10.0         # a request head, and each read of a body, within this
    keepalive_timeout: float = 5.0     # an idle connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line + headers; 431 above this
    drain_seconds: float = 30.0        # SIGTERM: time running requests get to finish
    protect_metrics: bool = False      # /metrics, /stats, /dashboard, /docs behind the API key


@dataclass
class Settings:
    models: list[ModelSpec]
    log_level: str = "info"
    api_key: str | None = None
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    max_n: int = 8                          # most choices (n) one request may ask for
    elastic_threads: bool = True            # a context alone with work uses idle ones' threads
    repack_weights: bool = False            # llama.cpp's repacked weight layouts (engine.Model)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PAGEDLLAMA_{name}", default)


def _flag(name: str, default: bool) -> bool:
    return _env(name, "1" if default else "0").strip().lower() in ("1", "true", "yes", "on")


def _int_or_none(name: str) -> int | None:
    value = _env(name, "").strip()
    return int(value) if value else None


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a cpuset or taskset narrows it)."""
    return len(os.sched_getaffinity(0)) or 1


def engine_from_env() -> EngineConfig:
    return EngineConfig(
        n_ctx=int(_env("N_CTX", "2048")),
        max_seqs=int(_env("MAX_SEQS", "16")),
        n_threads=int(_env("THREADS", str(usable_cores()))),
        max_batch_tokens=_int_or_none("MAX_BATCH_TOKENS"),   # None: by device (resolved_for)
        wave_batch_tokens=int(_env("WAVE_BATCH_TOKENS", "2048")),
        step_target_ms=float(_env("STEP_TARGET_MS", "500")),
        block_size=int(_env("BLOCK_SIZE", "8")),
        prefill_chunk=_int_or_none("PREFILL_CHUNK"),
        prefix_caching=_flag("PREFIX_CACHING", True),
        kv_unified=_flag("KV_UNIFIED", False),
        flash_attn=(None if _env("FLASH_ATTN", "auto").strip().lower() in ("", "auto")
                    else _flag("FLASH_ATTN", False)),
        kv_type=_env("KV_TYPE", "") or "f16",
        scheduler=_env("SCHEDULER", "fifo"),
        preemption=_env("PREEMPTION", "swap"),
        max_queue=int(_env("MAX_QUEUE", "256")),
        cache_seqs=int(_env("CACHE_SEQS", "16")),
        adaptive_threads=_flag("ADAPTIVE_THREADS", True),
        speculative=_env("SPECULATIVE", "off").strip().lower() or "off",
        max_draft=int(_env("MAX_DRAFT", "8")),
    )


def model_name(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def gpu_layers_from_env() -> int | None:
    """PAGEDLLAMA_GPU_LAYERS: layers to offload with a GPU build; None (unset): llama.cpp's
    default, all."""
    gpu = _env("GPU_LAYERS", "")
    return int(gpu) if gpu else None


def load_settings() -> Settings:
    base = engine_from_env()
    models_file = _env("MODELS_FILE", "")
    if models_file:
        models = _models_from_file(Path(models_file), base)
    else:
        path = Path(_env("MODEL", str(DEFAULT_MODEL)))
        models = [ModelSpec(_env("MODEL_NAME", model_name(path)), path, base,
                            int(_env("CONTEXTS", "1")), gpu_layers=gpu_layers_from_env())]
    _partition_threads(models)
    return Settings(models, _env("LOG_LEVEL", "info"), os.environ.get("PAGEDLLAMA_API_KEY"),
                    edge_from_env(models), int(_env("MAX_N", "8")),
                    _flag("ELASTIC_THREADS", True), _flag("REPACK_WEIGHTS", False))


def default_max_body_bytes(models: list[ModelSpec]) -> int:
    """64 KiB plus 64 bytes per token of the longest context: room for any prompt that can fit
    (dense text is 4-12 bytes a token even with JSON escapes) and no more."""
    return 64 * 1024 + 64 * max(m.engine.n_ctx for m in models)


def edge_from_env(models: list[ModelSpec]) -> EdgeLimits:
    body = _env("MAX_BODY_BYTES", "")
    return EdgeLimits(
        max_body_bytes=int(body) if body else default_max_body_bytes(models),
        read_timeout=float(_env("READ_TIMEOUT", "10")),
        keepalive_timeout=float(_env("KEEPALIVE_TIMEOUT", "5")),
        max_header_bytes=int(_env("MAX_HEADER_BYTES", str(16 * 1024))),
        drain_seconds=float(_env("DRAIN_SECONDS", str(EdgeLimits.drain_seconds))),
        protect_metrics=_flag("PROTECT_METRICS", False))


_ENGINE_KEYS = {f.name for f in fields(EngineConfig)}
_ALIASES = {"context_size": "n_ctx", "ctx_size": "n_ctx", "sequences": "max_seqs",
            "threads": "n_threads"}


def _models_from_file(path: Path, base: EngineConfig) -> list[ModelSpec]:
    import yaml

    doc = yaml.safe_load(path.read_text()) or {}
    entries = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a top-level 'models:' list")
    specs, names = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "path" not in entry:
            raise ValueError(f"{path}: models[{i}] needs 'name' and 'path'")
        entry = dict(entry)
        name, model_path = str(entry.pop("name")), Path(entry.pop("path"))
        if name in names:
            raise ValueError(f"{path}: model name {name!r} appears twice")
        names.add(name)
        if not model_path.is_absolute():
            model_path = (path.parent / model_path).resolve()
        contexts = int(entry.pop("contexts", 1))
        gpu_layers = entry.pop("gpu_layers", None)
        chat_template = entry.pop("chat_template", None)
        if chat_template is not None:
            chat_template = Path(chat_template)
            if not chat_template.is_absolute():
                chat_template = (path.parent / chat_template).resolve()
            if not chat_template.is_file():
                raise ValueError(f"{path}: models[{i}].chat_template: no file {chat_template}")
        defaults = sampling_defaults(entry.pop("defaults", None) or {},
                                     f"{path}: models[{i}].defaults")
        overrides = {_ALIASES.get(k, k): v for k, v in entry.items()}
        unknown = set(overrides) - _ENGINE_KEYS
        if unknown:
            raise ValueError(f"{path}: models[{i}] has unknown keys {sorted(unknown)}")
        specs.append(ModelSpec(name, model_path, replace(base, **overrides), contexts, defaults,
                               None if gpu_layers is None else int(gpu_layers), chat_template))
    return specs


# the sampling values a model may default (a request's own value wins): server/service/service.py
SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")


def sampling_defaults(raw: object, where: str) -> dict:
    """A models file's per-model `defaults`, checked as a request's fields are (types, ranges),
    so that a typo or a bad value stops the server at start-up instead of being ignored or
    failing every request later. A null value means no default."""
    from pydantic import ValidationError

    from server.openai.schemas import SamplingFields

    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(f"{where} has keys that are not per-model sampling defaults {unknown} "
                         f"(allowed: {', '.join(SAMPLING_DEFAULTS)})")
    given = {k: v for k, v in raw.items() if v is not None}
    try:
        checked = SamplingFields(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{where}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return {k: getattr(checked, k) for k in given}


def total_threads(models: list[ModelSpec]) -> int:
    """The threads of every context of every model: the process's partition."""
    return sum(m.engine.n_threads * m.contexts for m in models)


def _partition_threads(models: list[ModelSpec]) -> None:
    """Contexts together never use more threads than there are cores; each context knows its
    share of the process's threads (the thread governor scales the cores left to it by that)."""
    cores = usable_cores()
    total = total_threads(models)
    if total > cores:
        n_contexts = sum(m.contexts for m in models)
        per_context = max(1, cores // n_contexts)
        for m in models:
            m.engine = replace(m.engine, n_threads=min(m.engine.n_threads, per_context))
        total = total_threads(models)
    for m in models:
        m.engine = replace(m.engine, thread_share=m.engine.n_threads / total)
