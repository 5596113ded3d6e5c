"""Configuration from environment variables, and the optional models file (YAML) and models
folder: the catalogue of models this process may serve, and the memory they may take."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pydantic import ValidationError

from engine import EngineConfig
from server.durations import parse_keep_alive
from server.http.limits import EdgeLimits
from server.sampling import TUNABLE, Tuned

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
    pin: bool = False                       # loaded at start-up and never unloaded
    keep_alive: float = 300.0               # seconds idle before it is unloaded (< 0: never)


# where the server keeps its state (the Batch API's store, the reasoning key) without
# PAGEDLLAMA_STATE_DIR; the start-up probes' answers too, without PAGEDLLAMA_PROBE_DIR
DEFAULT_STATE_DIR = Path.home() / ".cache" / "pagedllama"


@dataclass
class BatchSettings:
    """The Batch API (server/batch/): where its store lives and what it takes."""
    state_dir: Path = DEFAULT_STATE_DIR   # the store: state_dir/batch
    max_file_bytes: int = 100 * 1024**2   # an uploaded file
    max_lines: int = 50_000               # request lines in one batch
    max_active: int = 4                   # batches not finished (validating, running, ...)
    concurrency: int = 8                  # batch lines in flight at once (all batches)

    @property
    def directory(self) -> Path:
        return self.state_dir / "batch"


@dataclass
class CacheSettings:
    """The prefix cache's RAM and disk tiers (kvcache/snapshots/, docs/prefix-cache.md)."""
    ram: int | None = None          # most bytes in RAM; None: what the memory budget leaves
    disk_dir: Path | None = None    # None: no disk tier
    disk: int = 16 * 1024**3        # most bytes on disk
    min_tokens: int = 512           # a sequence saved when it holds at least this many


@dataclass
class Settings:
    models: list[ModelSpec]
    log_level: str = "info"
    api_key: str | None = None
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    max_n: int = 8                          # most choices (n) one request may ask for
    elastic_threads: bool = True            # a context alone with work uses idle ones' threads
    repack_weights: bool = False            # llama.cpp's repacked weight layouts (engine.Model)
    memory_budget: int = 0                  # bytes the loaded models may take together
    memory_budget_source: str = ""          # where the budget came from (for the log)
    load_timeout: float = 300.0             # seconds a request waits for its model to load
    beyond_trained: bool = False            # n_ctx may exceed the model's trained context
    max_output: int | None = None           # most tokens one answer may have (llama-server's -n)
    tools_first: bool = True                # tool definitions before the system text (prompts)
    reasoning_key: str | None = None        # seals reasoning (server/openai/sealing.py)
    state_dir: Path = DEFAULT_STATE_DIR     # the reasoning key's file when no key is given
    batch: BatchSettings = field(default_factory=BatchSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PAGEDLLAMA_{name}", default)


def _flag(name: str, default: bool) -> bool:
    return _env(name, "1" if default else "0").strip().lower() in ("1", "true", "yes", "on")


def state_dir() -> Path:
    """PAGEDLLAMA_STATE_DIR: where the server keeps its state."""
    return Path(_env("STATE_DIR", "") or DEFAULT_STATE_DIR)


def probe_dir() -> Path:
    """PAGEDLLAMA_PROBE_DIR: where the speculative-decoding probes' answers are kept across
    restarts (engine/speculation.py); default: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME")
    return Path(_env("PROBE_DIR", "") or (Path(base) / "pagedllama" if base
                                           else DEFAULT_STATE_DIR))


def cors_origins() -> list[str]:
    """PAGEDLLAMA_CORS_ORIGINS: comma-separated origins (or `*`); none: no CORS headers."""
    return [o.strip() for o in _env("CORS_ORIGINS", "").split(",") if o.strip()]


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
        cache_seqs=int(_env("CACHE_SEQS", "0")),
        swap_tokens=_int_or_none("SWAP_TOKENS"),
        adaptive_threads=_flag("ADAPTIVE_THREADS", True),
        speculative=_env("SPECULATIVE", "ngram").strip().lower() or "ngram",
        max_draft=int(_env("MAX_DRAFT", "8")),
        embed_tokens=int(_env("EMBED_MAX_TOKENS", "2048")),
        probe_dir=str(probe_dir()),
    )


TEMPLATES = Path(__file__).resolve().parent.parent / "engine" / "templates"


def chat_template_path(value: str, base: Path, where: str) -> Path:
    """A chat template given by name (a file of engine/templates: `chatml`, `gemma`) or as a
    Jinja file (relative to `base`), as llama-server's --chat-template / --chat-template-file."""
    named = TEMPLATES / f"{value}.jinja"
    if "/" not in value and named.is_file():
        return named
    path = Path(value) if Path(value).is_absolute() else (base / value).resolve()
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise ValueError(f"{where}: no file {path}, and not a template name ({names})")
    return path


def chat_template_from_env() -> Path | None:
    value = _env("CHAT_TEMPLATE", "").strip()
    return chat_template_path(value, Path.cwd(), "PAGEDLLAMA_CHAT_TEMPLATE") if value else None


def model_name(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def gpu_layers_from_env() -> int | None:
    """PAGEDLLAMA_GPU_LAYERS: layers to offload with a GPU build; None (unset): llama.cpp's
    default, all."""
    gpu = _env("GPU_LAYERS", "")
    return int(gpu) if gpu else None


def load_settings() -> Settings:
    base = engine_from_env()
    keep_alive = parse_keep_alive(_env("KEEP_ALIVE", "300"), "PAGEDLLAMA_KEEP_ALIVE")
    models_file, models_dir = _env("MODELS_FILE", ""), _env("MODELS_DIR", "")
    models: list[ModelSpec] = []
    if models_file:
        models = _models_from_file(Path(models_file), base, keep_alive)
    if models_dir:
        models += _models_from_dir(Path(models_dir), base, keep_alive, models)
    if not models_file and not models_dir:   # one model, loaded at start-up as it always was
        path = Path(_env("MODEL", str(DEFAULT_MODEL)))
        models = [ModelSpec(_env("MODEL_NAME", model_name(path)), path, base,
                            int(_env("CONTEXTS", "1")), gpu_layers=gpu_layers_from_env(),
                            chat_template=chat_template_from_env(), pin=True, keep_alive=-1)]
    if not models:
        raise ValueError(f"PAGEDLLAMA_MODELS_DIR={models_dir}: no .gguf file there")
    _partition_threads(models)
    budget, source = memory_budget_from_env()
    batch = batch_from_env()
    return Settings(models, _env("LOG_LEVEL", "info"), os.environ.get("PAGEDLLAMA_API_KEY"),
                    edge_from_env(models, batch), int(_env("MAX_N", "8")),
                    _flag("ELASTIC_THREADS", True), _flag("REPACK_WEIGHTS", False),
                    budget, source, float(_env("LOAD_TIMEOUT", "300")),
                    _flag("N_CTX_BEYOND_TRAINED", False), _int_or_none("MAX_OUTPUT"),
                    _flag("TOOLS_FIRST", True), os.environ.get("PAGEDLLAMA_REASONING_KEY") or None,
                    batch.state_dir, batch, cache_from_env())


def cache_from_env() -> CacheSettings:
    """PAGEDLLAMA_CACHE_RAM (bytes, 0 turns the RAM tier off; unset: what the memory budget
    leaves), PAGEDLLAMA_CACHE_DIR (the disk tier's directory; unset: no disk tier),
    PAGEDLLAMA_CACHE_DISK (its byte limit), PAGEDLLAMA_CACHE_MIN_TOKENS."""
    ram = _env("CACHE_RAM", "").strip()
    directory = _env("CACHE_DIR", "").strip()
    settings = CacheSettings(
        ram=parse_bytes(ram, "PAGEDLLAMA_CACHE_RAM") if ram else None,
        disk_dir=Path(directory).expanduser().resolve() if directory else None,
        disk=parse_bytes(_env("CACHE_DISK", "16GiB"), "PAGEDLLAMA_CACHE_DISK"),
        min_tokens=int(_env("CACHE_MIN_TOKENS", "512")))
    if settings.min_tokens < 1:
        raise ValueError("PAGEDLLAMA_CACHE_MIN_TOKENS must be at least 1")
    return settings


def batch_from_env() -> BatchSettings:
    """PAGEDLLAMA_BATCH_*: the Batch API's limits; its store under PAGEDLLAMA_STATE_DIR."""
    values = {"BATCH_MAX_FILE_BYTES": parse_bytes(_env("BATCH_MAX_FILE_BYTES", "100MiB"),
                                                  "PAGEDLLAMA_BATCH_MAX_FILE_BYTES"),
              **{name: int(_env(name, default)) for name, default in (
                  ("BATCH_MAX_LINES", "50000"), ("BATCH_MAX_ACTIVE", "4"),
                  ("BATCH_CONCURRENCY", "16"))}}
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"PAGEDLLAMA_{name} must be at least 1")
    return BatchSettings(state_dir(), values["BATCH_MAX_FILE_BYTES"], values["BATCH_MAX_LINES"],
                         values["BATCH_MAX_ACTIVE"], values["BATCH_CONCURRENCY"])


_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}
DEFAULT_BUDGET_SHARE = 0.75


def parse_bytes(text: str, name: str) -> int:
    """A size in bytes: `8GiB`, `512 MiB`, `1.5G` (K, M, G, T and KiB... are powers of 1024;
    KB, MB, GB, TB powers of 1000), or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: expected bytes, e.g. 8GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int:
    """Memory this process could still take: the machine's available memory, or less where a
    cgroup (a container's limit) leaves less."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)


def memory_budget_from_env() -> tuple[int, str]:
    """PAGEDLLAMA_MEMORY_BUDGET: bytes (with a unit), or a share of the available memory
    (`60%`); default 75 % of the memory available at start-up."""
    raw = _env("MEMORY_BUDGET", "").strip()
    if raw.endswith("%"):
        try:
            share = float(raw[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ValueError(f"PAGEDLLAMA_MEMORY_BUDGET={raw!r}: a share must be in (0%, 100%]")
        return int(available_memory() * share), f"{raw} of the available memory"
    if raw:
        budget = parse_bytes(raw, "PAGEDLLAMA_MEMORY_BUDGET")
        if budget <= 0:
            raise ValueError("PAGEDLLAMA_MEMORY_BUDGET must be more than 0 bytes")
        return budget, "PAGEDLLAMA_MEMORY_BUDGET"
    return (int(available_memory() * DEFAULT_BUDGET_SHARE),
            f"{DEFAULT_BUDGET_SHARE:.0%} of the available memory")


def default_max_body_bytes(models: list[ModelSpec]) -> int:
    """64 KiB plus 64 bytes per token of the longest context: room for any prompt that can fit
    (dense text is 4-12 bytes a token even with JSON escapes) and no more."""
    return 64 * 1024 + 64 * max(m.engine.n_ctx for m in models)


# what a multipart upload adds around its file (boundaries, part headers, the purpose field)
MULTIPART_ROOM = 64 * 1024


def edge_from_env(models: list[ModelSpec], batch: BatchSettings | None = None) -> EdgeLimits:
    body = _env("MAX_BODY_BYTES", "")
    batch = batch or BatchSettings()
    return EdgeLimits(
        max_body_bytes=int(body) if body else default_max_body_bytes(models),
        read_timeout=float(_env("READ_TIMEOUT", "10")),
        keepalive_timeout=float(_env("KEEPALIVE_TIMEOUT", "5")),
        max_header_bytes=int(_env("MAX_HEADER_BYTES", str(16 * 1024))),
        drain_seconds=float(_env("DRAIN_SECONDS", str(EdgeLimits.drain_seconds))),
        protect_metrics=_flag("PROTECT_METRICS", False),
        max_upload_bytes=batch.max_file_bytes + MULTIPART_ROOM)


_ENGINE_KEYS = {f.name for f in fields(EngineConfig)}
_ALIASES = {"context_size": "n_ctx", "ctx_size": "n_ctx", "sequences": "max_seqs",
            "threads": "n_threads"}


SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})$")


def _models_from_dir(folder: Path, base: EngineConfig, keep_alive: float,
                     listed: list[ModelSpec]) -> list[ModelSpec]:
    """PAGEDLLAMA_MODELS_DIR: every .gguf file in the folder, named by its file name (without
    .gguf; a split model by its first part, without the -00001-of-0000N). Files the models file
    already lists are left to it; projector files (mmproj-*) are not models of their own."""
    if not folder.is_dir():
        raise ValueError(f"PAGEDLLAMA_MODELS_DIR={folder}: not a folder")
    taken = {s.path.resolve() for s in listed}
    names = {s.name for s in listed}
    specs = []
    for path in sorted(folder.glob("*.gguf")):
        stem = model_name(path)
        part = SPLIT_PART.search(stem)
        if part and int(part.group(1)) != 1 or stem.lower().startswith("mmproj"):
            continue
        if path.resolve() in taken:
            continue
        name = SPLIT_PART.sub("", stem)
        if name in names:
            raise ValueError(f"PAGEDLLAMA_MODELS_DIR: {path.name} would be served as {name!r}, "
                             "a name the models file already gives another model")
        names.add(name)
        specs.append(ModelSpec(name, path, base, keep_alive=keep_alive))
    return specs


def _models_from_file(path: Path, base: EngineConfig,
                      keep_alive: float = 300.0) -> list[ModelSpec]:
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
        pin = entry.pop("pin", False)
        if not isinstance(pin, bool):
            raise ValueError(f"{path}: models[{i}].pin must be true or false")
        entry_keep_alive = parse_keep_alive(entry.pop("keep_alive", keep_alive),
                                            f"{path}: models[{i}].keep_alive")
        gpu_layers = entry.pop("gpu_layers", None)
        chat_template = entry.pop("chat_template", None)
        if chat_template is not None:
            chat_template = chat_template_path(str(chat_template), path.parent,
                                               f"{path}: models[{i}].chat_template")
        defaults = sampling_defaults(entry.pop("defaults", None) or {},
                                     f"{path}: models[{i}].defaults")
        overrides = {_ALIASES.get(k, k): v for k, v in entry.items()}
        unknown = set(overrides) - _ENGINE_KEYS
        if unknown:
            raise ValueError(f"{path}: models[{i}] has unknown keys {sorted(unknown)}")
        if not model_path.is_file():
            raise ValueError(f"{path}: models[{i}].path: no file {model_path}")
        specs.append(ModelSpec(name, model_path, replace(base, **overrides), contexts, defaults,
                               None if gpu_layers is None else int(gpu_layers), chat_template,
                               pin, entry_keep_alive))
    return specs


# the sampling values a model may default (a request's own value wins): server/sampling.py
SAMPLING_DEFAULTS = tuple(TUNABLE)


def sampling_defaults(raw: object, where: str) -> dict:
    """A models file's per-model `defaults`, checked as a request's fields are (types, ranges),
    so that a typo or a bad value stops the server at start-up instead of being ignored or
    failing every request later. A null value means no default."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(f"{where} has keys that are not per-model sampling defaults {unknown} "
                         f"(allowed: {', '.join(SAMPLING_DEFAULTS)})")
    given = {k: v for k, v in raw.items() if v is not None}
    try:
        checked = Tuned(**given)
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
