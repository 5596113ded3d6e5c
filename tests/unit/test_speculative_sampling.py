"""Verification of drafts (engine/drafting.py, `verify`): greedy accepts the longest prefix the
model agrees with and its next token; sampled, the tokens that come out follow the model's
distribution whatever was drafted (many seeds over fixed logits), and a seed draws the same
tokens with drafts as without."""
import math

import numpy as np
import pytest

from engine.drafting import verify
from engine.sampling import SamplingParams, draw

V = 6   # a toy vocabulary


def toy_model(seed: int = 3) -> np.ndarray:
    """logits[prev]: the next token's logits after token `prev` (a Markov chain)."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(V, V)) * 1.5).astype(np.float32)


def probabilities(logits: np.ndarray, temperature: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    w = np.exp(x - x.max())
    return w / w.sum()


def run(logits, last: int, draft: list[int], sample_row, max_tokens: int = 10):
    """Verify `draft` after `last`; the tokens emitted and the drafted tokens accepted."""
    out: list[int] = []

    def sample(i: int) -> int:
        prev = last if i == 0 else draft[i - 1]
        return sample_row(logits[prev])

    def emit(token: int) -> bool:
        out.append(token)
        return len(out) >= max_tokens

    return out, verify(draft, sample, emit)


def test_greedy_accepts_the_longest_agreeing_prefix_and_the_models_next_token():
    logits = toy_model()
    greedy = [int(np.argmax(logits[t])) for t in range(V)]
    chain = [0]
    for _ in range(5):
        chain.append(greedy[chain[-1]])
    wrong = (chain[3] + 1) % V
    out, accepted = run(logits, 0, chain[1:3] + [wrong, 1], lambda row: int(np.argmax(row)))
    assert accepted == 2 and out == chain[1:4]      # two agreed, then the model's own token
    out, accepted = run(logits, 0, chain[1:5], lambda row: int(np.argmax(row)))
    assert accepted == 4 and out == chain[1:6]      # all agreed, and one more
    out, accepted = run(logits, 0, [], lambda row: int(np.argmax(row)))
    assert accepted == 0 and out == chain[1:2]      # no draft: one token, as without


def test_a_sequence_that_ends_stops_the_verification():
    logits = toy_model()
    greedy = [int(np.argmax(logits[t])) for t in range(V)]
    draft = [greedy[0], greedy[greedy[0]]]
    out, accepted = run(logits, 0, draft, lambda row: int(np.argmax(row)), max_tokens=1)
    assert out == draft[:1] and accepted == 0       # max_tokens reached on the first token


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile for p = 0.9995 (z = 3.29), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(counts: np.ndarray, p: np.ndarray) -> None:
    n = counts.sum()
    expected = n * p
    keep = expected > 5
    if keep.sum() < 2:   # (nearly) one token possible: all of them there
        assert counts[keep].sum() >= n - 10
        return
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert stat < chi_square_critical(int(keep.sum()) - 1), (counts, expected.round(1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.9)],
                         ids=["plain", "top-k", "top-p"])
def test_sampled_tokens_follow_the_models_distribution_whatever_is_drafted(params):
    """A drafted token x is accepted with probability p(x); after a rejection the token is
    distributed as p without x, renormalized; after an acceptance the next token follows the
    model's distribution after x. Over 20,000 seeds, for a likely and an unlikely draft."""
    logits = toy_model()
    if params.top_k or params.top_p < 1.0:   # the distribution draw() samples from
        def dist(row):
            counts = np.zeros(V)
            rng = np.random.default_rng(12345)
            for _ in range(40_000):
                counts[draw(row, params, rng)] += 1
            return counts / counts.sum()
    else:
        def dist(row):
            return probabilities(row, params.temperature)
    p0 = dist(logits[0])
    for x in (int(np.argmax(p0)), int(np.argmin(p0))):
        y = int(np.argmax(logits[x]))
        first, second, accepted = np.zeros(V), np.zeros(V), 0
        n = 20_000
        for seed in range(n):
            rng = np.random.default_rng(seed)
            out, acc = run(logits, 0, [x, y], lambda row: draw(row, params, rng))
            first[out[0]] += 1
            if acc >= 1:
                accepted += 1
                second[out[1]] += 1
        assert abs(accepted / n - p0[x]) < 4 * math.sqrt(p0[x] * (1 - p0[x]) / n) + 1e-3
        assert_follows(first, p0)                               # the first token: p
        if second.sum() > 200:
            assert_follows(second, dist(logits[x]))             # after x: p(. | x)
        rejected = first.copy()
        rejected[x] = 0
        if rejected.sum() > 200:
            q = p0.copy()
            q[x] = 0
            assert_follows(rejected, q / q.sum())               # p without x, renormalized


def test_a_seed_draws_the_same_tokens_with_drafts_as_without():
    """Each position is one draw with the request's own generator, in order, as decoding one
    token at a time: a seeded request gives the same answer whatever was drafted."""
    logits = toy_model()
    params = SamplingParams(temperature=1.0)
    for seed in range(200):
        rng = np.random.default_rng(seed)
        plain, last = [], 0
        for _ in range(12):
            last = draw(logits[last], params, rng)
            plain.append(last)
        rng = np.random.default_rng(seed)
        drafts = np.random.default_rng(seed + 10_000)
        spec, last = [], 0
        while len(spec) < 12:
            draft = [int(t) for t in drafts.integers(0, V, size=int(drafts.integers(0, 4)))]
            out, _ = run(logits, last, draft, lambda row: draw(row, params, rng),
                         max_tokens=12 - len(spec))
            spec += out
            last = spec[-1]
        assert spec == plain, seed
