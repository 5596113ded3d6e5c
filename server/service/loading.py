"""Building a loaded model from a catalogued model's spec, and taking it apart: the llama.cpp
side of the catalogue (server/service/catalog.py), and what a model file says before it is
loaded.

Apart from the catalogue because the catalogue decides (on the event loop: the budget, each
model's state, the leases) and this module does the work it decides, seconds of llama.cpp calls
on the catalogue's load thread, never on the event loop. What a model takes before loading (its
GGUF header, its context capped to what it was trained on, its memory estimate) is read here
too: the catalogue counts that estimate against the budget before anything loads.

A loaded model: weights, tokenizer and chat template loaded once, its contexts (workers) started,
its embedding context made on first use (counted against the budget then). Catalogued models
naming one file share its weights (`ModelLoader`: loaded once, closed with the last of them).
A context's threads come from a CoreBudget shared by every context when there are several
(elastic threads, engine/threads.py).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from engine import ChatTemplate, Model, Observer, Worker
from engine.embedding import Embedder
from engine.gguf_info import GGUFHeader, gguf_facts, k_quant_file_type, read_header
from engine.memory import MemoryEstimate, ModelShape, estimate
from engine.model import gpu_offload_supported
from engine.threads import CoreBudget
from kvcache import PrefixStore
from server.config import ModelSpec, Settings, total_threads, usable_cores
from server.service.prompts import TokenBound

log = logging.getLogger("pagedllama.models")


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: Model
    workers: list[Worker]
    facts: dict
    template: ChatTemplate | None
    embedder: Embedder   # its own llama.cpp context, created on the first /v1/embeddings
    bound: TokenBound    # a lower bound on a text's tokens, before tokenizing it
    created: int = field(default_factory=lambda: int(time.time()))
    preparing: int = 0   # requests rendering / tokenizing their prompt now
    embed_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="embed"))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_seq_len(self) -> int:
        return min(w.max_seq_len for w in self.workers)

    @property
    def tool_format(self) -> str | None:
        """How tools reach the prompt (server/chat/tool_calls.py): "template" when the chat template
        renders them itself, "fallback" when they are described in the system message."""
        if self.template is None:
            return None
        return "template" if self.template.knows_tools else "fallback"

    @property
    def capacity(self) -> int:
        """Requests admitted at once (running + queued) before new ones get 429."""
        return sum(w.config.max_seqs + w.config.max_queue for w in self.workers)

    @property
    def in_flight(self) -> int:
        return self.preparing + sum(w.outstanding for w in self.workers)


class ModelLoader:
    """Loads and unloads models (on the catalogue's load thread, one at a time): the weights of
    one file are loaded once for every catalogued model naming it (module doc)."""

    def __init__(self, settings: Settings, observer: Observer | None, tiers: PrefixStore):
        self.settings, self.observer, self.tiers = settings, observer, tiers
        self.core_budget = core_budget(settings)
        self._shared: dict[str, tuple[Model, int]] = {}   # file -> (Model, entries using it)

    def load(self, spec: ModelSpec, facts: dict) -> LoadedModel:
        """The model's weights (or the shared ones), its contexts started, its chat template."""
        key = str(spec.path.resolve())
        model, users = self._shared.get(key, (None, 0))
        workers: list[Worker] = []
        try:
            if model is None:
                model = Model(spec.path, spec.gpu_layers, self.settings.repack_weights)
            self._shared[key] = (model, users + 1)
            bound = TokenBound(model.byte_weights())
            workers = [Worker(f"{spec.name}/{i}", model, spec.engine, self.observer,
                              publish_prefixes=spec.contexts > 1,   # for the router
                              budget=self.core_budget, tiers=self.tiers)
                       for i in range(spec.contexts)]
            template = None
            source = (spec.chat_template.read_text() if spec.chat_template is not None
                      else model.chat_template)   # the models file's chat_template wins
            if source:
                template = ChatTemplate(source, model.token_text(model.bos_id),
                                        model.token_text(model.eos_id))
        except Exception:
            for w in workers:
                w.context.close()
            self._drop_model(key)
            raise
        embedder = Embedder(model, spec.engine.embed_ctx, spec.engine.n_threads)
        lm = LoadedModel(spec, model, workers, facts, template, embedder, bound)
        for w in workers:
            w.gather.incoming = lambda lm=lm: lm.preparing   # a burst starts in one step
            w.start()
        return lm

    def unload(self, lm: LoadedModel) -> None:
        """Stop its contexts and close what it holds (the weights with the last user)."""
        for w in lm.workers:
            w.stop()
        lm.embed_executor.shutdown(wait=True, cancel_futures=True)
        lm.embedder.close()
        self._drop_model(str(lm.spec.path.resolve()))

    def _drop_model(self, key: str) -> None:
        model, users = self._shared.get(key, (None, 0))
        if model is None:
            return
        if users <= 1:
            del self._shared[key]
            model.close()
        else:
            self._shared[key] = (model, users - 1)


def spec_header(spec: ModelSpec) -> GGUFHeader:
    """A catalogued model's GGUF header (a ValueError naming the model when unreadable)."""
    try:
        return read_header(spec.path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {spec.name!r}: {exc}") from None


def cap_context(spec: ModelSpec, header: GGUFHeader, beyond: bool) -> None:
    """A context per sequence beyond what the model was trained on is capped there, as
    llama-server caps a slot (answers past it degrade), unless PAGEDLLAMA_N_CTX_BEYOND_TRAINED
    allows it (RoPE-scaled use, protocol tests with long prompts on a small model)."""
    arch = header.metadata.get("general.architecture")
    try:
        trained = int(header.metadata[f"{arch}.context_length"])
    except (KeyError, TypeError, ValueError):
        return
    if trained <= 0 or spec.engine.n_ctx <= trained:
        return
    if beyond:
        log.warning("%s: n_ctx %d is beyond the %d tokens the model was trained on "
                    "(PAGEDLLAMA_N_CTX_BEYOND_TRAINED): answers past %d may degrade",
                    spec.name, spec.engine.n_ctx, trained, trained)
        return
    log.warning("%s: n_ctx %d capped at %d, the context the model was trained on "
                "(PAGEDLLAMA_N_CTX_BEYOND_TRAINED=1 allows more)", spec.name, spec.engine.n_ctx,
                trained)
    spec.engine = replace(spec.engine, n_ctx=trained)


def spec_estimate(spec: ModelSpec,
                  header: GGUFHeader | None = None) -> tuple[dict, MemoryEstimate]:
    """A catalogued model's GGUF facts and memory estimate, from its header and settings."""
    header = header or spec_header(spec)
    on_gpu = bool(spec.gpu_layers != 0 and gpu_offload_supported())
    kind = SimpleNamespace(on_gpu=on_gpu, has_k_quants=k_quant_file_type(
        header.metadata.get("general.file_type")))
    config = spec.engine.resolved_for(kind)
    return (gguf_facts(spec.path, header),
            estimate(ModelShape.of(header), config.memory_shape(), spec.contexts))


def core_budget(settings: Settings) -> CoreBudget | None:
    """Elastic threads: with several contexts (of one model or several) and a CPU build, a
    context that computes alone uses the idle ones' threads too (engine/threads.py); never more
    threads at once than there are cores."""
    specs = settings.models
    if (not settings.elastic_threads or sum(s.contexts for s in specs) < 2
            or any(s.gpu_layers for s in specs)):
        return None
    return CoreBudget(min(total_threads(specs), usable_cores()))
