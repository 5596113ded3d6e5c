"""A request the worker cannot admit or step ends alone: it gets an error event, its sequence,
KV blocks and slot are freed, and the requests beside it finish as they would have alone.
Failures are injected into one request's sampler (a real worker over a real model)."""
import asyncio

import numpy as np
import pytest

from engine import EngineConfig, ErrorKind, Model, Request, Sampler, SamplingParams, Worker
from engine import worker as worker_module
from engine.grammar import from_gbnf, tokenizer_for
from scheduler import FinishReason
from tests.devices import TEST_GPU_LAYERS
from tests.engine_helpers import idle
from tests.server_proc import SMOLLM2

BROKEN_AT_ADMISSION = "<admission fails>"
BROKEN_AT_SAMPLING = "<sampling fails>"
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Rain falls when"]


class InjectedFault(RuntimeError):
    pass


class FaultySampler(worker_module.Sampler):
    """A sampler that fails for requests marked by a stop string: when it is made (admission),
    or at its third token (sampling)."""

    def __init__(self, params: SamplingParams, *args, **kwargs):
        if BROKEN_AT_ADMISSION in params.stop:
            raise InjectedFault("injected at admission")
        super().__init__(params, *args, **kwargs)
        self.calls = 0

    def sample(self, context, batch_index):
        self.calls += 1
        if BROKEN_AT_SAMPLING in self.params.stop and self.calls == 3:
            raise InjectedFault("injected at sampling")
        return super().sample(context, batch_index)


@pytest.fixture(scope="module")
def model():
    m = Model(SMOLLM2, n_gpu_layers=TEST_GPU_LAYERS)
    yield m
    m.close()


@pytest.fixture()
def worker(model, monkeypatch):
    monkeypatch.setattr(worker_module, "Sampler", FaultySampler)
    w = Worker("faults", model, EngineConfig(n_ctx=256, max_seqs=6, cache_seqs=2,
                                             max_batch_tokens=128, prefill_chunk=16))
    w.start()
    yield w
    w.stop()


async def run(worker, prompt, stop=(), **params):
    """(the request's text, its last event)."""
    req = Request(prompt, SamplingParams(**{"max_tokens": 12, "temperature": 0, **params},
                                         stop=list(stop)))
    queue = worker.submit(req)
    text = ""
    while True:
        event = await asyncio.wait_for(queue.get(), timeout=60)
        text += event.text
        if event.finish_reason:
            return text, event


def together(worker, jobs):
    """Run (prompt, stop strings, sampling params) jobs at once: their (text, last event)."""
    async def main():
        return await asyncio.gather(*[run(worker, p, s, **kw) for p, s, kw in jobs])
    return asyncio.run(main())


def alone(worker, model):
    return [together(worker, [(p, (), {})])[0][0] for p in prompts(model)]


def assert_nothing_held(worker):
    idle(worker)
    assert worker.outstanding == 0
    assert worker.manager.num_used_blocks == 0 and not worker.manager.live
    assert not worker.scheduler.running and not worker.scheduler.waiting
    assert worker.failed is None
    worker.manager.check_invariants()


def prompts(model):
    return [model.tokenize(p) for p in PROMPTS]


@pytest.mark.parametrize("marker,at,position", [(BROKEN_AT_ADMISSION, "admission", 2),
                                                 (BROKEN_AT_SAMPLING, "sampling", 1)])
def test_a_request_that_fails_ends_alone_and_the_others_finish(model, worker, marker, at,
                                                              position):
    answers = alone(worker, model)
    jobs = [(p, (), {}) for p in prompts(model)]
    jobs.insert(position, (prompts(model)[position], [marker], {}))
    results = together(worker, jobs)
    text, event = results.pop(position)
    assert event.finish_reason is FinishReason.ERROR and event.error_kind is ErrorKind.ENGINE
    assert f"injected at {at}" in event.error
    assert answers[position].startswith(text)     # what it had sent before was its answer
    assert bool(text) == (at == "sampling")       # (it fails at its third token)
    assert [text for text, _ in results] == answers
    assert all(event.finish_reason is FinishReason.LENGTH for _, event in results)
    assert_nothing_held(worker)


def test_one_failing_choice_of_n_ends_alone(model, worker):
    """Forks sample with their own samplers: the one that fails ends, its siblings go on."""
    prompt = prompts(model)[0]

    async def main():
        req = Request(prompt, SamplingParams(max_tokens=8, temperature=0))
        req.forks = [Request(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                    stop=[BROKEN_AT_SAMPLING]), index=1)]
        queue = worker.submit(req)
        last = {}
        while len(last) < 2:
            event = await asyncio.wait_for(queue.get(), timeout=60)
            if event.finish_reason:
                last[event.index] = event
        return last
    last = asyncio.run(main())
    assert last[0].finish_reason is FinishReason.LENGTH and last[0].error is None
    assert last[1].finish_reason is FinishReason.ERROR and "injected" in last[1].error
    assert_nothing_held(worker)


def test_a_sampling_parameter_the_engine_refuses_is_an_invalid_request(model, worker):
    """A seed out of the generator's range (the server maps every integer into it first) is
    refused at admission as the request's own fault: a 400 upstream, not a 500."""
    (_, event), = together(worker, [(prompts(model)[0], (), {"seed": -5, "temperature": 1.0})])
    assert event.finish_reason is FinishReason.ERROR and event.error_kind is ErrorKind.INVALID
    assert_nothing_held(worker)


def test_cancelling_a_request_that_failed_at_admission_is_safe(model, worker):
    prompt = prompts(model)[0]

    async def main():
        req = Request(prompt, SamplingParams(max_tokens=4, stop=[BROKEN_AT_ADMISSION]))
        queue = worker.submit(req)
        event = await asyncio.wait_for(queue.get(), timeout=60)
        worker.cancel(req)              # the client leaves after its error: nothing to free
        return event
    event = asyncio.run(main())
    assert event.finish_reason is FinishReason.ERROR
    assert together(worker, [(prompt, (), {})])[0][1].finish_reason is FinishReason.LENGTH
    assert_nothing_held(worker)


def test_a_penalty_that_turns_masked_logits_into_nan_still_keeps_to_the_grammar(model):
    """A repetition penalty of 0 makes llama.cpp's chain compute -inf * 0 = NaN for the tokens
    the grammar masked; the sampler then takes the best allowed token instead of a refused one."""
    grammar = from_gbnf('root ::= "yes" | "no"')
    params = SamplingParams(temperature=0, repetition_penalty=0.0, grammar=grammar)
    sampler = Sampler(params, model.n_vocab, tokenizer_for(model))
    allowed = np.flatnonzero(sampler.grammar.allowed())
    refused = [t for t in range(100, 140) if t not in allowed]
    logits = np.full(model.n_vocab, -5.0, dtype=np.float32)
    logits[refused] = 10.0                       # the unconstrained choice is refused
    logits[allowed] = np.linspace(0.0, 1.0, len(allowed))
    sampler.accept_history(refused)              # ...and in the penalty's history
    try:
        token = sampler._sample_constrained(logits.copy())
    finally:
        sampler.close()
    assert token == allowed[-1]
