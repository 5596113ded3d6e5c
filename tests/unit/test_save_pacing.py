"""A prefix is copied to the cache tiers between two steps while streams run only when the copy
fits the step target beside the step just run; one that does not fit has the next step leave
room for it, unless it is too large for any step (scheduler/save_pacing.py)."""
import pytest

from scheduler.save_pacing import MAX_RESERVE, PRIOR_TOKEN_S, SavePacer


def test_a_copy_fits_beside_a_short_step_and_not_beside_a_long_one():
    pacer = SavePacer(target_s=0.5)
    n = 2000                                   # 0.2 s at the prior
    assert pacer.estimate(n) == pytest.approx(n * PRIOR_TOKEN_S)
    assert pacer.fits(0.1, n)
    assert not pacer.fits(0.35, n)
    assert pacer.reserve_s(n) == pytest.approx(0.2)


def test_a_copy_too_large_for_a_step_is_left_for_idle_time():
    pacer = SavePacer(target_s=0.5)
    n = int(0.5 * MAX_RESERVE / PRIOR_TOKEN_S) + 1
    assert not pacer.fits(0.0, n)
    assert pacer.reserve_s(n) == 0.0


def test_without_a_step_target_nothing_is_copied_while_busy():
    pacer = SavePacer(target_s=0.0)
    assert not pacer.fits(0.0, 16) and pacer.reserve_s(16) == 0.0


def test_the_cost_follows_a_slower_copy_at_once_and_a_faster_one_slowly():
    pacer = SavePacer(target_s=0.5)
    pacer.observe(1000, 0.3, step_s=0.1)       # 3e-4 s a token: taken at once
    assert pacer.token_s == pytest.approx(3e-4)
    assert not pacer.fits(0.1, 1000)
    pacer.observe(1000, 0.05, step_s=0.1)      # faster: part of the way
    assert 5e-5 < pacer.token_s < 3e-4
    assert pacer.copies == 2 and pacer.copy_s == pytest.approx(0.35)
    assert pacer.max_gap_s == pytest.approx(0.4)
