"""The step-time target (PAGEDLLAMA_STEP_TARGET_MS) holds from the first long prompt after
start-up, as a client sees it: while a long prompt arriving beside 8 decoding streams is
computed, no stream waits much longer than the target between two of its tokens. The prompt
(~1,800 tokens) is this model's 8,000-token case within the default 2,048-token context: 8
streams, and a prompt of many steps whose last pieces attend over all of it.

The gaps are timed by the client, between the chunks of each stream; the streams ask for
logprobs, so every token comes in a chunk of its own, with text or not (a control token has
none, and two steps would then pass between texts)."""
import threading
import time

import httpx

from tests.devices import cpu_timing
from tests.server_proc import SMOLLM2_NAME, running_server

TARGET_MS = 500
STREAMS = 8
# The largest gap a stream may see while the long prompt is computed: twice the target, and
# 0.25 s for what lies between a step and the client. Measured (this test, 2-core VM, a load
# average of 5-6 from other processes): the largest gap 0.58, 0.60, 0.71, 0.77 and 0.94 s in
# five runs, each within 10 ms of the server's own largest step from plan to plan; a step is
# sized by costs learned on the machine, so processes taking its cores mid-step lengthen it
# (0.94 s: 1.9 times the target). With the long prompt computed in one step a stream waited
# 28.4 s. Twice the target leaves room for that load; a step loop that lets the streams wait
# much longer than a step is what this catches.
MAX_GAP_S = 2 * TARGET_MS / 1000 + 0.25


def stream(base: str, started: threading.Event, enough: threading.Event, out: list) -> None:
    """One stream of up to 300 tokens, closed once the long prompt is computed (its last
    tokens would only add decode steps alone); `out` gets (status, an error event, the times
    its chunks arrived)."""
    body = {"model": SMOLLM2_NAME, "prompt": "Once upon a time", "max_tokens": 300,
            "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 1}
    error, times = False, []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                error = error or '"error"' in line
                started.set()
                if enough.is_set():
                    break
    out.append((resp.status_code, error, times))


@cpu_timing
def test_the_first_long_prompt_after_start_up_keeps_every_stream_near_the_target():
    with running_server({"PAGEDLLAMA_STEP_TARGET_MS": str(TARGET_MS),
                         "PAGEDLLAMA_SPECULATIVE": "off"}) as base:
        events, enough, out = [threading.Event() for _ in range(STREAMS)], threading.Event(), []
        threads = [threading.Thread(target=stream, args=(base, e, enough, out)) for e in events]
        for t in threads:
            t.start()
        try:
            assert all(e.wait(120) for e in events)
            sent = time.monotonic()
            long = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": SMOLLM2_NAME, "prompt": "The history of the river. " * 300,
                "max_tokens": 1, "temperature": 0})
            done = time.monotonic()
        finally:
            enough.set()
            for t in threads:
                t.join(300)
        assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] > 1500
        assert [(status, error) for status, error, _ in out] == [(200, False)] * STREAMS
        gaps = []   # every gap that overlaps the long request, from its sending to its answer
        for _, _, times in out:
            assert times[-1] > done, "a stream ended before the long prompt was computed"
            gaps += [b - a for a, b in zip(times, times[1:]) if b > sent and a < done]
        assert max(gaps) <= MAX_GAP_S, (round(max(gaps), 3), round(done - sent, 1))
        # the prompt shared steps with the streams: many gaps, ~one per step of it
        assert len(gaps) >= STREAMS * 4, (len(gaps), done - sent)
