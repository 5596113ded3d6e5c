"""engine.handoff: events reach the loop's thread, in order; a closed loop refuses them; other
loops get call_soon_threadsafe. (Whether the loop waits for the GIL is a matter of timing, which
unit tests do not assert: measured in engine/handoff.py's figures.)"""
import asyncio
import threading

import pytest

from engine.handoff import hand_over


def test_callbacks_run_on_the_loop_thread_in_order():
    loop = asyncio.new_event_loop()
    got, done = [], threading.Event()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        def record(x):
            got.append((x, threading.current_thread() is thread))
            if x == 99:
                done.set()
        for i in range(100):
            hand_over(loop, record, i)
        assert done.wait(5)
        assert got == [(i, True) for i in range(100)]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_a_closed_loop_refuses_them():
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError):
        hand_over(loop, print, 1)


def test_another_loop_gets_call_soon_threadsafe():
    class OtherLoop:
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, callback, *args):
            self.calls.append((callback, args))
    other = OtherLoop()
    hand_over(other, print, 7)
    assert other.calls == [(print, (7,))]
