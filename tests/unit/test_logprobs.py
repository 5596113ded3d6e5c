"""Logprobs of a sampled token: log-softmax of the logits, with the top alternatives."""
import math

import numpy as np

from engine.logprobs import token_logprob


def piece(i: int) -> bytes:
    return f"<{i}>".encode()


def test_logprobs_are_a_log_softmax():
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    lp = token_logprob(logits, 2, 0, piece)
    expected = 2.0 - math.log(1 + math.e + math.e ** 2)
    assert abs(lp.logprob - expected) < 1e-6 and lp.piece == b"<2>" and lp.top == ()


def test_top_alternatives_are_the_k_most_likely_best_first():
    logits = np.array([0.5, 3.0, -1.0, 2.0], dtype=np.float32)
    lp = token_logprob(logits, 0, 2, piece)
    assert [t for t, _, _ in lp.top] == [1, 3]
    assert lp.top[0][2] > lp.top[1][2] > lp.logprob
