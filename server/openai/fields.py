"""Which request fields we serve, ignore on purpose, or refuse: the server never fails open.

A field that would change the answer and that we do not implement is a 400
`unsupported_parameter` naming it, never a 200 that silently dropped it. Fields that cannot
change the answer (`user`, `metadata`, `store`, …) are accepted and ignored. Fields no spec we
know names (a vendor extension such as vLLM's `guided_json` or `min_tokens`) are refused too:
such an extension almost always constrains or changes the output, so ignoring it is exactly the
silent failure this module exists to prevent; the error names the field, so a client learns at
once instead of from wrong output.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from server.http.errors import APIError

# Accepted and ignored: they label, store or route a request elsewhere, never change its tokens
# (SGLang's `rid` is a request id). Each has its type (a value of another is a 400 naming it);
# they stay extra fields at run time, declared in the OpenAPI schema (server/openai/bodies.py).
LABELS: dict[str, Any] = {
    "user": str, "metadata": dict[str, Any], "store": bool, "service_tier": str,
    "safety_identifier": str, "prompt_cache_key": str, "prompt_cache_retention": str,
    "rid": str | list[str]}
HARMLESS = frozenset(LABELS)

# OpenAI fields we know and do not implement (yet): any value other than "absent" is refused.
UNSUPPORTED_CHAT = frozenset({
    "audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
    "reasoning_effort", "verbosity"})
UNSUPPORTED_COMPLETION = frozenset({"suffix", "best_of"})

# Values equal to "not asked for": sending them is the same as leaving the field out (the
# OpenAPI schema declares each field with these values).
NEUTRAL: dict[str, tuple] = {"best_of": (None, 1)}

# sglang-router and smg (routers some put in front of replicas) forward requests re-serialized
# from their own request type, with SGLang's extension fields at their defaults; at those values
# they ask for nothing.
NEUTRAL.update({
    "no_stop_trim": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "separate_reasoning": (True,),
    "stream_reasoning": (True,), "return_hidden_states": (False,), "min_tokens": (0,),
    "logprob_start_len": (-1,), "return_text_in_logprobs": (False, True),
    "continue_final_message": (False,), "ignore_eos": (False,)})


def unsupported(field: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{field}' {why}", "unsupported_parameter", field)


def check_fields(body: BaseModel, unsupported_fields: frozenset[str]) -> None:
    """Raise a 400 for the first extra field that is neither harmless nor neutral, the
    request's own or its `stream_options`' ("stream_options.include_obfuscation" names one);
    a label of the wrong type is a 400 too."""
    check_types(body.model_extra or {}, LABELS)
    for name, value in (body.model_extra or {}).items():
        if name in HARMLESS or _neutral(name, value):
            continue
        if name in unsupported_fields:
            raise unsupported(name)
        raise unsupported(name, _UNKNOWN)
    check_stream_options(body)


def check_types(extra: dict[str, Any], types: dict[str, Any]) -> None:
    """Raise a 400 `invalid_value` for an accepted extra field (a label) whose value is not of
    its type (strictly: `"store": 1` is not a boolean); null is the same as leaving it out."""
    for name, kind in types.items():
        value = extra.get(name)
        if value is None:
            continue
        try:
            _adapter(kind).validate_python(value)
        except ValidationError as exc:
            raise APIError(400, f"{name}: {exc.errors()[0]['msg']}", "invalid_value",
                           name) from None


@cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind, config=ConfigDict(strict=True))


def check_keys(obj: dict, allowed: frozenset[str], where: str) -> None:
    """Raise a 400 for a key of this nested object (a response format, a tool) that no spec we
    know names, as "where.key": a misspelt `schema` must not quietly turn a schema into any
    JSON."""
    for key in obj:
        if key not in allowed:
            raise unsupported(f"{where}.{key}", _UNKNOWN)


def check_stream_options(body: BaseModel) -> None:
    """Raise a 400 for an unknown `stream_options` key (named "stream_options.<key>")."""
    options = getattr(body, "stream_options", None)
    for name, value in ((options.model_extra or {}).items() if options is not None else ()):
        if value is None or (name == "include_obfuscation" and value is False):
            continue   # we never pad deltas with obfuscation: false is what we do anyway
        raise unsupported(f"stream_options.{name}",
                          "is not supported by this server" if name == "include_obfuscation"
                          else _UNKNOWN)


_UNKNOWN = ("is not a field this server knows; it is refused rather than ignored, because "
            "ignoring it could silently change the answer")


def _neutral(name: str, value: Any) -> bool:
    """null, or a value equal to "not asked for" and of its type (`"min_tokens": false` is not
    0: the schema's enum does not take it either)."""
    return value is None or any(value == v and type(value) is type(v)
                                for v in NEUTRAL.get(name, ()))

