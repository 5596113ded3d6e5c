"""Grammars checked without a model: a byte-level tokenizer (token i = byte i, 256 = end)."""
from __future__ import annotations

import llguidance as llg


class _Bytes:
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))


def accepts(grammar: str, text: str) -> bool:
    """Whether this grammar accepts exactly this text."""
    m = llg.LLMatcher(BYTES, grammar, log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()
