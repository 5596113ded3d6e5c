"""Prompt chunks sized by time: the costs of recent steps (StepCosts) and the allowance the
scheduler gives a long prompt beside decoding streams."""
import pytest

from kvcache import BlockManager
from scheduler import Scheduler, Sequence, make_policy
from scheduler.costs import StepCosts


def test_nothing_is_known_until_a_prompt_token_was_timed():
    costs = StepCosts()
    costs.observe_decode(0.06)
    assert costs.prompt_tokens_within(0.5, decoding=True) is None


def test_the_tokens_that_fit_are_what_the_target_leaves_beside_the_decode_tokens():
    costs = StepCosts()
    costs.observe_decode(0.1)
    costs.observe_prompt(100, 0.4)                  # 4 ms a prompt token
    assert costs.prompt_tokens_within(0.5, decoding=True) == 100
    assert costs.prompt_tokens_within(0.5, decoding=False) == 125
    assert costs.prompt_tokens_within(0.05, decoding=True) == 0   # the decode alone is longer


def test_costs_follow_recent_steps_more_than_old_ones():
    costs = StepCosts(alpha=0.5)
    costs.observe_prompt(10, 0.01)                  # 1 ms a token
    costs.observe_prompt(10, 0.03)                  # then 3 ms
    assert costs.prompt_token_s == pytest.approx(0.002)
    costs.observe_prompt(0, 1.0)                    # no prompt tokens: nothing learned
    assert costs.prompt_token_s == pytest.approx(0.002)


def make(step_target_s: float) -> Scheduler:
    manager = BlockManager(2048, block_size=8, num_seq_ids=16, prefill_chunk=16)
    return Scheduler(manager, make_policy("fifo"), max_seqs=8, max_batch_tokens=256,
                     wave_batch_tokens=2048, step_target_s=step_target_s)


def pieces_of_a_long_prompt_beside(sched: Scheduler, streams: int = 6) -> list[int]:
    """Start `streams` decoding streams (more than few_decoding, whose prompts finish in one
    piece), then a 2,000-token prompt; the prompt tokens of each
    step until the prompt is computed (costs: 60 ms of decode tokens, 3 ms a prompt token)."""
    sched.costs.observe_decode(0.06)
    sched.costs.observe_prompt(100, 0.3)
    running = [Sequence([1000 * i + j for j in range(5)], max_tokens=10**6) for i in range(streams)]
    for s in running:
        sched.add(s)
    while any(not s.is_decoding for s in running):
        advance(sched, sched.schedule())
    long = Sequence(list(range(50_000, 52_000)), max_tokens=4)
    sched.add(long)
    sizes = []
    while long.num_output == 0:
        plan = sched.schedule()
        sizes.append(sum(c.end - c.start for c in plan.chunks if c.seq is long))
        assert sum(1 for c in plan.chunks if c.seq.is_decoding) == streams   # nobody waits
        advance(sched, plan)
    return sizes


def advance(sched: Scheduler, plan) -> None:
    sched.advance(plan)
    for c in plan.chunks:
        if c.wants_logits:
            c.seq.tokens.append(7)


def test_a_long_prompt_beside_decoding_streams_gets_what_the_step_target_allows():
    sizes = pieces_of_a_long_prompt_beside(make(step_target_s=0.5))
    # 0.5 s less 60 ms of decode tokens leaves 146 tokens at 3 ms: whole grid cells of 16
    assert max(sizes) == 144 and len(sizes) <= 15


def test_seconds_reserved_for_a_prefix_copy_shorten_the_prompt_pieces():
    sched = make(step_target_s=0.5)
    sched.reserved_s = 0.2       # 0.5 - 0.2 - 60 ms leaves 80 tokens at 3 ms: 5 grid cells
    sizes = pieces_of_a_long_prompt_beside(sched)
    assert max(sizes) == 80


def test_without_a_step_target_a_prompt_gets_one_grid_cell_a_step():
    sizes = pieces_of_a_long_prompt_beside(make(step_target_s=0.0))
    assert max(sizes) == 16 and len(sizes) == 125


def test_a_step_may_grow_past_the_batch_budget_up_to_what_one_decode_takes():
    sched = make(step_target_s=2.0)                  # ~646 tokens fit: more than 256
    sizes = pieces_of_a_long_prompt_beside(sched)
    assert max(sizes) > 256 - 6 and max(sizes) <= sched.max_step_tokens


def test_what_a_call_should_take_needs_both_of_its_parts_known():
    costs = StepCosts()
    assert costs.expected(decode=True, prompt_tokens=0) is None
    costs.observe_decode(0.05)
    assert costs.expected(decode=True, prompt_tokens=0) == pytest.approx(0.05)
    assert costs.expected(decode=True, prompt_tokens=16) is None
    costs.observe_prompt(16, 0.08)
    assert costs.expected(decode=True, prompt_tokens=32) == pytest.approx(0.05 + 0.16)
    assert costs.expected(decode=False, prompt_tokens=32) == pytest.approx(0.16)


# ---- prompt pieces by their depth ----------------------------------------------------------------
def true_seconds(pieces, c0=2e-3, c1=4e-6):
    return sum(n * (c0 + c1 * (d + n / 2)) for n, d in pieces)


def test_the_prompt_model_learns_how_a_tokens_cost_grows_with_its_depth():
    from scheduler.costs import PromptModel, attention_work
    model = PromptModel()
    for depth in range(0, 6000, 256):
        pieces = [(256, depth)]
        model.observe(256, attention_work(pieces), true_seconds(pieces))
    c0, c1 = model.fit()
    assert abs(c0 - 2e-3) < 1e-5 and abs(c1 - 4e-6) < 1e-7


def test_before_deep_pieces_are_seen_a_deep_piece_is_taken_to_cost_more_a_token():
    from scheduler.costs import PromptModel, attention_work
    model = PromptModel()
    model.observe(64, attention_work([(64, 0)]), true_seconds([(64, 0)]))
    assert model.seconds([(64, 4096)]) > 2 * model.seconds([(64, 0)])
    assert model.tokens_within(0.5, 4096) < model.tokens_within(0.5, 0)


def test_the_first_long_prompt_gets_steps_near_the_target_at_every_depth():
    """A prompt computed beside streams from a cold start: each step takes what the model
    allows for its depth; no step goes past 1.5 times the target, deep in the prompt too."""
    from scheduler.costs import StepCosts
    costs, target, depth, worst = StepCosts(), 0.5, 0, 0.0
    costs.observe_decode(0.05, 8, 8)
    n = 16                                           # before any prompt piece: one grid cell
    while depth < 8000:
        pieces = [(n, depth)]
        seconds = true_seconds(pieces)
        worst = max(worst, seconds + 0.05)
        costs.observe_prompt(n, seconds, pieces)
        depth += n
        n = max(16, costs.prompt_tokens_within(target, decoding=True, depth=depth))
    assert worst <= 1.5 * target



def test_a_thread_given_up_halves_the_next_prompt_piece_and_one_taken_back_waits_to_be_timed():
    """After a drop the next piece is sized for the threads left (a piece sized for all of
    them takes about twice the target on half of them); after a raise the figures stay
    until steps on more threads are timed (a second thread gave 1.3 to 2 times the speed)."""
    costs = StepCosts()
    costs.follow_threads(2)
    costs.observe_decode(0.1)
    costs.observe_prompt(100, 0.4)                  # 4 ms a prompt token on two threads
    assert costs.prompt_tokens_within(0.5, decoding=True) == 100
    costs.follow_threads(1)
    assert costs.decode_s == pytest.approx(0.2) and costs.prompt_token_s == pytest.approx(0.008)
    assert costs.prompt_tokens_within(0.5, decoding=True) == 37    # (0.5 - 0.2) / 8 ms
    costs.follow_threads(1)                         # no change, nothing scaled again
    assert costs.prompt_token_s == pytest.approx(0.008)
    costs.follow_threads(2)                         # back: as measured on one thread, for now
    assert costs.prompt_tokens_within(0.5, decoding=True) == 37
    costs.observe_prompt(37, 37 * 0.005)            # timed on two: the figures follow
    assert costs.prompt_token_s < 0.008


def test_call_and_depth_models_scale_with_a_drop_in_threads():
    costs = StepCosts()
    costs.follow_threads(4)
    costs.observe_prompt(100, 0.2)
    for n in (1, 2, 4, 1, 2, 4):
        costs.observe_decode(0.02 + 0.002 * n, n)
    costs.observe_prompt(256, 0.6, [(256, 1000)])
    a, b = costs.call_model()
    deep = costs.prompt_time(64, [(64, 2000)])
    costs.follow_threads(2)
    assert costs.call_model() == pytest.approx((2 * a, 2 * b))
    assert costs.prompt_time(64, [(64, 2000)]) == pytest.approx(2 * deep)
