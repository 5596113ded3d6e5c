"""Per-sequence sampling: greedy without penalties is numpy's argmax; temperature sampling
without penalties is `draw` (numpy: top-k, top-p, min-p, temperature, one categorical draw);
repetition/presence/frequency penalties need the token history and go through a llama.cpp
sampler chain. A grammar, when given, masks the logits before any of them (engine/grammar.py).

Why numpy and not llama.cpp's chain for plain sampling: the chain builds and scans a candidate
array over the whole vocabulary per token in scalar code, several times what `draw` costs, and
the worker samples every running sequence between two decodes (docs/measurement-log.md has the
figures). `draw` keeps the chain's order and meaning: top-k, then top-p and min-p on the
probabilities at temperature 1, then temperature over what is left.

A draw right after `llama_decode` runs on cold caches (the decode has streamed the weights
through them), so what counts is how many passes over the whole vocabulary a draw makes and how
many numpy calls: each cut-off passes over the vocabulary once or twice and then works on the
tokens near the top (`_kept`), and where a few dozen tokens are left (top-k 40, a narrow
nucleus) the rest is plain Python (`_cut_small`, `_pick`)."""
from __future__ import annotations

import ctypes
import math
import random
from dataclasses import dataclass, field

import llama_cpp as C
import numpy as np

from engine.grammar import Grammar
from engine.llama import Context

# Below this temperature a draw takes the limit T -> 0: the top logits, alike. Exact for any two
# logits more than 1e-27 apart (exp(-1000) is 0 in float64); float32 itself would turn the top
# logit's 0 / T into a NaN once T rounds to 0 there.
_TINY_TEMPERATURE = 1e-30


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


def draw(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from these logits: top-k, then top-p and min-p on the probabilities at
    temperature 1, then a draw at the request's temperature among the tokens left (llama.cpp's
    chain order). Tokens at -inf (masked by a grammar) are never drawn."""
    top = float(logits.max())
    if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0:   # OpenAI's default: no cut-off
        token = _draw_untruncated(logits, top, p.temperature, rng)
        if token is not None:
            return token
        ids, depth = None, top - logits
    elif not math.isfinite(top):   # NaN (a broken model), all -inf, or an infinite top:
        return int(np.argmax(logits))   # nothing to weigh; argmax's choice
    else:
        ids = _top_k(logits, top, p.top_k) if 0 < p.top_k < logits.size else None
        if ids is not None and ids.size <= _SMALL:   # top-k 40 and the like: plain Python
            kept, xs = _cut_small(ids, logits[ids], top, p)
            return _pick(kept, [top - v for v in xs], p.temperature, rng.random())
        ids, depth = _kept(logits, top, p, ids)
        if ids.size <= _SMALL:
            return _pick(ids.tolist(), depth.tolist(), p.temperature, rng.random())
    if p.temperature >= _TINY_TEMPERATURE:
        w = np.exp(depth / -p.temperature)
    else:   # float32 would make the top's 0 / -T a NaN: the limit, the top tokens alike
        w = (depth == 0).astype(np.float32)
    j = _categorical(w, rng.random())
    return int(j if ids is None else ids[j])


# At most this many tokens left after a cut-off are handled as Python lists: after a decode
# every numpy call starts cold (module doc), and on a few dozen numbers the calls cost more
# than the arithmetic.
_SMALL = 64


def _cut_small(ids: np.ndarray, x: np.ndarray, top: float, p: SamplingParams
               ) -> tuple[list[int], list[float]]:
    """top-p and min-p over a few tokens (ids, their logits x, top the largest logit), as
    `_kept` computes them (float32 weights, their total in float64, the kept tokens in order
    of weight); returns the kept ids and logits."""
    idl, xs = ids.tolist(), x.tolist()
    if p.top_p >= 1.0 and p.min_p <= 0.0:
        return idl, xs
    w32 = np.exp(x - top)
    w = w32.tolist()
    sel: list[int] | range = range(len(w))
    if p.top_p < 1.0:
        need = p.top_p * float(w32.sum(dtype=np.float64))
        order = sorted(sel, key=w.__getitem__, reverse=True)   # stable, as argsort's
        acc, n = 0.0, len(order)
        for i, j in enumerate(order):
            acc += w[j]
            if acc >= need:
                n = i + 1
                break
        sel = order[:n]
    if p.min_p > 0.0:
        floor = float(np.float32(p.min_p))   # numpy compares the float32 weights so
        sel = [j for j in sel if w[j] >= floor]
    return [idl[j] for j in sel], [xs[j] for j in sel]


def _pick(ids: list[int], depths: list[float], temperature: float, u: float) -> int:
    """The token where u (uniform in [0, 1)) falls on the cumulative weights e^(-depth / T) of
    these tokens (at a tiny temperature the top ones alike), as `_categorical` does."""
    if temperature >= _TINY_TEMPERATURE:
        w = [math.exp(-d / temperature) for d in depths]
    else:
        w = [1.0 if d == 0 else 0.0 for d in depths]
    target, acc = u * math.fsum(w), 0.0
    for token, wi in zip(ids, w):
        acc += wi
        if acc > target:
            return token
    return next(t for t, wi in zip(reversed(ids), reversed(w)) if wi > 0)   # rounding at the top


def _kept(x: np.ndarray, top: float, p: SamplingParams, ids: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens top-p and min-p keep among the top-k `ids` (None: no top-k, all of x), as
    ids into x, and their depths (top - logit, the -log of each weight at temperature 1).
    Each cut-off passes over the whole vocabulary only a few times, in numpy, and then works
    on the tokens near the top that can be kept at all; the kept set is the one sorting the
    whole vocabulary would keep (unit tests)."""
    if ids is not None:
        x = x[ids]
    keep = None                          # None: all of x
    if p.top_p < 1.0:
        w = np.exp(x - top)              # weights at temperature 1; the largest is 1
        keep = _nucleus(w, x, top, p.top_p * float(w.sum(dtype=np.float64)))
        if p.min_p > 0.0:                # relative to the most likely token, which always stays
            keep = keep[w[keep] >= p.min_p]
    elif p.min_p > 0.0:   # only tokens within -log(min_p) of the top can stay (1 to spare)
        near = np.flatnonzero(x >= x.dtype.type(top + math.log(p.min_p) - 1.0))
        keep = near[np.exp(x[near] - top) >= p.min_p]
    if keep is None:
        return (np.arange(x.size) if ids is None else ids), top - x
    return (keep if ids is None else ids[keep]), top - x[keep]


def _top_k(x: np.ndarray, top: float, k: int) -> np.ndarray:
    """Ids of the k largest logits. When k of them lie within 10 (then 20) of the top, only
    those are partitioned: every token of the k largest is above the cut then."""
    if math.isfinite(top):
        for span in (10.0, 20.0):
            near = np.flatnonzero(x > x.dtype.type(top - span))
            if near.size >= k:
                return near[np.argpartition(x[near], -k)[-k:]]
            if near.size * 4 > x.size:
                break
    return np.argpartition(x, -k)[-k:]


def _draw_untruncated(x: np.ndarray, top: float, temperature: float, rng: np.random.Generator,
                      depth: float = 10.0) -> int | None:
    """A draw over the whole vocabulary at this temperature that computes weights only for the
    tokens within depth * temperature of the top logit (weights above e^-depth), exactly, by
    rejection: propose each of those with its own weight and each other token with a bound its
    weight stays under (e^-depth, from the cut as the logits' float type holds it), and keep a
    proposed tail token with probability weight / bound. Every token's chance is then
    proportional to its weight. On SmolLM2's logits at temperature 1 the head held a median of
    ~480 (a story) and ~1,900 (a prompt of random words) of its 49,152 tokens, and the tail's
    bound adds at most 2.2 times the head's mass there (more for larger vocabularies: a few
    more cheap rejected rounds), so a draw takes a comparison pass and small arrays instead of
    an exp over the vocabulary: 116-139 us against 240-262 us on those logits.
    None when the head is over a quarter of the vocabulary, or empty (NaN or infinite logits),
    or the temperature is tiny: the caller then draws the plain way. `top`: x's largest value."""
    n = x.size
    if temperature < _TINY_TEMPERATURE or not math.isfinite(top):
        return None
    cut = x.dtype.type(top - depth * temperature)   # compared in the logits' own type
    head = np.flatnonzero(x > cut)
    k = head.size
    if k == 0 or k * 4 > n:
        return None
    cum = np.cumsum(np.exp((x[head].astype(np.float64) - top) / temperature))
    bound = math.exp((float(cut) - top) / temperature)   # every tail token's weight is at most this
    tail_mass = (n - k) * bound
    while True:
        u = rng.random() * (cum[-1] + tail_mass)
        if u < cum[-1]:
            return int(head[min(int(np.searchsorted(cum, u, side="right")), k - 1)])
        i = int(rng.integers(n))          # a tail token, uniformly: most tokens are tail
        while x[i] > cut:
            i = int(rng.integers(n))
        if rng.random() * bound < math.exp((float(x[i]) - top) / temperature):
            return i


def _nucleus(w: np.ndarray, x: np.ndarray, top: float, need: float, buckets: int = 512,
             span: float = 40.0) -> np.ndarray:
    """Indices of the most likely tokens whose weights w (= e^(x - top)) first reach `need`
    (top-p of the total; at least one). Without sorting the vocabulary: the tokens above 1/100
    of the most likely (then 1/10^4, 1/10^6, 1/10^9) are a prefix of the sorted order; the
    first such prefix that holds `need` holds the nucleus, and only it is ordered: sorted when
    small, else by buckets of depth (one pass; the buckets' masses say in which bucket the
    total reaches `need`, every token of the buckets above it is in, and only that bucket's
    tokens are sorted; llama.cpp's top-p does the like)."""
    for floor in (1e-2, 1e-4, 1e-6, 1e-9):
        near = np.flatnonzero(w >= floor)
        if float(w[near].sum(dtype=np.float64)) >= need:
            break
    else:
        near = np.arange(w.size)
    w = w[near]
    if near.size <= 512:
        order = np.argsort(-w, kind="stable")
        return near[order[:_reach(w[order], need)]]
    depth = top - x[near]
    rank = np.minimum(depth * (buckets / span), buckets - 1).astype(np.int32)
    mass = np.cumsum(np.bincount(rank, weights=w, minlength=buckets))
    k = min(int(np.searchsorted(mass, need)), buckets - 1)
    edge = np.flatnonzero(rank == k)
    edge = edge[np.argsort(-w[edge], kind="stable")]
    got = float(mass[k - 1]) if k else 0.0
    return near[np.concatenate([np.flatnonzero(rank < k), edge[:_reach(w[edge], need - got)]])]


def _reach(w_sorted: np.ndarray, need: float) -> int:
    """How many of these weights (largest first) it takes for their sum to reach need (all of
    them at most; at least one)."""
    cum = np.cumsum(w_sorted, dtype=np.float64)
    return max(1, min(int(np.searchsorted(cum, need)) + 1, w_sorted.size))


def _categorical(w: np.ndarray, u: float, block: int = 256) -> int:
    """The index where a uniform draw u (in [0, 1)) falls on the weights' cumulative sum. In two
    levels (sums of blocks, then one block) because numpy's cumsum is scalar: a whole-vocabulary
    cumsum costs 0.5 ms, this 0.05 ms."""
    n = w.size
    full = n // block * block
    sums = w[:full].reshape(-1, block).sum(axis=1, dtype=np.float64)
    if full < n:
        sums = np.append(sums, w[full:].sum(dtype=np.float64))
    outer = np.cumsum(sums)
    target = u * outer[-1]
    b = min(int(np.searchsorted(outer, target, side="right")), outer.size - 1)
    seg = w[b * block:(b + 1) * block]
    j = int(np.searchsorted(np.cumsum(seg, dtype=np.float64),
                            target - (outer[b - 1] if b else 0.0), side="right"))
    if j >= seg.size or seg[j] == 0:   # rounding at the very top: the last token with weight
        b = int(np.flatnonzero(sums)[-1])
        seg = w[b * block:(b + 1) * block]
        j = int(np.flatnonzero(seg)[-1])
    return b * block + j


class Sampler:
    """`sample` returns a token id, or None when a grammar allows no token (a dead end)."""

    def __init__(self, params: SamplingParams, n_vocab: int, grammar_tokenizer=None):
        """`grammar_tokenizer`: engine.grammar.tokenizer_for(model), needed with a grammar."""
        self.params = params
        self.greedy = params.temperature == 0 and not params.has_penalties
        self.chain = None
        self.rng: np.random.Generator | None = None
        self.grammar = (Grammar(grammar_tokenizer, params.grammar, n_vocab) if params.grammar
                        else None)
        self.bias_ids = np.array(list(params.logit_bias), dtype=np.int64)
        self.bias = np.array(list(params.logit_bias.values()), dtype=np.float32)
        if self.greedy:
            return
        if not params.has_penalties:   # numpy's draw (see the module's docstring)
            self.rng = np.random.default_rng(params.seed)
            return
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
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
        if self.rng is not None:
            return draw(context.logits(batch_index), self.params, self.rng)
        return C.llama_sampler_sample(self.chain, context.ptr, batch_index)

    def _sample_constrained(self, logits) -> int | None:
        """Choose as if unconstrained; if the grammar allows that token (checked on it alone),
        keep it. Otherwise mask the whole vocabulary and choose again among allowed tokens.
        Greedy: exactly the argmax of the masked logits. Sampled: the first draw kept when
        allowed, else a draw from the masked distribution (which is the masked distribution
        overall; only the top-k/top-p cut-offs are taken over all tokens on the first draw)."""
        g = self.grammar
        assert g is not None
        if self.greedy:
            token = int(logits.argmax())
            if not g.allows(token):
                if g.mask(logits) is None:
                    return None
                token = g.best()
        elif self.rng is not None:
            token = draw(logits, self.params, self.rng)
            if not g.allows(token):
                ok = g.allowed()
                if ok is None:
                    return None
                token = draw(np.where(ok, logits, -np.inf), self.params, self.rng)
        else:
            token = self._draw(g.candidates(logits))
            if not g.allows(token):
                ok = g.allowed()
                if ok is None:
                    return None
                token = self._draw(g.mask(logits, ok))
                if not ok[token]:   # the chain's arithmetic made the masked logits NaN: the
                    ids = np.flatnonzero(ok)   # best allowed token, rather than a refused one
                    token = int(ids[np.argmax(logits[ids])])
            C.llama_sampler_accept(self.chain, token)
        g.accept(token)
        return token

    def accept_history(self, tokens: list[int]) -> None:
        """Tokens the penalties count as already generated (a chain's history; tests)."""
        for token in tokens:
            C.llama_sampler_accept(self.chain, token)

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
