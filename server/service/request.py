"""What every API surface hands the service: one engine-facing request, made at the surface's own
edge from its body (chat completions, completions, the Responses API, Anthropic's Messages API,
the native route). Below the API packages nothing reads a request body: the service sees prompt
tokens, sampling values, limits and the names of the fields its errors blame.

A sampling value left as None takes the model's default (a models file's `defaults`), else the
engine's; `max_tokens` None generates until the context ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias
    logprobs: int | None = None                  # alternatives per token; None: no logprobs
    prompt_logprobs: bool = False                # the prompt's own logprobs (completions echo)


@dataclass(frozen=True)
class Blame:
    """The request fields each kind of error names (`param` in OpenAI's errors)."""
    prompt: str = "prompt"             # too long for the context, empty, token ids out of range
    logit_bias: str = "logit_bias"
    logprobs: str = "top_logprobs"


@dataclass
class GenerationRequest:
    """One request for generation: `n` choices of each prompt (choice j of prompt i has index
    i * n + j). `grammar` (an llguidance grammar) constrains the output token by token;
    `affinity` (a session's key) keeps a session on the replica that served it; `deadline`
    is seconds before the request is ended (a timeout); `ignored_tools` names the hosted tools
    left out of the prompt, for the request log."""
    prompts: list[list[int]]
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None
    n: int = 1
    priority: int = 0
    deadline: float | None = None
    grammar: str | None = None
    affinity: str | None = None
    blame: Blame = field(default_factory=Blame)
    ignored_tools: tuple[str, ...] = ()
