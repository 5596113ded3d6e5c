"""Per-sequence sampling with llama.cpp sampler chains (greedy without penalties: numpy argmax);
a grammar, when given, masks the logits before either (engine/grammar.py)."""
from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field

import llama_cpp as C
import numpy as np

from engine.grammar import Grammar
from engine.llama import Context


@dataclass
class SamplingParams:
    max_tokens: int | None = None     # None: up to the context limit
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: str | None = None        # llguidance grammar (engine/grammar.py): every token must
                                      # keep the output in its language
    logit_bias: dict[int, float] = field(default_factory=dict)   # added to the logits first
    logprobs: int | None = None       # None: none; k: the sampled token's and the k most likely
    prompt_logprobs: bool = False     # the prompt tokens' logprobs too (completions echo)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class Sampler:
    """`sample` returns a token id, or None when a grammar allows no token (a dead end)."""

    def __init__(self, params: SamplingParams, n_vocab: int, grammar_tokenizer=None):
        """`grammar_tokenizer`: engine.grammar.tokenizer_for(model), needed with a grammar."""
        self.greedy = params.temperature == 0 and not params.has_penalties
        self.chain = None
        self.grammar = (Grammar(grammar_tokenizer, params.grammar, n_vocab) if params.grammar
                        else None)
        self.bias_ids = np.array(list(params.logit_bias), dtype=np.int64)
        self.bias = np.array(list(params.logit_bias.values()), dtype=np.float32)
        if self.greedy:
            return
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if params.has_penalties:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_penalties(
                n_vocab, params.penalty_last_n, params.repetition_penalty,
                params.frequency_penalty, params.presence_penalty))
        if params.temperature == 0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(params.min_p, 1))
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(params.temperature))
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        self.chain = chain

    def sample(self, context: Context, batch_index: int) -> int | None:
        if self.bias.size:   # in place on llama.cpp's logits: every path below reads them
            context.logits(batch_index)[self.bias_ids] += self.bias
        if self.grammar is not None:
            return self._sample_constrained(context.logits(batch_index))
        if self.greedy:
            return int(context.logits(batch_index).argmax())
        return C.llama_sampler_sample(self.chain, context.ptr, batch_index)

    def _sample_constrained(self, logits) -> int | None:
        """Choose as if unconstrained; if the grammar allows that token (checked on it alone),
        keep it. Otherwise mask the whole vocabulary and choose again among allowed tokens.
        Greedy: exactly the argmax of the masked logits. Sampled: the first draw kept when
        allowed, else a draw from the masked distribution (which is the masked distribution
        overall; only the top-k/top-p cut-offs are taken over all tokens on the first draw)."""
        g = self.grammar
        if self.greedy:
            token = int(logits.argmax())
            if not g.allows(token):
                if g.mask(logits) is None:
                    return None
                token = g.best()
        else:
            token = self._draw(g.candidates(logits))
            if not g.allows(token):
                masked = g.mask(logits)
                if masked is None:
                    return None
                token = self._draw(masked)
            C.llama_sampler_accept(self.chain, token)
        g.accept(token)
        return token

    def _draw(self, candidates) -> int:
        """The chain's choice among these candidates (apply without accept)."""
        C.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        return int(candidates.data[candidates.selected].id)

    def close(self) -> None:
        if self.chain is not None:
            C.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None
