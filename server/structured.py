"""Structured output: the request's constraint as one GBNF grammar, or a 400 naming what is wrong.

Sources (at most one per request): OpenAI's `response_format` (`json_object`, `json_schema`),
llama-server's top-level `json_schema` and `grammar` (GBNF); on /v1/responses, `text.format`
(`text_format_grammar`: the same formats, the schema's fields directly in `format`). JSON schemas are checked with
`jsonschema` (a schema that is not a valid schema is a 400) and compiled to GBNF with llama.cpp's
converter; the grammar is then parsed by llama.cpp once here, so a request that reaches the
engine always has a grammar the engine accepts.
"""
from __future__ import annotations

from typing import Any

import jsonschema

from engine.grammar import GrammarError, check_gbnf, schema_to_gbnf
from server.errors import APIError
from server.schemas import SamplingFields


_CODES = {"grammar": "invalid_grammar", "response_format": "invalid_value",
          "text.format": "invalid_value", "text.format.name": "invalid_value"}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, _CODES.get(param, "invalid_schema"), param)


def grammar_for(body: SamplingFields, vocab) -> str | None:
    """The GBNF that constrains this request's output, or None when nothing does."""
    sources = [name for name in ("response_format", "json_schema", "grammar")
               if _given(name, getattr(body, name, None))]
    if len(sources) > 1:
        raise bad(sources[1], f"give one of {', '.join(sources)}, not several")
    if not sources:
        return None
    name = sources[0]
    if name == "grammar":
        gbnf = body.grammar
    elif name == "json_schema":
        gbnf = compile_schema(body.json_schema, "json_schema")
    else:
        gbnf = _response_format(body.response_format)
    return _checked(vocab, gbnf, name)


def text_format_grammar(fmt: Any, vocab) -> str | None:
    """The GBNF for /v1/responses' `text.format`, or None for plain text. The Responses shape:
    `{"type": "json_schema", "name", "schema", "strict", "description"}`, no nested object."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return _checked(vocab, schema_to_gbnf({"type": "object"}), "text.format")
    if kind != "json_schema":
        raise bad("text.format", "text.format.type must be 'text', 'json_object' or "
                                 f"'json_schema', not {kind!r}")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad("text.format.name", "text.format of type 'json_schema' needs a 'name'")
    if "schema" not in fmt:
        raise bad("text.format.schema", "text.format of type 'json_schema' needs a 'schema'")
    return _checked(vocab, compile_schema(fmt["schema"], "text.format.schema"), "text.format")


def _checked(vocab, gbnf: str, param: str) -> str:
    """The grammar, once llama.cpp has parsed it (a 400 naming `param` if it cannot)."""
    try:
        check_gbnf(vocab, gbnf)
    except GrammarError as exc:
        raise bad(param, str(exc)) from exc
    return gbnf


def compile_schema(schema: Any, param: str) -> str:
    if not isinstance(schema, dict):
        raise bad(param, f"{param} must be a JSON object (a JSON schema)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad(param, f"invalid JSON schema{' at ' + where if where else ''}: "
                         f"{exc.message}") from exc
    where = unenforced(schema)
    if where:
        raise bad(param, f"'{where[0]}' at {where[1]} is not enforced by the grammar engine "
                         "(llama.cpp's JSON-schema converter drops it), so the output could "
                         "break it; remove it or express it with enum/pattern/maxLength")
    try:
        return schema_to_gbnf(schema)
    except GrammarError as exc:
        raise bad(param, str(exc)) from exc


# Keywords llama.cpp's converter (as shipped in llama-cpp-python) ignores: a schema using one is
# refused, since the grammar would not hold the output to it (measured: "minimum"/"maximum"
# were broken by 4 of 200 sampled answers). "format" is an annotation in JSON Schema: allowed.
UNENFORCED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                        "multipleOf", "uniqueItems", "minProperties", "maxProperties",
                        "patternProperties", "propertyNames", "not", "if", "then", "else",
                        "contains", "minContains", "maxContains", "dependentRequired",
                        "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced(schema: Any, path: str = "#") -> tuple[str, str] | None:
    """The first (keyword, JSON pointer) the converter would silently drop, or None."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNENFORCED:
            return key, path
    children = [(f"{path}/{m}/{k}", v) for m in _SUBSCHEMA_MAPS
                for k, v in (schema.get(m) or {}).items()]
    children += [(f"{path}/{m}/{i}", v) for m in _SUBSCHEMA_LISTS
                 for i, v in enumerate(schema.get(m) or [])]
    for key in ("items", "additionalProperties"):
        child = schema.get(key)
        if isinstance(child, list):
            children += [(f"{path}/{key}/{i}", v) for i, v in enumerate(child)]
        elif isinstance(child, dict):
            children.append((f"{path}/{key}", child))
    for where, child in children:
        found = unenforced(child, where)
        if found:
            return found
    return None


def _response_format(fmt: dict) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return schema_to_gbnf({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad("response_format.json_schema",
                      "response_format.json_schema needs a 'name' and a 'schema'")
        return compile_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    raise bad("response_format", "response_format.type must be 'text', 'json_object' or "
                                 f"'json_schema', not {kind!r}")


def _given(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is not None and value != {"type": "text"}
    return value is not None
