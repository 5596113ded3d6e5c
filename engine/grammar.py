"""Token-by-token constraints: llama.cpp's grammar sampler (GBNF) as a mask over the logits.

Each step the grammar sets the logit of every token it cannot accept to -inf, in place, on a
copy of the sequence's logits; whichever sampler runs next (the greedy argmax or a llama.cpp
chain) only sees allowed tokens, and the chosen token is then fed back to the grammar. When no
token is allowed (a grammar dead end) `mask` says so and the worker ends the request with
"stop" instead of letting llama.cpp abort on a token its grammar cannot accept.
JSON schemas become GBNF through llama-cpp-python's port of llama.cpp's converter.
"""
from __future__ import annotations

import ctypes
import json

import llama_cpp as C
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class GrammarError(ValueError):
    pass


def schema_to_gbnf(schema: dict) -> str:
    """GBNF for a JSON schema; raises GrammarError naming what the converter refused."""
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError,
            RecursionError) as exc:
        raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {exc}") from exc


class Grammar:
    """One request's grammar state. Not thread-safe: the worker thread alone uses it."""

    def __init__(self, vocab, gbnf: str, n_vocab: int):
        self.ptr = C.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not self.ptr:
            raise GrammarError("the grammar does not parse (GBNF syntax error or no 'root' rule)")
        self.n_vocab = n_vocab
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self.pointer = self.data.ctypes.data_as(ctypes.POINTER(C.llama_token_data))
        self.array = C.llama_token_data_array(data=self.pointer, size=n_vocab, selected=-1,
                                              sorted=False)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._one_array = C.llama_token_data_array(
            data=self._one.ctypes.data_as(ctypes.POINTER(C.llama_token_data)), size=1,
            selected=-1, sorted=False)

    def candidates(self, logits: np.ndarray) -> C.llama_token_data_array:
        """All tokens with these logits, unmasked (for a sampler chain to choose from)."""
        d = self.data
        d["id"], d["logit"], d["p"] = self.ids, logits, 0.0
        a = self.array   # a sampler chain may have sorted or cut it last time: start afresh
        a.data, a.size, a.selected, a.sorted = self.pointer, self.n_vocab, -1, False
        return a

    def mask(self, logits: np.ndarray) -> C.llama_token_data_array | None:
        """The candidates with disallowed tokens at -inf, or None when nothing is allowed."""
        a = self.candidates(logits)
        C.llama_sampler_apply(self.ptr, ctypes.byref(a))
        if not np.isfinite(self.data["logit"]).any():
            return None
        return a

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts this token next: one candidate instead of the whole
        vocabulary (llama.cpp's common sampler checks the unconstrained choice the same way)."""
        one = self._one
        one[0] = (token, 0.0, 0.0)
        self._one_array.size, self._one_array.selected, self._one_array.sorted = 1, -1, False
        C.llama_sampler_apply(self.ptr, ctypes.byref(self._one_array))
        return bool(np.isfinite(one["logit"][0]))

    def best(self) -> int:
        """Greedy over the last mask."""
        d = self.data
        return int(d["id"][int(d["logit"].argmax())])

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)

    def close(self) -> None:
        if self.ptr:
            C.llama_sampler_free(self.ptr)
            self.ptr = None


def check_gbnf(vocab, gbnf: str) -> None:
    """Raise GrammarError if llama.cpp cannot parse this grammar."""
    ptr = C.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    if not ptr:
        raise GrammarError("the grammar does not parse (GBNF syntax error or no 'root' rule)")
    C.llama_sampler_free(ptr)
