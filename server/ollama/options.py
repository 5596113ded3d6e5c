"""Ollama's `options` onto the service's request: the sampling values (`Sampling`), the token
limit (`num_predict`) and the context (`num_ctx`).

Rule: an option is served, or accepted at the value that changes nothing, or refused with a 400
naming it; never ignored where ignoring it would change the answer. The options that only say
how Ollama runs a model (`num_gpu`, `num_thread`, `use_mmap`, `num_batch`, ...) change no answer
and are accepted whatever their value; `mirostat`, `typical_p` and `tfs_z` only at their
neutral value; an option this server does not know is refused.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from server.errors import APIError
from server.sampling import Float, Int, tunable
from server.service.request import Sampling

Bool = Annotated[bool, Field(strict=True)]
PENALTY_WINDOW = 64   # the tokens the engine's penalties look back over (SamplingParams)

# option -> the value at which it changes nothing: any other value is refused
NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


class OllamaOptions(BaseModel):
    """Ollama's `options` (its Modelfile parameters): the ones served, the neutral ones, and
    the ones about how a model runs, which change no answer."""
    model_config = ConfigDict(extra="forbid")

    # served
    num_predict: Int | None = Field(None, ge=-2, description="-1: no limit; -2: fill the context")
    temperature: Float | None = tunable("temperature")
    top_k: Int | None = tunable("top_k")
    top_p: Float | None = tunable("top_p")
    min_p: Float | None = tunable("min_p")
    seed: Int | None = None
    stop: list[str] | None = Field(None, max_length=16)
    repeat_penalty: Float | None = tunable("repetition_penalty")
    presence_penalty: Float | None = tunable("presence_penalty")
    frequency_penalty: Float | None = tunable("frequency_penalty")
    repeat_last_n: Int | None = Field(None, ge=-1)
    num_ctx: Int | None = Field(None, ge=1)
    # at their neutral value only (NEUTRAL)
    mirostat: Int | None = None
    mirostat_tau: Float | None = None    # only used by mirostat
    mirostat_eta: Float | None = None
    typical_p: Float | None = None
    tfs_z: Float | None = None
    # how Ollama runs the model: no answer changes
    num_keep: Int | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    num_thread: Int | None = None
    use_mmap: Bool | None = None
    use_mlock: Bool | None = None
    numa: Bool | None = None
    low_vram: Bool | None = None
    f16_kv: Bool | None = None
    vocab_only: Bool | None = None
    logits_all: Bool | None = None
    embedding_only: Bool | None = None
    penalize_newline: Bool | None = None


def refused(name: str, why: str) -> APIError:
    return APIError(400, f"options.{name}: {why}", "unsupported_parameter", f"options.{name}")


def check(options: OllamaOptions | None) -> None:
    """A 400 for an option at a value this server would not honour."""
    if options is None:
        return
    for name, neutral in NEUTRAL.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise refused(name, f"only {neutral} (off) is served here; another value would "
                          "change the answer")
    if options.num_predict == 0:
        raise APIError(400, "options.num_predict: 0 asks for no answer; give at least 1, or -1 "
                       "(no limit)", "invalid_value", "options.num_predict")
    if options.stop is not None and any(not s for s in options.stop):
        raise APIError(400, "options.stop: a stop string cannot be empty", "invalid_value",
                       "options.stop")
    last_n = options.repeat_last_n
    penalized = ((options.repeat_penalty or 1.0) != 1.0 or bool(options.presence_penalty)
                 or bool(options.frequency_penalty))
    if penalized and last_n is not None and last_n != PENALTY_WINDOW:
        raise refused("repeat_last_n", f"only {PENALTY_WINDOW} (the engine's penalty window, "
                      "Ollama's default) is served with a penalty")


def sampling(options: OllamaOptions | None) -> Sampling:
    """The sampling values the service takes: each option's, else None (the model's default
    from a models file, else the engine's)."""
    o = options or OllamaOptions()
    return Sampling(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p,
                    seed=o.seed, stop=tuple(o.stop or ()), repetition_penalty=o.repeat_penalty,
                    presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty)


def max_tokens(options: OllamaOptions | None, top_level: int | None = None) -> int | None:
    """`num_predict`: a limit, or None (-1: no limit, -2: until the context is full; both end
    with the context here). `top_level`: a body's own `num_predict` (Open WebUI writes it
    there), used when the options give none."""
    n = options.num_predict if options is not None else None
    n = top_level if n is None else n
    if n == 0:
        raise APIError(400, "num_predict: 0 asks for no answer; give at least 1, or -1 (no "
                       "limit)", "invalid_value", "num_predict")
    return None if n is None or n < 0 else n


def within_context(options: OllamaOptions | None, prompt_tokens: int, limit: int | None,
                   context: int) -> int | None:
    """The token limit once the prompt is known: `num_ctx` (capped to the model's context
    `context`) bounds the prompt and its answer; a prompt that leaves no room in it is a 400."""
    num_ctx = options.num_ctx if options is not None else None
    if num_ctx is None:
        return limit
    room = min(num_ctx, context) - prompt_tokens
    if room < 1:
        raise APIError(400, f"options.num_ctx: the prompt has {prompt_tokens} tokens, which "
                       f"leaves no room for an answer within {min(num_ctx, context)}",
                       "context_length_exceeded", "options.num_ctx")
    return room if limit is None else min(limit, room)
