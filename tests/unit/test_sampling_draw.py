"""engine.sampling.draw: the numpy path for temperature sampling, checked against the
distribution its parameters define (computed here the slow, obvious way)."""
import numpy as np
import pytest

from engine.sampling import SamplingParams, _draw_untruncated, draw

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


def softmax_at(logits: np.ndarray, temperature: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    w = np.exp(x - x[np.isfinite(x)].max())
    return w / w.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3, 2.0])
def test_the_untruncated_draw_follows_the_softmax_through_its_tail_too(temperature):
    """With a shallow head (depth 2) most of the mass is in the tail, so the rejection step
    decides most draws: the counts must still follow the softmax at this temperature."""
    rng = np.random.default_rng(3)
    logits = np.concatenate([[0.0, -0.5, -1.0, -1.5], rng.uniform(-9, -2.5, 396),
                             [-np.inf] * 8]).astype(np.float32)
    rng.shuffle(logits)
    want = softmax_at(logits, temperature)
    n = 20_000
    top = float(logits.max())
    drawn = [_draw_untruncated(logits, top, temperature, rng, depth=2.0) for _ in range(n)]
    assert None not in drawn
    counts = np.bincount(drawn, minlength=logits.size)
    assert counts[~np.isfinite(logits)].sum() == 0
    assert counts[logits <= -2.0 * temperature].sum() > n / 4   # the tail path was exercised
    sd = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sd + 1)


def test_draw_without_cut_offs_takes_the_head_path_on_a_vocabulary_of_peaked_logits():
    """OpenAI's defaults (temperature 1, no top-k/top-p/min-p) on a 49,152-token vocabulary
    where a few tokens stand out: the head path answers (not the full pass), the same seed
    gives the same tokens, and the most likely tokens come as often as the softmax says."""
    rng = np.random.default_rng(11)
    logits = rng.normal(-4, 2, 49_152).astype(np.float32)
    logits[[10, 20, 30]] = [12.0, 11.0, 10.0]
    assert _draw_untruncated(logits, float(logits.max()), 1.0, rng) is not None
    p = SamplingParams(temperature=1.0)
    assert [draw(logits, p, np.random.default_rng(5)) for _ in range(3)] == \
        [draw(logits, p, np.random.default_rng(5))] * 3
    n = 20_000
    counts = np.bincount([draw(logits, p, rng) for _ in range(n)], minlength=logits.size)
    want = softmax_at(logits, 1.0)
    for i in (10, 20, 30):
        sd = np.sqrt(n * want[i] * (1 - want[i]))
        assert abs(counts[i] - n * want[i]) <= 5 * sd + 1
    rest, want_rest = n - counts[[10, 20, 30]].sum(), 1 - want[[10, 20, 30]].sum()
    assert abs(rest - n * want_rest) <= 5 * np.sqrt(n * want_rest * (1 - want_rest)) + 1


def test_the_untruncated_draw_leaves_flat_or_nan_logits_to_the_full_pass():
    rng = np.random.default_rng(0)
    flat, nan = np.zeros(1000, np.float32), np.full(1000, np.nan, np.float32)
    assert _draw_untruncated(flat, float(flat.max()), 1.0, rng) is None     # all in the head
    assert _draw_untruncated(nan, float(nan.max()), 1.0, rng) is None
    assert 0 <= draw(flat, SamplingParams(temperature=1.0), rng) < 1000


def test_extreme_temperatures_and_logits_end_with_a_drawable_token():
    """A temperature so small that float32 rounds it to 0 (the top logit 0.0: its weight would
    be 0 / 0), one finite logit among -inf, a vocabulary of one: every draw ends and returns a
    token that may be drawn."""
    rng = np.random.default_rng(0)
    x = np.full(100, -5.0, np.float32)
    x[3] = 0.0
    for t in (1e-46, 5e-46, 1e-40, 1e-6):
        assert draw(x, SamplingParams(temperature=t), rng) == 3
    one = np.full(1000, -np.inf, np.float32)
    one[77] = 1.5
    for t in (0.01, 1.0, 2.0):
        assert {draw(one, SamplingParams(temperature=t), rng) for _ in range(50)} == {77}
    assert draw(np.array([0.3], np.float32), SamplingParams(temperature=1.0), rng) == 0


def test_a_token_at_the_rounded_cut_keeps_its_weight():
    """The head/tail cut is compared in float32; a token sitting exactly on it, when float32
    rounds the cut up, is tail with a weight above e^-depth: the bound comes from the rounded
    cut, so it is still drawn as often as the softmax says."""
    top, v = np.float32(1000.0), np.float32(999.999)
    t = (1000.0 - (float(v) - 0.49 * float(np.spacing(v)))) / 10   # float32(cut) == v
    x = np.full(40_000, v, np.float32)
    x[0] = top
    want = softmax_at(x, t)[0]
    rng = np.random.default_rng(4)
    n = 20_000
    hits = sum(_draw_untruncated(x, float(x.max()), t, rng) == 0 for _ in range(n))
    assert abs(hits - n * want) <= 5 * np.sqrt(n * want * (1 - want)) + 1


def kept_by_sorting(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The kept tokens' logits, sorted: the whole vocabulary sorted (float32 weights as the
    sampler computes them, sums in float64), then top-k, top-p, min-p in that order."""
    top = logits.max()
    order = np.argsort(-logits, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    w = np.exp(-(top - logits[order]))
    if p.top_p < 1.0:
        cum = np.cumsum(w, dtype=np.float64)
        n = int(np.searchsorted(cum, p.top_p * float(w.sum(dtype=np.float64)))) + 1
        order, w = order[:n], w[:n]
    if p.min_p > 0.0:
        order = order[w >= p.min_p]
    return np.sort(logits[order])


VOCABULARIES = {   # 49,152 logits each: the size of SmolLM2's, where the cut-offs narrow first
    "peaked": lambda r: np.concatenate([r.normal(0, 1, 49_142) - 12, r.normal(0, 2, 10)]),
    "spread": lambda r: r.normal(0, 3, 49_152),
    "flat": lambda r: r.normal(0, 0.5, 49_152),
    "masked": lambda r: np.where(r.random(49_152) < 0.9, -np.inf, r.normal(0, 2, 49_152)),
    "ties": lambda r: np.round(r.normal(0, 2, 49_152), 1),
}


@pytest.mark.parametrize("vocabulary", list(VOCABULARIES))
def test_the_cut_offs_keep_what_sorting_the_whole_vocabulary_keeps(vocabulary):
    """top-k, top-p and min-p look only at the tokens near the top when they can; what they
    keep must be what sorting everything keeps, also where the narrowing gives up (flat
    logits, a top-k larger than the tokens near the top, a top-p that needs the tail)."""
    from engine.sampling import _cut_small, _kept, _top_k
    rng = np.random.default_rng(11)
    cases = [SamplingParams(top_k=k) for k in (1, 5, 40, 1000, 30_000)]
    cases += [SamplingParams(top_p=q) for q in (0.05, 0.5, 0.9, 0.95, 0.9999)]
    cases += [SamplingParams(min_p=m) for m in (1e-6, 0.01, 0.05, 0.5, 1.0)]
    cases += [SamplingParams(top_k=40, top_p=0.95, min_p=0.05),
              SamplingParams(top_p=0.95, min_p=0.05), SamplingParams(top_k=200, top_p=0.8),
              SamplingParams(top_k=2000, min_p=0.02)]
    for _ in range(3):
        logits = VOCABULARIES[vocabulary](rng).astype(np.float32)
        for p in cases:
            top = float(logits.max())
            want = kept_by_sorting(logits, p)
            k = _top_k(logits, top, p.top_k) if p.top_k > 0 else None
            ids, depth = _kept(logits, top, p, k)
            np.testing.assert_array_equal(np.sort(logits[ids]), want, err_msg=str(p))
            np.testing.assert_array_equal(depth, logits.max() - logits[ids])
            if 0 < p.top_k <= 64:   # what draw does with a small top-k: lists, not arrays
                small, xs = _cut_small(k, logits[k], top, p)
                np.testing.assert_array_equal(np.sort(logits[small]), want, err_msg=str(p))
                assert xs == logits[small].tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_p=0.5),
])
def test_small_candidate_sets_are_drawn_with_their_probabilities(params):
    """Where a cut-off leaves a few dozen tokens draw finishes in plain Python: the counts must
    still follow the distribution the parameters define, on a 49,152-token vocabulary."""
    rng = np.random.default_rng(5)
    logits = np.concatenate([rng.normal(0, 1, 49_100) - 8, rng.normal(0, 1.5, 52)])
    logits = logits.astype(np.float32)
    want = expected(logits, params)
    assert 1 < np.count_nonzero(want) <= 64
    n = 30_000
    counts = np.bincount([draw(logits, params, rng) for _ in range(n)], minlength=logits.size)
    assert counts[want == 0].sum() == 0
    sd = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sd + 1)


def test_nan_logits_with_cut_offs_still_give_a_token_id():
    """A model that returns NaN logits gives nonsense, but sampling with cut-offs must not
    raise: the worker would end that request with an error instead of its (nonsense) tokens."""
    rng = np.random.default_rng(0)
    for fill in (np.nan, -np.inf):
        logits = np.full(1000, fill, dtype=np.float32)
        for p in (SamplingParams(top_k=40), SamplingParams(top_k=40, top_p=0.9, min_p=0.1),
                  SamplingParams(top_p=0.9), SamplingParams(min_p=0.05)):
            assert 0 <= draw(logits, p, rng) < logits.size
    logits = np.zeros(1000, dtype=np.float32)
    logits[7] = np.inf
    assert draw(logits, SamplingParams(top_p=0.9), rng) == 7
