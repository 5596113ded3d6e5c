"""The models this process serves: each GGUF loaded once (weights, tokenizer, chat template),
its contexts (workers) started, its embedding context made on first use, and all of it closed
at the end. A context's threads come from a CoreBudget shared by every context when there are
several (elastic threads, engine/threads.py)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine import ChatTemplate, Model, Observer, Worker
from engine.embedding import Embedder
from engine.gguf_info import gguf_facts
from engine.threads import CoreBudget
from server.config import ModelSpec, Settings, total_threads
from server.service.prompts import TokenBound

log = logging.getLogger("pagedllama.request")


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
        """How tools reach the prompt (server/chat/tools.py): "template" when the chat template
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


def load_models(settings: Settings, observer: Observer | None) -> dict[str, LoadedModel]:
    """Load every model of the settings and start its contexts (a file listed twice is loaded
    once and shared)."""
    models: dict[str, LoadedModel] = {}
    loaded: dict[str, Model] = {}
    bounds: dict[str, TokenBound] = {}
    budget = core_budget(settings)
    for spec in settings.models:
        key = str(spec.path.resolve())
        model = loaded.get(key) or Model(spec.path, spec.gpu_layers, settings.repack_weights)
        loaded[key] = model
        bound = bounds.get(key) or TokenBound(model.byte_weights())
        bounds[key] = bound
        workers = [Worker(f"{spec.name}/{i}", model, spec.engine, observer,
                          publish_prefixes=spec.contexts > 1,   # for the router
                          budget=budget)
                   for i in range(spec.contexts)]
        template = None
        source = (spec.chat_template.read_text() if spec.chat_template is not None
                  else model.chat_template)   # the models file's chat_template wins
        if source:
            template = ChatTemplate(source, model.token_text(model.bos_id),
                                    model.token_text(model.eos_id))
        embedder = Embedder(model, spec.engine.n_ctx, spec.engine.n_threads)
        lm = LoadedModel(spec, model, workers, gguf_facts(spec.path), template, embedder, bound)
        models[spec.name] = lm
        for w in workers:
            w.gather.incoming = lambda lm=lm: lm.preparing   # a burst starts in one step
            w.start()
        log.info("serving %s from %s: %d context(s) x %d threads, n_ctx %d, %d sequences, "
                 "%s %s KV, %s attention", spec.name, spec.path, spec.contexts,
                 spec.engine.n_threads, spec.engine.n_ctx, spec.engine.max_seqs,
                 "unified" if spec.engine.kv_unified else "split", spec.engine.kv_type,
                 "flash" if workers[0].config.flash_attn else "plain")
        log.info("%s: tool_format %s%s%s", spec.name,   # server/chat/tools.py
                 lm.tool_format or "none (no chat template)",
                 ", thinks" if template is not None and template.thinks else "",
                 f", chat template from {spec.chat_template}" if spec.chat_template else "")
    return models


def core_budget(settings: Settings) -> CoreBudget | None:
    """Elastic threads: with several contexts (of one model or several) and a CPU build, a
    context that computes alone uses the idle ones' threads too (engine/threads.py)."""
    specs = settings.models
    if (not settings.elastic_threads or sum(s.contexts for s in specs) < 2
            or any(s.gpu_layers for s in specs)):
        return None
    return CoreBudget(total_threads(specs))


def close_models(models: dict[str, LoadedModel]) -> None:
    for lm in models.values():
        for w in lm.workers:
            w.stop()
        lm.embed_executor.shutdown(wait=True, cancel_futures=True)
        lm.embedder.close()
    for model in {id(lm.model): lm.model for lm in models.values()}.values():
        model.close()
