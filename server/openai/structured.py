"""Structured output: the request's constraint as one llguidance grammar, or a 400 naming what is
wrong.

Sources (at most one per request): OpenAI's `response_format` (`json_object`, `json_schema`),
llama-server's top-level `json_schema` and `grammar` (GBNF); on /v1/responses, `text.format`
(`text_format_grammar`: the same formats, the schema's fields directly in `format`). JSON schemas
are checked with `jsonschema` (a schema that is not a valid schema is a 400) and compiled by
llguidance, which refuses keywords it cannot enforce (`uniqueItems`, `not`, `if`, `contains`,
`propertyNames`, ...) instead of dropping them: such a schema is a 400, except a tool's that is
not strict (`compile_schema(..., strict=False)`, `enforceable_schema`), whose grammar holds
what it can of the schema (those keywords dropped) while the calls the model writes are checked
against the whole schema afterwards (`validate_arguments`). The grammar is then validated
against the model's vocabulary here, so a request that reaches the engine always has a grammar
the engine accepts (engine/grammar.py).
"""
from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from typing import Any

import jsonschema

from engine.grammar import GrammarError, check, from_gbnf, from_json_schema, tokenizer_for
from server.http.errors import APIError
from server.openai.bodies import SamplingFields
from server.openai.fields import check_keys

_CODES = {"grammar": "invalid_grammar", "response_format": "invalid_value",
          "text.format": "invalid_value", "text.format.name": "invalid_value"}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, _CODES.get(param, "invalid_schema"), param)


def grammar_for(body: SamplingFields, model) -> str | None:
    """The grammar that constrains this request's output, or None when nothing does."""
    sources = [name for name in ("response_format", "json_schema", "grammar")
               if _given(name, getattr(body, name, None))]
    if len(sources) > 1:
        raise bad(sources[1], f"give one of {', '.join(sources)}, not several")
    if not sources:
        return None
    name = sources[0]
    try:
        if name == "grammar":
            grammar = from_gbnf(body.grammar)
        elif name == "json_schema":
            grammar = compile_schema(body.json_schema, "json_schema")
        else:
            grammar = _response_format(body.response_format)
    except GrammarError as exc:
        raise bad(name, str(exc)) from exc
    return _checked(model, grammar, name)


def schema_grammar(schema: Any, model, param: str) -> str:
    """The grammar of a JSON schema, checked against the model's vocabulary (400s naming
    `param`): Ollama's `format`."""
    return _checked(model, compile_schema(schema, param), param)


def text_format_grammar(fmt: Any, model) -> str | None:
    """The grammar for /v1/responses' `text.format`, or None for plain text. The Responses shape:
    `{"type": "json_schema", "name", "schema", "strict", "description"}`, no nested object."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None:
        return None
    check_keys(fmt, _FORMAT_KEYS if kind == "json_schema" else frozenset({"type"}), "text.format")
    if kind == "text":
        return None
    _check_strict(fmt.get("strict"), "text.format.strict")
    if kind == "json_object":
        return _checked(model, compile_schema({"type": "object"}, "text.format"), "text.format")
    if kind != "json_schema":
        raise bad("text.format", "text.format.type must be 'text', 'json_object' or "
                                 f"'json_schema', not {kind!r}")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad("text.format.name", "text.format of type 'json_schema' needs a 'name'")
    if "schema" not in fmt:
        raise bad("text.format.schema", "text.format of type 'json_schema' needs a 'schema'")
    return _checked(model, compile_schema(fmt["schema"], "text.format.schema"), "text.format")


def _checked(model, grammar: str, param: str) -> str:
    """The grammar, once validated against the model's vocabulary (a 400 naming `param`)."""
    try:
        check(grammar, tokenizer_for(model))
    except GrammarError as exc:
        raise bad(param, str(exc)) from exc
    return grammar


def compile_schema(schema: Any, param: str, strict: bool = True) -> str:
    """The grammar of this JSON schema, or a 400 naming `param` and what is wrong. Not
    `strict`: the keywords llguidance cannot enforce are dropped (recursively) and the grammar
    holds the rest."""
    return _compiled(schema, param, strict)[1]


def enforceable_schema(schema: Any, param: str, strict: bool = True) -> dict:
    """What of this schema a grammar can hold: the schema itself, or (not `strict`) a copy
    without the keywords llguidance cannot enforce. 400s as compile_schema."""
    return _compiled(schema, param, strict)[0]


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
# where a schema holds subschemas: maps of them, lists of them, and single ones
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                             "dependentSchemas"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SUBSCHEMAS = frozenset({"items", "additionalProperties", "additionalItems", "not", "if",
                         "then", "else", "contains", "propertyNames", "unevaluatedProperties",
                         "unevaluatedItems"})


# Compiled schemas by (canonical JSON, strict): an agent sends the same tools on every request
# (Codex's 12 cost ~0.1 s to check and compile each time). Only successes are kept (an error
# names the request's own parameter); a kept result is copied out, never shared.
_MEMO: OrderedDict[tuple[str, bool], tuple[dict | None, str]] = OrderedDict()
_MEMO_SIZE = 512
_MEMO_LOCK = threading.Lock()   # requests are checked on the loop and on prompt threads


def _compiled(schema: Any, param: str, strict: bool) -> tuple[dict, str]:
    if not isinstance(schema, dict):
        raise bad(param, f"{param} must be a JSON object (a JSON schema)")
    try:
        key = (json.dumps(schema, sort_keys=True), strict)
    except (TypeError, ValueError):   # not JSON text (a body is): checked the long way
        return _compile(schema, param, strict)
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None:
            _MEMO.move_to_end(key)
    if hit is not None:
        lenient, grammar = hit
        return (schema if lenient is None else copy.deepcopy(lenient)), grammar
    current, grammar = _compile(schema, param, strict)
    with _MEMO_LOCK:
        _MEMO[key] = (None if current is schema else copy.deepcopy(current), grammar)
        if len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return current, grammar


def _compile(schema: dict, param: str, strict: bool) -> tuple[dict, str]:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad(param, f"invalid JSON schema{' at ' + where if where else ''}: "
                         f"{exc.message}") from exc
    current = schema
    while True:
        try:
            grammar = from_json_schema(current)
            check(grammar)
            return current, grammar
        except GrammarError as exc:
            keys, formats = _unenforceable(str(exc))
            lenient = None if strict or not (keys or formats) else _drop(current, keys, formats)
            if lenient is None or lenient == current:
                raise bad(param, f"the JSON schema cannot be enforced: {exc}") from exc
            current = lenient


def _unenforceable(message: str) -> tuple[set[str], set[str]]:
    """The keywords (and `format` values) llguidance's error names as ones it cannot enforce."""
    keys: set[str] = set()
    for found in _UNIMPLEMENTED.findall(message):
        try:
            keys |= {k for k in json.loads(found) if isinstance(k, str)}
        except ValueError:
            pass
    return keys, set(_UNKNOWN_FORMAT.findall(message))


def _drop(schema: Any, keys: set[str], formats: set[str]) -> Any:
    """The schema without these keywords (nor `format`s of these values), wherever a subschema
    can hold them; property names and other data stay."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in keys or (key == "format" and value in formats):
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: _drop(s, keys, formats) for name, s in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_drop(s, keys, formats) for s in value]
        elif key in _SUBSCHEMAS:
            value = _drop(value, keys, formats)
        out[key] = value
    return out


def _response_format(fmt: dict) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object", "json_schema"):
        check_keys(fmt, frozenset({"type", "json_schema"} if kind == "json_schema" else {"type"}),
                   "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return compile_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad("response_format.json_schema",
                      "response_format.json_schema needs a 'name' (and a 'schema')")
        check_keys(spec, _FORMAT_KEYS - {"type"}, "response_format.json_schema")
        _check_strict(spec.get("strict"), "response_format.json_schema.strict")
        return compile_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    raise bad("response_format", "response_format.type must be 'text', 'json_object' or "
                                 f"'json_schema', not {kind!r}")


# a JSON schema format's fields (chat: inside `json_schema`; Responses: `text.format` itself)
_FORMAT_KEYS = frozenset({"type", "name", "description", "schema", "strict"})


def _check_strict(strict: Any, param: str) -> None:
    """`strict` is a boolean (or absent); any schema given is enforced either way."""
    if strict is not None and not isinstance(strict, bool):
        raise bad(param, f"{param} must be true or false")


def _given(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is not None and value != {"type": "text"}
    return value is not None
