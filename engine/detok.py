"""Incremental detokenization: whole UTF-8 characters only, and stop strings held back."""
from __future__ import annotations

import codecs
from collections.abc import Callable


class TextStream:
    def __init__(self, piece: Callable[[int], bytes], stop: list[str] | None = None):
        self.piece = piece
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in (stop or []) if s]
        self.held = ""    # text that may be the start of a stop string
        self.matched: str | None = None   # the stop string that ended the text, once one did

    def push(self, token: int) -> tuple[str, bool]:
        """Text that is safe to emit after this token, and whether a stop string was reached
        (the stop string and anything after it are never emitted)."""
        text = self.held + self.decoder.decode(self.piece(token))
        if not self.stop:
            return text, False
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            at = min(hits)
            self.held = ""
            self.matched = next(s for s in self.stop if text.find(s) == at)
            return text[:at], True
        keep = self._partial_stop_suffix(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held + self.decoder.decode(b"", final=True), ""
        return text

    def _partial_stop_suffix(self, text: str) -> int:
        for k in range(min(max(len(s) for s in self.stop) - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
