"""Tokenizing long prompts in segments that are remembered.

An agent sends its whole conversation on every request: a 20,000-token prompt of which all but
the last turn was tokenized for the request before (llama.cpp takes 35-80 ms to tokenize 40 KB
of Gemma 3 text: its special-token scan runs over every one of the vocabulary's 6,414 special
tokens). The rendered prompt is cut where a chat template marks turns, just before a special
token such as `<start_of_turn>` or `<|im_start|>`, and the tokens of each long segment are
remembered (LRU, within a token budget), so a request tokenizes only what is new.

Exact: llama.cpp's tokenizer first cuts the text at special tokens (longest first, each
occurrence left to right) and then tokenizes each piece of raw text between them on its own, the
only state carried from one piece to the next being whether the piece before was a special
token (SPM's leading space), which a segment that starts with a special token sets the same way.
So the tokens of the whole are the tokens of the segments, one after the other, provided that
every cut is where the whole's own special-token scan would put a special token. A token is used
to cut (`split_tokens`) when that holds wherever it occurs: it looks like `<name>` (no `<` or
`>` inside), no other special token contains it or can overlap an occurrence of it (every special
token at least as long has `<` only first and `>` only last), and it takes no whitespace from
its neighbours (no lstrip/rstrip). Only the first segment gets the BOS token; a vocabulary that
appends EOS is not cut (llama.cpp's SPM and BPE tokenizers only).
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

MIN_CHARS = 2048        # a text shorter than this is tokenized whole, as it is
SEGMENT_CHARS = 512     # a segment at least this long is remembered
MEMO_TOKENS = 2_000_000  # tokens remembered at most (4 bytes each)
_NAME = re.compile(r"<[^<>]{1,64}>")


def split_tokens(specials: Iterable[tuple[str, bool, bool]]) -> frozenset[str]:
    """Of the vocabulary's special tokens, as (text, is control, strips whitespace), those a
    segment may start with (module doc)."""
    specials = list(specials)
    texts = Counter(t for t, _, _ in specials)
    # the longest special token that could overlap an occurrence of a `<name>` token; a token
    # that contains a `<name>` is one of them (its `<` is not first or its `>` not last), so
    # only tokens shorter than it, and not contained in it, remain
    risky = max((len(t) for t in texts if "<" in t[1:] or ">" in t[:-1]), default=0)
    return frozenset(
        text for text, control, strips in specials
        if control and not strips and len(text) > risky and _NAME.fullmatch(text)
        and texts[text] == 1)


class SegmentTokenizer:
    """tokenize(text, add_special) through remembered segments; `raw(text, add_special)` is
    llama.cpp's tokenizer (parse_special on)."""

    def __init__(self, raw: Callable[[str, bool], list[int]], splits: frozenset[str],
                 memo_tokens: int = MEMO_TOKENS):
        self.raw, self.splits = raw, splits
        self.memo: OrderedDict[tuple[bool, str], array] = OrderedDict()
        self.memo_tokens, self.held = memo_tokens, 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def cuts(self, text: str) -> list[int]:
        """Where segments start (after the first): every occurrence of a split token."""
        return [m.start() for m in _NAME.finditer(text) if m.group() in self.splits and m.start()]

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        if len(text) < MIN_CHARS or not self.splits:
            return self.raw(text, add_special)
        bounds = [0, *self.cuts(text), len(text)]
        out: list[int] = []
        run_start = None   # a run of short segments, tokenized together
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            # a short segment is tokenized with its neighbours, in runs of about SEGMENT_CHARS
            # (llama.cpp takes more than linear time over a text full of special tokens)
            if b - a < SEGMENT_CHARS:
                run_start = a if run_start is None else run_start
                if b - run_start >= SEGMENT_CHARS:
                    out += self.raw(text[run_start:b], add_special and run_start == 0)
                    run_start = None
                continue
            if run_start is not None:
                out += self.raw(text[run_start:a], add_special and run_start == 0)
                run_start = None
            out += self._segment(text[a:b], add_special and a == 0)
        if run_start is not None:
            out += self.raw(text[run_start:], add_special and run_start == 0)
        return out

    def _segment(self, segment: str, bos: bool) -> array:
        key = (bos, segment)
        with self._lock:
            found = self.memo.get(key)
            if found is not None:
                self.memo.move_to_end(key)
                self.hits += 1
                return found
        tokens = array("i", self.raw(segment, bos))
        with self._lock:
            self.misses += 1
            if key not in self.memo and len(tokens) <= self.memo_tokens:
                self.memo[key] = tokens
                self.held += len(tokens)
                while self.held > self.memo_tokens:
                    _, old = self.memo.popitem(last=False)
                    self.held -= len(old)
        return tokens
