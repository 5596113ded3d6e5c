"""Token-by-token constraints with llguidance: a token mask over the logits.

A constraint is an llguidance grammar (a string): from a JSON schema, a GBNF grammar (llama.cpp's
format, translated to Lark by llguidance) or a Lark grammar. Each step a request's matcher
computes the set of tokens that keep the output in the language (a bitmask over the vocabulary:
a fraction of llama.cpp's own grammar sampler's cost, docs/measurement-log.md, "Cost of
constrained decoding"); disallowed tokens get -inf on a copy of the sequence's logits,
so whichever sampler runs next (the greedy argmax or a llama.cpp chain) only sees allowed tokens,
and the chosen token is then fed back to the matcher. When no token is allowed (a grammar dead
end) `mask` says so and the worker ends the request with "stop". When the grammar is complete
only an end-of-generation token is allowed.

JSON output is held to one layout: `{"a": 1, "b": [2, 3]}` (json.dumps's separators, no other
whitespace), so a small model cannot wander off into whitespace; a schema may override it with
llguidance's "x-guidance" key. An object schema that lists `properties` admits no other keys
unless it says so (`closed`). Keywords llguidance cannot enforce make the grammar an error
(checked by `check`), never a silently looser constraint.
"""
from __future__ import annotations

import ctypes
import json
import threading
import weakref
from typing import TYPE_CHECKING

import llama_cpp as C
import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.llamacpp import lltokenizer_from_vocab

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}


class GrammarError(ValueError):
    pass


def closed(schema):
    """The schema with `additionalProperties: false` wherever an object lists its `properties`
    and says nothing about others (what llama.cpp's converter and OpenAI's strict mode do: a
    small model otherwise invents extra keys until max_tokens, measured with instructor's
    schemas). `{"type": "object"}` alone stays any object."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            out[key] = ({k: closed(v) for k, v in value.items()} if isinstance(value, dict)
                        else value)
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
            out[key] = closed(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def from_json_schema(schema: dict) -> str:
    """The grammar of JSON documents valid under this schema (validity checked by `check`)."""
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)),
                                                      defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from exc


def json_value_lark(schema: dict) -> str:
    """A Lark expression for one JSON value under this schema, with the same layout, to embed in
    a larger Lark grammar (tool calls)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_LAYOUT,
                                                           **schema.get("x-guidance", {})}})


def from_gbnf(gbnf: str) -> str:
    try:
        return llg.LLMatcher.grammar_from_lark(any_to_lark(gbnf))
    except Exception as exc:   # the translator raises plain Exceptions on syntax errors
        raise GrammarError(f"the GBNF grammar does not parse: {exc}") from exc


def from_lark(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def after_thinking(grammar: str, opened: bool) -> str:
    """A grammar that leaves a thinking model's reasoning free and holds what follows it to
    `grammar`: free text up to the first `</think>` (the prompt `opened` the block), or an
    optional `<think>…</think>` block the model opens itself, then optional whitespace, then
    `grammar`'s language."""
    stripped = grammar.lstrip()
    inner = (json.loads(grammar)["grammars"] if stripped.startswith("{")
             else [{"lark_grammar": grammar}])   # from_lark and from_gbnf give Lark text
    first = dict(inner[0])
    name = first.setdefault("name", "after_thinking_inner")
    think = '"<think>" think WS' if not opened else "think WS"
    if not opened:
        think = f"({think})?"
    lark = (f"start: {think} @{name}\n"
            'think[stop="</think>"]: /(?s:.*)/\n'
            "WS: /[ \\t\\r\\n]*/\n")
    grammar = json.dumps({"grammars": [{"lark_grammar": lark}, first, *inner[1:]]})
    check(grammar)
    return grammar


def check(grammar: str, tokenizer=None) -> None:
    """Raise GrammarError naming the problem if llguidance cannot enforce this grammar."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")


_tokenizers: weakref.WeakKeyDictionary[object, llg.LLTokenizer] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def tokenizer_for(model) -> llg.LLTokenizer:
    """llguidance's view of a model's vocabulary, built once per model (~0.5 s for SmolLM2),
    on the first constrained request, and dropped with the model. End of generation: every EOG
    token of the model."""
    with _lock:
        tok = _tokenizers.get(model)
        if tok is None:
            tok = _tokenizers[model] = lltokenizer_from_vocab(
                model.vocab, n_vocab=model.n_vocab, eos_token=sorted(model.eog_ids))
        return tok


class Grammar:
    """One request's matcher. Not thread-safe: the worker thread alone uses it."""

    def __init__(self, tokenizer, grammar: str, n_vocab: int):
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.n_vocab = n_vocab
        self.bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self.pointer = self.data.ctypes.data_as(ctypes.POINTER(C.llama_token_data))
        self.array = C.llama_token_data_array(data=self.pointer, size=n_vocab, selected=-1,
                                              sorted=False)

    def candidates(self, logits: np.ndarray) -> C.llama_token_data_array:
        """All tokens with these logits, unmasked (for a sampler chain to choose from)."""
        d = self.data
        d["id"], d["logit"], d["p"] = self.ids, logits, 0.0
        a = self.array   # a sampler chain may have sorted or cut it last time: start afresh
        # (llama_cpp's ctypes declares `data` an array; a pointer to our buffer is what C reads)
        a.data = self.pointer   # type: ignore[assignment]
        a.size, a.selected, a.sorted = self.n_vocab, -1, False
        return a

    def allowed(self) -> np.ndarray | None:
        """Boolean per token: may it come next? None when nothing may (a dead end or an error)."""
        b = self.bits
        self.matcher.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
        ok = np.unpackbits(b.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
        return None if self.matcher.is_error() or not ok.any() else ok

    def mask(self, logits: np.ndarray, ok: np.ndarray | None = None
             ) -> C.llama_token_data_array | None:
        """The candidates with disallowed tokens at -inf, or None when nothing is allowed.
        `ok`: the allowed tokens when the caller has computed them (`allowed`)."""
        ok = self.allowed() if ok is None else ok
        if ok is None:
            return None
        a = self.candidates(logits)
        self.data["logit"][~ok] = -np.inf
        return a

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts this token next, without computing the whole mask."""
        return self.matcher.validate_tokens([token]) == 1

    def allows_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, in order, the grammar accepts next (none consumed)."""
        return self.matcher.validate_tokens(tokens)

    def best(self) -> int:
        """Greedy over the last mask."""
        d = self.data
        return int(d["id"][int(d["logit"].argmax())])

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def close(self) -> None:
        del self.matcher   # llguidance frees it; the grammar is not used after this
