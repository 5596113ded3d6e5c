"""What every API surface hands the service: one engine-facing request, made at the surface's own
edge from its body (chat completions, completions, the Responses API, Anthropic's Messages API,
the native route). Below the API packages nothing reads a request body: the service sees prompt
tokens, sampling values, limits and the names of the fields its errors blame.

A sampling value left as None takes the model's default (a models file's `defaults`), else the
engine's; `max_tokens` None generates until the context ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass

from engine.sampling import SamplingParams

# What the service sets itself, not a request: the token limit (capped to the context), the
# grammar (GenerationRequest.grammar) and how far back penalties look.
SERVICE_SET = frozenset({"max_tokens", "grammar", "penalty_last_n"})
# A request's form of an engine value where it differs from the engine's.
_REQUEST_FORM = {
    "stop": (tuple[str, ...], ()),
    "logit_bias": (dict[str, float] | None, None),   # token id (as a string) -> bias
}

def _optional(kind) -> str:
    """A field's type (a string: engine/sampling.py uses postponed annotations), or None."""
    return kind if kind.endswith("| None") else f"{kind} | None"


# The engine's sampling values (engine/sampling.py: SamplingParams) as a request asks for them:
# every field the service does not set itself, None where not asked (the model's default
# applies, else the engine's); `stop` a tuple, `logit_bias` keyed by token id strings
# (checked against the model's vocabulary when it is submitted). `logprobs`: alternatives per
# token (None: no logprobs); `prompt_logprobs`: the prompt's own (completions echo).
Sampling = make_dataclass("Sampling", [
    (f.name, *_REQUEST_FORM.get(f.name, (_optional(f.type), None)))
    for f in fields(SamplingParams) if f.name not in SERVICE_SET], frozen=True,
    namespace={"__module__": __name__})


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
