"""One request's way in: its model held for the client that asked (server/service/client.py),
its prompt rendered and tokenized on the prompt pool (counted by admission control), and its
choices submitted to a context of its model. What comes back (events streamed or collected, the
end: finished, cancelled when the client leaves, or ended by a drain) is
server/service/generation.py. The models (the catalogue, loaded on demand within the memory
budget) are kept by server/service/catalog.py. Nothing here speaks HTTP."""
from __future__ import annotations

import asyncio
from dataclasses import fields, replace

from engine import ChatTemplateError, Observer, QueueFull, Request, SamplingParams, Worker
from server.chat.tool_calls import ToolUse, prompt_input
from server.config import Settings
from server.errors import APIError
from server.service.catalog import Models
from server.service.client import Client
from server.service.generation import Generation, Part, Running
from server.service.loading import LoadedModel
from server.service.prompts import PromptPool
from server.service.request import GenerationRequest
from server.service.routing import Affinity

ENGINE_DEFAULTS = SamplingParams()   # a value neither the request nor the model's defaults set
# names the hosted / server tools a request gave that this server does not run (left out of
# the prompt); the request log names them too (GenerationRequest.ignored_tools)
IGNORED_TOOLS_HEADER = "x-pagedllama-ignored-tools"


class ChatPrompt(list):
    """A chat prompt's token ids (a list), and whether its text ends inside a reasoning block
    the chat template opened (`<think>` at the end of the generation prompt): the answer then
    starts with reasoning (server/chat/answer.py)."""
    opens_thinking: bool = False


# What a thinking template writes for "no reasoning" (as Qwen3's does with enable_thinking off):
# an empty block, after which the model answers at once.
EMPTY_THINKING = "<think>\n\n</think>\n\n"


RANDOM_SEED = -1   # llama-server's "random": a fresh draw, as if no seed were given


def generator_seed(seed: int | None) -> int | None:
    """A request's seed in the generators' range [0, 2**64): any integer, negative and huge
    ones too, maps to one value there (seed mod 2**64), so the same seed gives the same answer;
    -1 (llama-server's "random", which many clients send) means no seed."""
    if seed is None or seed == RANDOM_SEED:
        return None
    return seed % 2**64


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: the request's for the first, derived for the others (they differ, the
    request stays reproducible, and choice 0 equals the same request with n = 1)."""
    return None if seed is None or i == 0 else (seed + i * 0x9E3779B9) & 0xFFFFFFFF


class Service:
    def __init__(self, settings: Settings, observer: Observer | None = None):
        self.settings, self.observer = settings, observer
        self.catalog: Models | None = None
        self.pool = PromptPool()
        self.routes = Affinity()
        self.running = Running()

    def start(self) -> None:
        """Read the catalogue and load the pinned models (not on the event loop's time: the
        server answers nothing before this returns)."""
        self.catalog = Models(self.settings, self.observer)
        self.catalog.start()

    @property
    def closing(self) -> bool:
        """A drain has ended what ran: nothing new starts."""
        return self.running.closing

    def end_all(self, message: str) -> int:
        """End every running request now (the end of a drain): Running.end_all."""
        return self.running.end_all(message)

    def stop(self) -> None:
        self.pool.close()
        if self.catalog is not None:
            self.catalog.close()

    @property
    def loaded(self) -> dict[str, LoadedModel]:
        """The models loaded now, by name (`catalog`: every model this process may serve)."""
        return self.catalog.loaded if self.catalog is not None else {}

    @property
    def workers(self) -> list[Worker]:
        return [w for lm in self.loaded.values() for w in lm.workers]

    def default_model(self) -> str:
        """The model a request that names none gets: the first loaded, else the first
        catalogued."""
        assert self.catalog is not None, "started"
        return next(iter(self.loaded), next(iter(self.catalog.entries)))

    async def get(self, name: str | None, client: Client, keep_alive: float | None = None,
                  reason: str = "request") -> LoadedModel:
        """The named model, loaded (waiting for its load if need be), held for the client until
        its exchange ends. `keep_alive`: the request's (Ollama's field), in seconds;
        `reason`: why it loads, for the log."""
        assert self.catalog is not None, "started"
        entry = self.catalog.entry(name)
        self._refuse_when_closing()
        client.hold(self.catalog.lease(entry, keep_alive))
        return await self.catalog.loaded_model(entry, client.is_disconnected, reason)

    async def reserve_embedding(self, lm: LoadedModel) -> None:
        """Count a model's embedding context against the memory budget before its first use
        (may unload idle models to make room; a 503 when it cannot)."""
        assert self.catalog is not None, "started"
        await self.catalog.reserve_embedding(self.catalog.entry(lm.name))

    # ---- prompts --------------------------------------------------------------------------------
    # Every rendering and tokenization of client text runs here, on the bounded prompt pool
    # (server/service/prompts.py): counted by admission control, dropped if the client leaves, and
    # refused without tokenizing when the token bound shows it cannot fit.
    async def chat_prompt(self, lm: LoadedModel, messages: list[dict], max_tokens: int | None,
                          client: Client, add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          use: ToolUse | None = None, param: str = "messages",
                          no_thinking: bool = False) -> ChatPrompt:
        """`use`: the request's tools, rendered as the model's tool_format says; `param`: the
        request field a too-long prompt is blamed on; `no_thinking`: a thinking model's answer
        starts after an empty reasoning block."""
        if lm.template is None:
            raise APIError(400, f"The model '{lm.name}' has no chat template in its GGUF file; "
                           "use /v1/completions with a plain prompt", "no_chat_template")
        messages, tools = self._tool_input(lm, messages, use)
        if len(messages) >= lm.max_seq_len:   # every message renders to a token at least
            raise _too_long(lm.max_seq_len, len(messages), max_tokens, param)
        cost = _text_size([messages, tools]) + 32 * len(messages)
        return await self.prepare(lm, cost, client, lambda: self._render_and_tokenize(
            lm, messages, max_tokens, add_generation_prompt, continue_final_message, tools, param,
            no_thinking))

    def count_chat_tokens(self, lm: LoadedModel, messages: list[dict], use: ToolUse | None,
                          prefill: bool, no_thinking: bool = False) -> int:
        """A chat prompt's length in tokens, rendered and tokenized here (on a prompt-pool
        thread: called from work that `prepare` runs)."""
        messages, tools = self._tool_input(lm, messages, use)
        return len(self._render_and_tokenize(lm, messages, None, not prefill, prefill, tools,
                                             no_thinking=no_thinking))

    def _tool_input(self, lm: LoadedModel, messages: list[dict],
                    use: ToolUse | None) -> tuple[list[dict], list[dict] | None]:
        """The messages and the template's `tools` for a request's tools (none: as they are)."""
        if use is None:
            return messages, None
        return prompt_input(messages, use, lm.template.knows_tools, self.settings.tools_first)

    async def text_prompt(self, lm: LoadedModel, text: str, max_tokens: int | None,
                          client: Client) -> list[int]:
        self._check_bound(lm, text, max_tokens, "prompt")
        return await self.prepare(lm, len(text), client, lambda: lm.model.tokenize(text, True))

    def _render_and_tokenize(self, lm: LoadedModel, messages: list[dict], max_tokens: int | None,
                             add_generation_prompt: bool, continue_final_message: bool,
                             tools: list[dict] | None = None, param: str = "messages",
                             no_thinking: bool = False) -> ChatPrompt:
        """On a prompt-pool thread."""
        try:
            text = lm.template.render(messages, add_generation_prompt, continue_final_message,
                                      tools, self.settings.tools_first)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "chat_template_error", "messages") from exc
        opens = lm.template.thinks and text.rstrip().endswith("<think>")
        if no_thinking and lm.template.thinks and add_generation_prompt:
            text = text.rstrip() + "\n\n</think>\n\n" if opens else text + EMPTY_THINKING
            opens = False
        self._check_bound(lm, text, max_tokens, param)
        add_special = not (lm.template.bos_token and text.startswith(lm.template.bos_token))
        prompt = ChatPrompt(lm.model.tokenize(text, add_special))
        prompt.opens_thinking = opens
        return prompt

    def _check_bound(self, lm: LoadedModel, text: str, max_tokens: int | None, param: str) -> None:
        """Reject, without tokenizing, a text that alone has more tokens than can fit (with
        room for one generated token: a larger max_tokens is capped at submission)."""
        at_least = lm.bound.at_least(text)
        if at_least + 1 > lm.max_seq_len:
            raise _too_long(lm.max_seq_len, at_least, max_tokens, param)

    async def prepare(self, lm: LoadedModel, cost: int, client: Client, work):
        """Run `work` (rendering / tokenizing client text; `cost` ~ its length in characters) on
        the prompt pool, counted by admission control, and dropped if the client goes away
        while it waits."""
        self._admit(lm)
        lm.preparing += 1
        try:
            return await _unless_disconnected(self.pool.run(cost, work), client)
        finally:
            lm.preparing -= 1

    def _admit(self, lm: LoadedModel) -> None:
        self._refuse_when_closing()
        if lm.in_flight >= lm.capacity:
            raise APIError(429, f"The server is overloaded ({lm.in_flight} requests in flight "
                           f"for {lm.name}); retry shortly.", "rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    # ---- one request --------------------------------------------------------------------------
    def generate(self, lm: LoadedModel, request: GenerationRequest, client: Client) -> Generation:
        """Validate and submit one request (its n choices of each prompt): the one way every
        API surface, the Batch API and the native route run a request. Its events come back
        through the Generation (`stream`, `collect`)."""
        parts: list[Part] = []
        try:
            for i, prompt in enumerate(request.prompts):
                queue = parts[0].req.queue if parts else None
                parts.append(self._submit(lm, prompt, request, i * request.n, queue))
        except APIError:
            for part in parts:
                for r in part.req.group:
                    part.worker.cancel(r)
            raise
        return Generation(lm, parts, client, self.running, request.ignored_tools)

    def _submit(self, lm: LoadedModel, prompt: list[int], request: GenerationRequest,
                index: int, queue: asyncio.Queue | None) -> Part:
        """Submit request.n choices of one prompt: the first, and n - 1 forks of it. A
        max_tokens beyond the context left after the prompt is capped there (as llama-server and
        Ollama do: agents ask for 32,000 whatever the model); the answer then ends with the
        context, finish reason "length". A prompt that alone leaves no room is a 400."""
        where = request.blame.prompt
        if not prompt:
            raise APIError(400, "the prompt is empty", "empty_prompt", where)
        if any(t < 0 or t >= lm.model.n_vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {lm.model.n_vocab})",
                           "invalid_token", where)
        limit = lm.max_seq_len
        if len(prompt) + 1 > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"the prompt has {len(prompt)} tokens, which leaves no room for the "
                           "completion. Please reduce the prompt.", "context_length_exceeded",
                           where)
        max_tokens = request.max_tokens
        if self.settings.max_output is not None:    # PAGEDLLAMA_MAX_OUTPUT
            cap = self.settings.max_output
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        if max_tokens is not None:
            max_tokens = min(max_tokens, limit - len(prompt))
        self._refuse_when_closing()
        params = self._sampling(lm, request, max_tokens)
        worker = self.routes.pick(lm.workers, prompt, request.affinity)
        req = Request(prompt, params, request.priority, request.deadline, index=index)
        req.forks = [Request(prompt, replace(params, seed=choice_seed(params.seed, j)),
                             request.priority, request.deadline, index=index + j)
                     for j in range(1, request.n)]
        try:
            worker.submit(req, queue)
        except QueueFull as exc:
            raise APIError(429, f"The server is overloaded ({exc}); retry shortly.",
                           "rate_limit_exceeded", headers={"Retry-After": "1"}) from exc
        return Part(worker, req)

    def _refuse_when_closing(self) -> None:
        if self.closing:
            raise APIError(503, "The server is shutting down.", "server_shutting_down",
                           headers={"Retry-After": "1"})

    def _sampling(self, lm: LoadedModel, request: GenerationRequest,
                  max_tokens: int | None) -> SamplingParams:
        """The engine's values: each as the request asked, else the model's default, else the
        engine's."""
        asked, model = request.sampling, lm.spec.defaults
        values = {}
        for f in fields(asked):
            value = getattr(asked, f.name)
            values[f.name] = (value if value is not None
                              else model.get(f.name, getattr(ENGINE_DEFAULTS, f.name)))
        values.update(top_k=max(0, values["top_k"]), seed=generator_seed(asked.seed),
                      stop=list(asked.stop), logit_bias=self._logit_bias(
                          lm, asked.logit_bias, request.blame.logit_bias))
        return SamplingParams(max_tokens=max_tokens, grammar=request.grammar, **values)

    @staticmethod
    def _logit_bias(lm: LoadedModel, bias: dict[str, float] | None,
                    where: str) -> dict[int, float]:
        out = {}
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < lm.model.n_vocab:
                raise APIError(400, f"logit_bias key {key!r} is not a token id of this model "
                               f"(0 to {lm.model.n_vocab - 1})", "invalid_value", where)
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias value for {key} must be in [-100, 100]",
                               "invalid_value", where)
            out[int(key)] = float(value)
        return out

def _text_size(value) -> int:
    """How many characters of text a message list holds (its strings, at any depth)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


def _too_long(limit: int, prompt_tokens: int, max_tokens: int | None, param: str) -> APIError:
    """A prompt that alone cannot fit (its length is a lower bound: counted without tokenizing)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, the "
                    f"prompt has at least {prompt_tokens} tokens, which leaves no room for the "
                    "completion. Please reduce the prompt.", "context_length_exceeded", param)


async def _unless_disconnected(work, client: Client):
    """Await `work`, polling the client every 0.5 s; if it has gone, cancel the work."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await client.is_disconnected():
                raise APIError(499, "client disconnected", "client_disconnected")
    finally:
        task.cancel()
