"""Log-probabilities of sampled tokens: log-softmax of the logits the sampler saw, after
logit_bias and before temperature, top-k/top-p/min-p and any grammar mask (so they describe the
model, not the sampling settings; OpenAI's are likewise the model's)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    piece: bytes
    logprob: float | None   # None: the first prompt token (nothing predicts it)
    top: tuple[tuple[int, bytes, float], ...] = ()   # the k most likely, best first


def token_logprob(logits: np.ndarray, token: int, k: int,
                  piece: Callable[[int], bytes]) -> TokenLogprob:
    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - m).sum(dtype=np.float64)))
    top: tuple[tuple[int, bytes, float], ...] = ()
    if k > 0:
        ids = np.argpartition(logits, -k)[-k:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        top = tuple((int(i), piece(int(i)), float(logits[i]) - lse) for i in ids)
    return TokenLogprob(token, piece(token), float(logits[token]) - lse, top)
