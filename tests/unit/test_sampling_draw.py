"""engine.sampling.draw: the numpy path for temperature sampling, checked against the
distribution its parameters define (computed here the slow, obvious way)."""
import numpy as np
import pytest

from engine.sampling import SamplingParams, draw

LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0, -np.inf, 1.0], dtype=np.float32)


def expected(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """llama.cpp's chain order: top-k, top-p and min-p on softmax at temperature 1, then
    temperature over the tokens left."""
    x = logits.astype(np.float64)
    alive = np.isfinite(x)
    order = sorted(np.flatnonzero(alive), key=lambda i: -x[i])
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = np.exp(x[order] - x[order].max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        cum, kept = 0.0, []
        for i, q in zip(order, probs):
            kept.append(i)
            cum += q
            if cum >= p.top_p:
                break
        order, probs = kept, probs[:len(kept)]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs.max()
        order = [i for i, k in zip(order, keep) if k]
    out = np.zeros(len(x))
    w = np.exp((x[order] - x[order].max()) / p.temperature)
    out[order] = w / w.sum()
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.5, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.2),
])
def test_draws_follow_the_distribution_the_parameters_define(params):
    rng = np.random.default_rng(1)
    n = 40_000
    counts = np.bincount([draw(LOGITS, params, rng) for _ in range(n)], minlength=LOGITS.size)
    want = expected(LOGITS, params)
    assert counts[want == 0].sum() == 0                       # nothing cut off is ever drawn
    # every kept token within 5 standard deviations of its expected count
    sd = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sd + 1), (counts, n * want)


def test_cut_offs_that_leave_one_token_are_the_argmax():
    rng = np.random.default_rng(0)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=0.01), SamplingParams(min_p=1.0)):
        assert {draw(LOGITS, params, rng) for _ in range(200)} == {0}


def test_same_seed_same_tokens_and_a_large_vocabulary_uses_the_candidate_cut():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, 49_152).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_p=0.9)
    a = [draw(logits, p, np.random.default_rng(42)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    # the nucleus found through the cut-off equals a full sort's
    w = np.exp(logits.astype(np.float64) - logits.max())
    order = np.argsort(-w, kind="stable")
    need = 0.9 * w.sum()
    full = set(order[:int(np.searchsorted(np.cumsum(w[order]), need)) + 1].tolist())
    drawn = {draw(logits, p, rng) for _ in range(3000)}
    assert drawn <= full
