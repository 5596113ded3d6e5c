"""Draftless drafts (engine/drafting.py): prompt lookup in a sequence's own tokens, the table
shared by a context's sequences, acceptance estimates, and what a lookup costs."""
import random
import time
import tracemalloc

import pytest

from engine.drafting import (
    MAX_BACKOFF,
    Acceptance,
    Drafter,
    SequenceIndex,
    SharedTable,
    expected_tokens,
    verify,
)


def test_a_suffix_seen_before_drafts_what_followed_it():
    index = SequenceIndex((3, 2))
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]            # "2 3" occurred before, then 4 5 6
    assert index.lookup(tokens, 3) == [4, 5, 6]
    assert index.lookup(tokens, 10) == [4, 5, 6, 9, 9, 2, 3]   # up to the end, no further


def test_the_longest_suffix_wins_and_the_latest_occurrence_of_it():
    index = SequenceIndex((3, 2))
    tokens = [7, 2, 3, 50, 1, 2, 3, 60, 8, 8, 1, 2, 3]
    assert index.lookup(tokens, 1) == [60]             # "1 2 3" (3 tokens) before "2 3"
    index = SequenceIndex((3, 2))
    tokens = [2, 3, 50, 9, 2, 3, 60, 9, 4, 2, 3]
    assert index.lookup(tokens, 1) == [60]             # the later of two "2 3"


def test_nothing_is_drafted_from_the_suffix_itself_or_an_unseen_one():
    index = SequenceIndex((2,))
    assert index.lookup([1, 2, 3, 4], 4) == []
    assert index.lookup([5], 4) == []


def test_the_index_grows_with_the_sequence():
    index = SequenceIndex((2,))
    tokens = [1, 2, 3]
    assert index.lookup(tokens, 2) == []
    tokens += [4, 1, 2]
    assert index.lookup(tokens, 2) == [3, 4]


def test_the_shared_table_drafts_across_sequences_token_by_token():
    table = SharedTable(n=3, slots=1 << 10)
    answer = [10, 11, 12, 13, 14, 15, 16]
    table.add([1, 2] + answer)
    assert table.lookup([99, 98, 10, 11, 12], 3) == [13, 14, 15]
    assert table.lookup([10, 11, 12], 10) == [13, 14, 15, 16]
    assert table.lookup([12, 11, 10], 3) == []         # never seen


def test_a_shared_slot_whose_key_differs_drafts_nothing():
    table = SharedTable(n=2, slots=1)                  # every n-gram shares the one slot
    table.add([1, 2, 3])
    assert table.lookup([1, 2], 1) == [3]
    assert table.lookup([5, 6], 1) == []               # same slot, another key


def test_the_shared_table_keeps_its_size_whatever_it_sees():
    """20,000 n-grams into 256 slots: every slot taken, counted once, and not a byte more
    held (measured) than the empty table held."""
    table = SharedTable(n=4, slots=1 << 8)
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table.add(tokens)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(table.keys) == len(table.values) == 1 << 8
    assert table.used == sum(v >= 0 for v in table.values) == 1 << 8
    assert grown < 1024, f"{grown} bytes more"


def test_the_drafter_prefers_the_sequence_and_falls_back_to_the_shared_table():
    drafter = Drafter(max_tokens=4, sizes=(3, 2), shared_n=3, shared_slots=1 << 12)
    first = drafter.start()
    drafter.draft(first, [1, 2, 3, 20, 21, 22, 23, 24, 25])
    other = drafter.start()                            # its own tokens say nothing of "21 22"
    assert drafter.draft(other, [40, 41, 20, 21, 22]) == [23, 24, 25]
    mine = drafter.start()
    assert drafter.draft(mine, [20, 21, 22, 7, 7, 20, 21, 22]) == [7, 7, 20, 21]
    assert drafter.draft(mine, [20, 21, 22, 7, 7, 20, 21, 22], k=2) == [7, 7]


def test_an_ended_sequence_that_drafted_leaves_its_answer_to_the_others():
    drafter = Drafter(max_tokens=3, sizes=(3,), shared_n=3, shared_slots=1 << 12)
    idle, busy = drafter.start(), drafter.start()
    drafter.finish(idle, [5, 6, 7, 8, 9])               # never drafted: shares nothing
    assert drafter.draft(drafter.start(), [5, 6, 7]) == []
    drafter.draft(busy, [1, 2, 3])
    drafter.finish(busy, [1, 2, 3, 30, 31, 32, 33])
    assert drafter.draft(drafter.start(), [0, 30, 31, 32]) == [33]


def scored(drafter, tokens, produced):
    """A new sequence drafts after `tokens`; the model then produces `produced`; the draft's
    score shows on the next lookup. Returns the sequence's state."""
    state = drafter.start()
    draft = drafter.draft(state, tokens)
    assert draft, "the tokens repeat: a draft"
    drafter.finish(state, list(tokens) + list(produced))
    return state


def test_new_sequences_start_from_the_contexts_recent_acceptance():
    drafter = Drafter(max_tokens=4, sizes=(2,), shared=False)
    text = [1, 2, 3, 4, 5, 6, 1, 2]                   # drafts 3, 4, 5, 6
    for _ in range(20):
        scored(drafter, text, [9, 9, 9, 9])           # wrong from the first token
    assert drafter.start().acceptance.rate < 0.2
    assert drafter.start().acceptance.gain(4) < 0.2
    for _ in range(40):
        scored(drafter, text, [3, 4, 5, 6])
    assert drafter.start().acceptance.rate > 0.8
    assert drafter.start().acceptance.gain(4) > 3.0


def test_every_draft_is_scored_by_the_tokens_the_model_went_on_to_produce():
    """Verified or not: the model's tokens are the same either way, so drafts the policy did
    not verify teach acceptance too (verifications only count)."""
    drafter = Drafter(max_tokens=4, sizes=(2,), shared=False)
    state = drafter.start()
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.draft(state, tokens) == [3, 4, 5, 6]
    tokens += [3, 4]                                  # right so far: not scored yet
    drafter.draft(state, tokens)
    assert state.acceptance.weights == []
    tokens += [7]                                     # wrong at its third token
    drafter.draft(state, tokens)
    assert state.acceptance.weights == [1.0] * 4
    assert state.acceptance.sums == [1.0, 2.0, 2.0, 2.0]
    drafter.observe(state, drafted=2, accepted=2)     # a verification: counted, not learnt
    assert state.acceptance.sums == [1.0, 2.0, 2.0, 2.0] and state.accepted == 2


def test_a_sequence_whose_drafts_are_wrong_looks_up_less_often():
    drafter = Drafter(max_tokens=2, sizes=(1,), shared=False)
    state = drafter.start()
    tokens = [1, 2, 1]
    skipped = []
    for step in range(40):             # what followed 1 last time; the model says a new token
        skipped.append(not drafter.draft(state, tokens))
        tokens += [100 + step, 1]
    assert sum(skipped) > 25 and state.backoff == MAX_BACKOFF
    for _ in range(MAX_BACKOFF + 3):   # the text repeats now: drafting again once one is right
        drafter.draft(state, tokens)
        tokens += [7, 1]
    assert state.backoff == 0 and state.skip == 0
    assert drafter.draft(state, tokens) == [7, 1]


def test_gains_measure_drafts_that_are_right_whole_or_wrong_from_the_start():
    """n-gram drafts are mostly all right or all wrong: half of them right whole gives half a
    token for one drafted token and four for eight, where the geometric rate (accepted over
    accepted and rejected: ~0.8) says 0.8 and ~3.3."""
    a = Acceptance(decay=0.95, prior_weight=0.0)
    for _ in range(20):
        a.observe(drafted=8, accepted=8)
        a.observe(drafted=8, accepted=0)
    assert a.gain(1) == pytest.approx(0.5, abs=0.05)
    assert a.gain(8) == pytest.approx(4.0, abs=0.5)
    assert expected_tokens(a.rate, 1) - 1 > 0.75


def test_acceptance_follows_recent_verifications():
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(10):
        a.observe(drafted=4, accepted=4)
    assert a.rate > 0.9
    for _ in range(10):
        a.observe(drafted=4, accepted=0)
    low = a.rate
    assert low < 0.3
    a.observe(drafted=0, accepted=0)                   # nothing drafted: nothing learned
    assert a.rate == low


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8, 1.0])
def test_expected_tokens_is_what_verifications_yield_on_average(rate):
    """`verify` over many drafts whose every position the model draws as drafted with
    probability `rate`: the tokens it emits a verification, on average, are the policy's
    expected_tokens(rate, k)."""
    rng = random.Random(7)
    for k in (1, 3, 6):
        n, emitted = 4000, []
        for _ in range(n):
            verify([1] * k, lambda i: 1 if rng.random() < rate else 2,
                   lambda token: emitted.append(token) or False)
        assert len(emitted) / n == pytest.approx(expected_tokens(rate, k), abs=0.15)


def test_a_lookup_costs_microseconds_beside_a_millisecond_step():
    """The drafting step's cost against a decode step (~7-11 ms at one stream on 2 cores): a
    draft for a 1,500-token sequence, its index and the shared table warm."""
    rng = random.Random(1)
    text = [rng.randrange(1000, 1200) for _ in range(1500)]
    drafter = Drafter(max_tokens=8)
    state = drafter.start()
    drafter.draft(state, text)
    n, t0 = 500, time.perf_counter()
    for i in range(n):
        text.append(text[i % 700])
        drafter.draft(state, text)
    per_draft = (time.perf_counter() - t0) / n
    assert per_draft < 200e-6, f"{per_draft * 1e6:.0f} us a draft"


def test_verifications_that_accept_less_than_expected_scale_the_estimates_down():
    drafter = Drafter(max_tokens=4, sizes=(2,), shared=False)
    state = drafter.start()
    state.acceptance = Acceptance(prior_weight=0.0)
    for _ in range(10):
        state.acceptance.observe(4, 4)
    assert drafter.gains(state, 2) == pytest.approx((1.0, 2.0))
    for _ in range(20):                                # verified at 2: half of it accepted
        drafter.gains(state, 2)
        drafter.observe(state, drafted=2, accepted=1)
    assert drafter.realization == pytest.approx(0.5, abs=0.05)
    assert drafter.gains(state, 2)[1] == pytest.approx(1.0, abs=0.1)
    for _ in range(500):                               # drafts scored, none verified: it fades
        scored(drafter, [1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 6])
    assert drafter.realization > 0.9
