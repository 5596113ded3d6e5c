"""The thread governor, driven by recorded CPU figures (no clock, no /proc)."""
from engine.threads import CpuMeter, CpuSample, ThreadGovernor

HZ = 100


def feed(gov: ThreadGovernor, others_per_window: list[float], own_cores: float = 2.0,
         window: float = 0.5) -> list[int]:
    """Feed windows in which other processes used the given cores; returns the thread count
    after each window."""
    t, busy, own = 0.0, 0, 0
    gov.observe(CpuSample(t, busy, own))
    counts = []
    for others in others_per_window:
        t += window
        own += round(own_cores * window * HZ)
        busy += round((own_cores + others) * window * HZ)
        gov.observe(CpuSample(t, busy, own))
        counts.append(gov.threads)
    return counts


def test_a_quiet_machine_keeps_every_configured_thread():
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [0.0, 0.1, 0.25, 0.3, 0.0]) == [2, 2, 2, 2, 2]


def test_one_busy_neighbour_drops_to_one_thread_within_two_windows():
    # next to 2 spinning threads a busy loop gets about 2/3 of a core (0.71 was logged in the
    # window a neighbour started in, 0.97 in the windows after)
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [0.0, 0.67, 0.67]) == [2, 2, 1]
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [0.0, 0.71, 0.97]) == [2, 2, 1]


def test_a_burst_of_one_window_keeps_every_thread():
    # guidellm starting a concurrency level: 0.51-0.82 of a core for one window (session 11 logs)
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [0.0, 0.82, 0.1, 0.0, 0.56, 0.2, 0.8, 0.0]) == [2] * 8


def test_a_window_that_leaves_no_doubt_drops_at_once():
    # others beyond the threshold by `sure` (0.5) cores: 1.2 of 2 cores leaves less than a core
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [0.0, 1.2]) == [2, 1]


def test_a_sustained_excess_takes_one_thread_per_two_windows():
    gov = ThreadGovernor(configured=4, cores=4)
    assert feed(gov, [0.6, 0.9, 0.0, 0.0]) == [4, 3, 3, 4]
    gov = ThreadGovernor(configured=4, cores=4)   # 2.4 cores: 2 at once (1.9 is beyond doubt)
    assert feed(gov, [2.4, 2.4]) == [2, 2]


def test_threads_come_back_only_after_two_quiet_windows():
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [1.0, 1.0, 0.0, 0.0, 0.0]) == [2, 1, 1, 2, 2]


def test_a_neighbour_that_pauses_for_one_window_does_not_bring_threads_back():
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]) == [2, 1, 1, 1, 1, 1]


def test_never_fewer_than_one_thread_even_when_every_core_is_taken():
    gov = ThreadGovernor(configured=4, cores=4)
    assert feed(gov, [4.0, 8.0]) == [1, 1]


def test_never_more_threads_than_configured():
    gov = ThreadGovernor(configured=2, cores=8)
    assert feed(gov, [0.0, 0.0, 0.0]) == [2, 2, 2]


def test_on_a_big_machine_a_neighbour_on_spare_cores_changes_nothing():
    gov = ThreadGovernor(configured=2, cores=8)
    assert feed(gov, [5.0, 5.5]) == [2, 2]


def test_target_leaves_the_cores_others_use():
    gov = ThreadGovernor(configured=4, cores=4)
    assert [gov.target(o) for o in (0.0, 0.4, 0.6, 1.0, 2.2, 3.9)] == [4, 4, 3, 3, 2, 1]


def test_a_context_with_half_the_threads_gives_up_half_of_the_lost_cores():
    # two contexts of 2 threads on 4 cores: others on 2 cores leave 1 core to each
    gov = ThreadGovernor(configured=2, cores=4, share=0.5)
    assert gov.target(0.0) == 2
    assert gov.target(2.0) == 1


def test_a_window_shorter_than_the_minimum_is_not_a_decision():
    gov = ThreadGovernor(configured=2, cores=2, window=0.5)
    gov.observe(CpuSample(0.0, 0, 0))
    assert not gov.due(0.2)
    assert gov.observe(CpuSample(0.2, 100, 0)) is None
    assert gov.threads == 2
    assert gov.due(0.5)


def test_a_change_says_why():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    assert gov.observe(CpuSample(0.5, 150, 100)) is None   # 50 ticks of others in 0.5 s: 1 core
    change = gov.observe(CpuSample(1.0, 300, 200))          # and again
    assert change is not None and (change.previous, change.threads) == (2, 1)
    assert "1.00 of 2 cores" in change.reason


def test_the_meter_reads_this_process_and_its_cores():
    meter = CpuMeter()
    a = meter.sample(0.0)
    sum(i * i for i in range(200_000))   # some CPU time of our own
    b = meter.sample(1.0)
    assert meter.cpus and b.busy >= a.busy and b.own >= a.own


def test_what_others_do_while_the_context_is_idle_is_not_contention():
    # a benchmark client (or another server) busy on both cores between our requests: the
    # next request must not start on fewer threads
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    assert gov.observe(CpuSample(0.5, 105, 100)) is None            # busy, others 0.1 core
    gov.pause(CpuSample(0.75, 105 + 26, 100 + 25))                    # idle from here...
    assert gov.observe(CpuSample(3.0, 131 + 450, 125)) is None        # ...others used 2 cores
    assert gov.threads == 2 and gov.due(3.25)
    assert gov.observe(CpuSample(3.25, 581 + 51, 125 + 50)) is None   # busy 0.25 + 0.25 s, quiet
    assert gov.threads == 2 and gov.others == 0.04   # (1 + 1 ticks) / 0.5 s


def test_busy_time_on_both_sides_of_a_pause_makes_one_window():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    gov.pause(CpuSample(0.3, 60 + 30, 60))           # 0.3 s busy, a neighbour on 1 core
    assert gov.threads == 2                          # 0.3 s is not a window yet
    gov.observe(CpuSample(5.0, 500, 400))            # resume: a new start, the idle gap dropped
    assert not gov.due(5.1) and gov.due(5.2)
    # 0.2 s more, the same neighbour
    assert gov.observe(CpuSample(5.2, 500 + 40 + 20, 400 + 40)) is None
    assert abs(gov.others - 1.0) < 0.01              # one window: a first vote to go down
    change = gov.observe(CpuSample(5.7, 560 + 150, 440 + 100))
    assert change is not None and change.threads == 1


def test_the_thread_count_is_kept_across_a_pause():
    gov = ThreadGovernor(configured=2, cores=2)
    assert feed(gov, [1.0, 1.0]) == [2, 1]
    gov.pause(CpuSample(0.6, 300, 200))
    gov.observe(CpuSample(9.0, 300, 200))
    assert gov.threads == 1


def test_a_step_far_slower_than_usual_gives_up_a_thread_at_once_and_the_windows_bring_it_back():
    gov = ThreadGovernor(configured=2, cores=2)
    change = gov.slowed(40.0)           # a neighbour arrived: a step took 40 times its time
    assert change is not None and (change.previous, change.threads) == (2, 1)
    assert "40x" in change.reason
    assert gov.slowed(40.0) is None     # one thread: nothing left to give up
    assert feed(gov, [0.0, 0.0, 0.0]) == [1, 2, 2]   # the cores are free again: back up


def idle_then_resume(gov, others_idle: float, seconds: float = 3.0):
    """Pause at t=10, idle samples every 0.5 s with other processes on `others_idle` cores,
    then a resume sample; returns the change observe gives at the resume."""
    t, busy, own = 10.0, 5000, 4000
    gov.pause(CpuSample(t, busy, own))
    while t < 10.0 + seconds:
        t += 0.5
        busy += round(others_idle * 0.5 * HZ)
        gov.idle_sample(CpuSample(t, busy, own))
    return gov.observe(CpuSample(t + 0.1, busy + round(others_idle * 0.1 * HZ), own))


def test_threads_given_up_come_back_at_a_request_after_a_quiet_idle_time():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    gov.slowed(6.0)                      # a neighbour came as the last request ended
    assert gov.threads == 1
    change = idle_then_resume(gov, others_idle=0.05)   # it left while we were idle
    assert change is not None and (change.previous, change.threads) == (1, 2)
    assert "before this request" in change.reason


def test_a_neighbour_busy_until_the_request_keeps_the_threads_given_up():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    gov.slowed(6.0)
    assert idle_then_resume(gov, others_idle=1.0) is None and gov.threads == 1


def test_idle_time_never_takes_threads_away():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    assert idle_then_resume(gov, others_idle=2.0) is None and gov.threads == 2


def test_an_idle_time_shorter_than_a_window_decides_nothing():
    gov = ThreadGovernor(configured=2, cores=2)
    gov.observe(CpuSample(0.0, 0, 0))
    gov.slowed(6.0)
    assert idle_then_resume(gov, others_idle=0.0, seconds=0.3) is None and gov.threads == 1
