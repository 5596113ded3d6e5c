"""The engine with a real llama.cpp context: KV bookkeeping agrees with llama.cpp, and prefix
caching and preemption never change a greedy answer."""
import asyncio
import random

import pytest

from engine import EngineConfig, Model, Request, SamplingParams, Worker
from engine.llama_tricks import Attention
from engine.worker import Observer
from scheduler.sequence import BACKGROUND
from tests.devices import ON_GPU, TEST_GPU_LAYERS, cpu_exact
from tests.engine_helpers import (
    assert_books_match_kv,
    computes_on_a_thread_of_its_own,
    idle,
    kv_positions,
)
from tests.server_proc import GEMMA3, SMOLLM2

SYSTEM = ("You are a meticulous assistant. Answer briefly, cite facts, avoid speculation, and "
          "prefer plain words. ") * 6


@pytest.fixture(scope="module")
def model():
    m = Model(SMOLLM2, n_gpu_layers=TEST_GPU_LAYERS)
    yield m
    m.close()


def make_worker(model, observer=None, **overrides):
    cfg = dict(n_ctx=1024, max_seqs=8, cache_seqs=8, max_batch_tokens=128, prefill_chunk=32)
    cfg.update(overrides)
    worker = Worker("test", model, EngineConfig(**cfg), observer=observer)
    worker.start()
    return worker


async def generate(worker, prompt, max_tokens=24, priority=0, cancel_after=None, **params):
    req = Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                  priority)
    queue = worker.submit(req)
    parts, n = [], 0
    while True:
        event = await queue.get()
        parts.append(event.text)
        n += event.num_tokens
        if cancel_after is not None and n >= cancel_after:
            worker.cancel(req)
            return None
        if event.finish_reason:
            assert event.error is None, event.error
            return "".join(parts)


def run_all(worker, prompts, **kw):
    async def main():
        return await asyncio.gather(*[generate(worker, p, **kw) for p in prompts])
    return asyncio.run(main())


def chat_prompt(model, question, system=SYSTEM):
    return model.tokenize(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
                          f"{question}<|im_end|>\n<|im_start|>assistant\n", add_special=False)


QUESTIONS = ["What is rain?", "Name a planet.", "Why is the sky blue?", "What is a noun?",
             "Give a synonym for fast.", "How many legs has a spider?"]


@pytest.mark.parametrize("unified,cache_seqs", [(False, 4), (True, 4), (False, 0)])
def test_manager_view_agrees_with_llama_cpp_after_a_mixed_workload(model, unified, cache_seqs):
    worker = make_worker(model, kv_unified=unified, n_ctx=512, cache_seqs=cache_seqs)
    try:
        rng = random.Random(7)
        systems = [SYSTEM, "Be kind. " * 20, "Reply in one word. " * 12]

        async def main():
            jobs = []
            for _ in range(14):
                prompt = chat_prompt(model, rng.choice(QUESTIONS), rng.choice(systems))
                cancel = rng.choice([None, None, 3])
                jobs.append(generate(worker, prompt, max_tokens=rng.randint(4, 20),
                                     cancel_after=cancel))
            await asyncio.gather(*jobs)
        asyncio.run(main())
        idle(worker)
        assert assert_books_match_kv(worker), "nothing stayed cached"
    finally:
        worker.stop()


@cpu_exact
# cache_seqs 0 (the default): the idle streams hold the cache; 4 sequences for 6 prompts, so
# finished ones give their seq ids up to waiting ones
@pytest.mark.parametrize("cache_seqs,max_seqs", [(8, 8), (0, 4)])
def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off(model, cache_seqs, max_seqs):
    prompts = [chat_prompt(model, q) for q in QUESTIONS]
    answers = {}
    for caching in (False, True):
        worker = make_worker(model, prefix_caching=caching, cache_seqs=cache_seqs,
                             max_seqs=max_seqs)
        try:
            first = run_all(worker, prompts[:2])           # warms the cache when it is on
            rest = run_all(worker, prompts)                 # concurrent, sharing the system prompt
            again = [run_all(worker, [p])[0] for p in prompts[:3]]   # one by one, fully cached
            answers[caching] = (first, rest, again)
            if caching:
                assert worker.manager.hit_tokens > 0
        finally:
            worker.stop()
    assert answers[True] == answers[False]


@cpu_exact
def test_prefix_hits_that_end_off_the_prefill_grid_give_the_cold_answers(model):
    """A hit may end on any 8-token block, off the 32-token grid. Prompts that
    are prefixes of a cached one (every length from 33 to 50, so the rest after the hit is 2..9
    tokens and n % 32 runs through 1) must answer as they do with caching off."""
    long = chat_prompt(model, "Tell me about the moon, the sea and the tides, briefly.")
    prompts = [long[:n] for n in range(33, 51)]
    answers = {}
    for caching in (False, True):
        worker = make_worker(model, prefix_caching=caching, block_size=8)
        try:
            run_all(worker, [long], max_tokens=2)     # the cache holds all of it when on
            answers[caching] = [run_all(worker, [p], max_tokens=8)[0] for p in prompts]
            if caching:
                assert worker.manager.hit_tokens >= sum(len(p) - 9 for p in prompts)
        finally:
            worker.stop()
    assert answers[True] == answers[False]


@cpu_exact
@pytest.mark.parametrize("flash_attn,kv_type,ds", [
    (True, "f16", range(26, 42)), (False, "f16", (29, 31, 32, 33, 39, 40, 41)),
    (True, "q8_0", (29, 31, 32, 33, 39, 40, 41))])
def test_prefix_hits_that_end_inside_a_block_give_the_cold_answers(model, flash_attn, kv_type,
                                                                    ds):
    """A hit may end on any token. A prompt that leaves a cached one at position d reuses
    exactly d tokens (the cells of the cached block that continues its last full block are
    copied too), less one where the rest would start with a 1-token piece before a grid line
    (d % 32 == 31), and answers as it does with caching off. With the default kernel (flash
    attention over an f16 cache) each d from 26 to 41 runs through a block's every offset and
    two block boundaries; with plain attention and with a q8_0 cache, offsets on both sides of
    the two boundaries and the 1-token case."""
    long = chat_prompt(model, "Tell me about the moon, the sea and the tides, and why the tides "
                              "come twice a day, briefly.")
    tail = model.tokenize(" Reply in one short sentence, please.", add_special=False)
    assert len(long) >= 50 and all(long[d] != tail[0] for d in range(26, 42))
    prompts = {d: long[:d] + tail for d in ds}
    answers, hits = {}, {}
    for caching in (False, True):
        worker = make_worker(model, prefix_caching=caching, block_size=8, flash_attn=flash_attn,
                             kv_type=kv_type)
        try:
            answers[caching] = {}
            for d, p in prompts.items():
                if caching:   # (again each time: the least recently used blocks go)
                    run_all(worker, [long], max_tokens=2)
                before = worker.manager.hit_tokens
                answers[caching][d] = run_all(worker, [p], max_tokens=8)[0]
                hits[d] = worker.manager.hit_tokens - before
            idle(worker)
            worker.manager.check_invariants()
        finally:
            worker.stop()
    assert hits == {d: d - 1 if d % 32 == 31 else d for d in prompts}
    assert answers[True] == answers[False]


def test_a_shared_prefix_in_flight_is_computed_once(model):
    worker = make_worker(model, prefill_chunk=32)
    try:
        prompts = [chat_prompt(model, q) for q in QUESTIONS[:4]]
        run_all(worker, prompts, max_tokens=2)
        shared = len(prompts[0]) - 40
        # all but the first request took (most of) the shared system prompt from the cache
        assert worker.manager.hit_tokens >= 3 * (shared // 32) * 32
    finally:
        worker.stop()


def test_a_swapped_greedy_request_finishes_with_its_unpreempted_output(model):
    for mode in ("swap", "recompute"):
        worker = make_worker(model, scheduler="priority", max_seqs=1, preemption=mode,
                             prefix_caching=False)
        try:
            bulk_prompt = chat_prompt(model, "Write a long story about a dragon.")
            alone = run_all(worker, [bulk_prompt], max_tokens=48)[0]

            async def main():
                bulk = asyncio.ensure_future(generate(worker, bulk_prompt, max_tokens=48,
                                                      priority=10))
                while worker.scheduler.running == [] or worker.scheduler.running[0].num_output < 8:
                    await asyncio.sleep(0.01)
                vip = await generate(worker, chat_prompt(model, "Hi"), max_tokens=8, priority=0)
                return await bulk, vip
            preempted, vip = asyncio.run(main())
            assert worker.scheduler.num_preemptions >= 1 and vip
            if mode == "swap":
                assert preempted == alone
            else:   # generated tokens recomputed as a chunk: the continuation may differ (docs/prefix-cache.md)
                head = model.detokenize(model.tokenize(alone, add_special=False)[:8])
                assert preempted.startswith(head) and len(preempted) > len(head)
        finally:
            worker.stop()


class BackgroundStops(Observer):
    """Each background step stopped: whether its decode was cut, and per piece its start and
    end, its sequence's computed tokens and the positions llama.cpp's KV holds for it, read on
    the worker thread right after the engine removed the stopped pieces (before anything else
    runs)."""

    def __init__(self):
        self.seen: list[tuple[bool, list[tuple[int, int, int, list[int]]]]] = []

    def on_background_stop(self, worker, chunks, cut):
        self.seen.append((cut, [(c.start, c.end, c.seq.num_computed,
                                 kv_positions(worker.context, c.seq.seq_id)) for c in chunks]))


# the cut is a CPU fact (llama.cpp's CPU backend calls the abort callback; on a GPU background
# steps are only kept short), and the answers compared are exact on the CPU only
@cpu_exact
@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_a_clients_request_cuts_a_background_decode_and_changes_no_answer(model, unified):
    """A step of background work alone (a batch line) is cut inside llama_decode when a
    client's request arrives: the decode returns 2, the cut piece's cells leave the KV cache
    while the line's earlier steps stay, and the piece is computed again later. The line and
    the chats end with the answers they get alone, and, with prefix caching on (the chats take
    the system prompt from the line's cells), the books agree with llama.cpp cell by cell.

    The line's prompt (~700 tokens) is computed in steps of 256 tokens (nobody decodes, so a
    step takes the whole budget; ~0.5-1 s each on 2 cores); the first chat is sent 50 ms after
    the line's first step ended, so it arrives during the second step's decode. A cut call here
    is one micro-batch (one line), so the cells found gone at the cut are the ones llama.cpp
    removed itself."""
    text = " ".join(f"{QUESTIONS[i % 6]} {SYSTEM}" for i in range(3))
    line_prompt = chat_prompt(model, "Summarize this: " + text)[:700]
    chats = [chat_prompt(model, q) for q in QUESTIONS[:4]]
    stops = BackgroundStops()
    worker = make_worker(model, observer=stops, kv_unified=unified, max_batch_tokens=256)
    try:
        async def main():
            line = asyncio.ensure_future(generate(worker, line_prompt, max_tokens=24,
                                                  priority=BACKGROUND))
            answers = []
            for prompt in chats:   # until one arrives during a background decode
                computed = {s.num_computed for s in worker.scheduler.running}
                while {s.num_computed for s in worker.scheduler.running} in (computed, {0}):
                    await asyncio.sleep(0.002)   # a background step just ended: the next runs
                await asyncio.sleep(0.05)
                answers.append(await generate(worker, prompt, max_tokens=6))
                if worker.times.cut_steps:
                    break
            return await line, answers
        line, answers = asyncio.run(main())
        idle(worker)
        assert_books_match_kv(worker)
        assert worker.manager.hit_tokens > 0   # a chat's system prompt from the line's cells
    finally:
        worker.stop()
    cuts = [pieces for cut, pieces in stops.seen if cut]
    assert worker.times.cut_steps == len(cuts) >= 1, stops.seen
    for pieces in cuts:
        for start, end, computed, positions in pieces:
            # the piece was not counted, and the KV holds the line's earlier steps, not it
            assert 0 < start == computed < end, (start, end, computed)
            assert positions == list(range(computed)), (computed, positions[-1:])

    alone = make_worker(model, kv_unified=unified, prefix_caching=False)
    try:
        line_alone = run_all(alone, [line_prompt], max_tokens=24, priority=BACKGROUND)[0]
        chats_alone = run_all(alone, chats[:len(answers)], max_tokens=6)
    finally:
        alone.stop()
    assert line == line_alone and answers == chats_alone


@cpu_exact
def test_prompts_prefilled_next_to_running_streams_get_their_solo_answers(model):
    """With split KV llama.cpp computes a batch in micro-batches that take the same number of
    tokens from each sequence; prompts prefilled while other streams decode must still get the
    answers they get alone. Two arrive together, so the first takes both their cells in one
    piece of several cells (Scheduler: prompt tokens in policy order). (Measured: a 16-token
    chunk computed as 1 + 15 tokens happens to give the same logits, so this guards the
    answers, not the micro-batch shape; the grouping test below checks the shape.)"""
    prompts = [chat_prompt(model, "Describe a lighthouse at night."),
               chat_prompt(model, "Name three rivers in Europe and where they flow.")]
    for caching in (False, True):
        worker = make_worker(model, prefix_caching=caching, prefill_chunk=16)
        try:
            alone = [run_all(worker, [p], max_tokens=32)[0] for p in prompts]
            idle(worker)

            async def main():
                streams = [asyncio.ensure_future(generate(worker, chat_prompt(model, q, "Be brief."),
                                                          max_tokens=400, ignore_eos=True))
                           for q in QUESTIONS]
                while sum(s.num_output > 0 for s in worker.scheduler.running) < len(QUESTIONS):
                    await asyncio.sleep(0.01)
                busy = await asyncio.gather(*(generate(worker, p, max_tokens=32)
                                              for p in prompts))
                assert all(not s.done() for s in streams), "the streams ran out too early"
                for s in list(worker.scheduler.running):
                    worker.cancel(s.owner)
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
                return list(busy)
            assert asyncio.run(main()) == alone, caching
        finally:
            worker.stop()


@cpu_exact
def test_a_wave_of_requests_is_computed_in_one_step_and_changes_no_answer(model):
    """wave_batch_tokens: prompts that arrive together (the worker waits for those still being
    prepared) are computed whole in one step, here ~840 tokens against a 128-token step budget,
    so 16 tokens each take 16 steps in all; and their greedy answers are the ones computed
    without waves (other pieces, other batches). (Without prefix caching: with it, the first
    computes the shared system prompt and the others their rest in the next step.)"""
    prompts = [chat_prompt(model, q) for q in QUESTIONS]
    answers, steps = {}, {}
    for wave in (0, 1024):
        worker = make_worker(model, wave_batch_tokens=wave, prefix_caching=False)
        pending = [len(prompts)]
        worker.gather.incoming = lambda: pending[0]   # as the service counts prompts being prepared
        try:
            async def main():
                async def one(p):
                    task = asyncio.ensure_future(generate(worker, p, max_tokens=16,
                                                          ignore_eos=True))
                    await asyncio.sleep(0)   # submitted
                    pending[0] -= 1
                    return await task
                tasks = []
                for p in prompts:
                    tasks.append(asyncio.ensure_future(one(p)))
                    await asyncio.sleep(0.01)   # arriving one by one, as over HTTP
                return await asyncio.gather(*tasks)
            answers[wave] = asyncio.run(main())
            steps[wave] = worker.steps
        finally:
            worker.stop()
    assert steps[1024] == 16 < steps[0]
    assert answers[1024] == answers[0]


def test_split_kv_steps_are_grouped_into_whole_micro_batches(model):
    """Decode tokens go in one call in seq-id order (llama.cpp's split-KV micro-batches need
    consecutive ids), then each prompt-chunk length in its own call."""
    from types import SimpleNamespace as NS

    from engine.batch_shape import call_groups
    worker = make_worker(model)
    try:
        chunks = [NS(seq=NS(seq_id=i), start=s, end=e)
                  for i, s, e in [(5, 9, 10), (2, 30, 31), (7, 0, 16), (3, 16, 32), (0, 4, 5),
                                  (6, 32, 37)]]
        groups = call_groups(chunks, worker.config.kv_unified)
        assert [[c.seq.seq_id for c in g] for g in groups] == [[0, 2, 5], [6], [3, 7]]
    finally:
        worker.stop()


def test_greedy_answers_do_not_depend_on_the_thread_count(model):
    """The thread governor changes a context's threads between decodes, so an answer must not
    depend on how many threads computed it (ggml splits each op's rows between threads; a row
    is always computed whole by one thread). Solo and batched, 1 and 2 threads, and a switch
    to 1 thread while the streams run."""
    prompts = [chat_prompt(model, q) for q in QUESTIONS[:4]]
    answers = {}
    for threads in (1, 2):
        worker = make_worker(model, n_threads=threads, adaptive_threads=False)
        try:
            answers[threads] = (run_all(worker, prompts[:1], max_tokens=32),
                                run_all(worker, prompts, max_tokens=32))
        finally:
            worker.stop()
    assert answers[1] == answers[2]
    worker = make_worker(model, n_threads=2, adaptive_threads=False)
    try:
        async def main():
            jobs = [asyncio.ensure_future(generate(worker, p, max_tokens=32)) for p in prompts]
            while worker.steps < 12:
                await asyncio.sleep(0.005)
            worker.context.set_threads(1)   # what the governor does, mid-stream
            return await asyncio.gather(*jobs)
        assert asyncio.run(main()) == answers[2][1]
    finally:
        worker.stop()


def test_a_worker_reports_its_thread_count_and_step_times(model):
    worker = make_worker(model, n_threads=2)
    try:
        run_all(worker, [chat_prompt(model, QUESTIONS[0])], max_tokens=8)
        snap = worker.snapshot()
        assert snap.threads in (1, 2) and snap.configured_threads == 2
        times = snap.step_ms
        assert times["steps"] >= 8 and times["decode_calls_per_step"] >= 1
        # one sequence: each call is one micro-batch
        assert times["micro_batches_per_step"] == times["decode_calls_per_step"]
        assert times["decode_s"] > 0 and times["plan_s"] > 0
    finally:
        worker.stop()


# text, not random token ids: measured, ggml's repacked 4-row kernel changed these prompts' next
# logits, and those of random ids not at all
SIXTEEN_TEXTS = (
    "Once upon a time there was a farmer who", "The capital of France is a city that",
    "def fibonacci(n):", "In 1905 Albert Einstein published", "My favourite recipe is",
    "The stock market today", "Rain fell on the", "A good book is",
    "Mountains rise above", "The recipe calls for", "Computers are", "In the year 2000",
    "My dog likes", "The ocean is", "Music makes", "Winter is coming and")


def next_logits_of_first(ctx, prompts, seqs):
    """Decode one token after each of these sequences' prompts in one batch; the first one's
    logits (a copy), then the token is removed again."""
    assert ctx.decode([(s, [777], len(prompts[s]), True) for s in seqs]) == 0
    out = ctx.logits(0).copy()
    for s in seqs:
        ctx.seq_rm(s, len(prompts[s]), -1)
    return out


@cpu_exact
@pytest.mark.parametrize("flash_attn", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2-q4_1", "gemma3-q4_k_m"])
@computes_on_a_thread_of_its_own
def test_logits_do_not_depend_on_how_many_sequences_decode_beside(path, flash_attn):
    """Bitwise the same logits for a sequence decoded alone and beside 1 to 15 others. 4 rows:
    llama.cpp's repacked weight layouts switch from a row-by-row kernel to a 4-row one there,
    which changed Gemma 3's greedy answers (engine.Model loads without repacking). 8 rows:
    ggml's tiled matmul takes Gemma's K-quant weights there, and with flash attention on
    ggml's default path Gemma's logits moved by 1.1 from 8 rows up (measured; the row-invariant
    path keeps them, with that matmul on). Gemma's Q4_K, Q6_K, Q5_0 and Q8_0 tensors cover the
    kernels its layers use; both attention kernels."""
    import numpy as np

    from engine.llama import Context, ContextConfig
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make models`")
    m = Model(path, n_gpu_layers=TEST_GPU_LAYERS)
    assert m.has_k_quants == (path == GEMMA3)
    ctx = Context(m, ContextConfig(n_ctx=256 * 16, n_seq_max=16, n_batch=256, n_threads=2,
                                   kv_unified=False, flash_attn=flash_attn))
    try:
        # text, not random token ids: measured, repacking changed the logits of these prompts'
        # next token by up to 1.1 from 4 rows up, and of random ids not at all
        prompts = [m.tokenize(t) for t in SIXTEEN_TEXTS]
        for seq, toks in enumerate(prompts):
            assert ctx.decode([(seq, toks, 0, False)]) == 0

        alone = next_logits_of_first(ctx, prompts, [0])
        for k in (2, 4, 6, 8, 16):
            assert np.array_equal(alone, next_logits_of_first(ctx, prompts, list(range(k)))), \
                f"beside {k - 1} others"
    finally:
        ctx.close()
        m.close()


@pytest.mark.parametrize("flash_attn,kv_type,path", [
    (False, "f16", None), (True, "f16", Attention.ROW_INVARIANT), (True, "f16", Attention.REFERENCE),
    (True, "q8_0", Attention.ROW_INVARIANT), (True, "f16", Attention.GGML_DEFAULT)],
    ids=["plain", "flash-f16-row-invariant", "flash-f16-reference", "flash-q8_0",
         "flash-f16-ggml-default"])
@cpu_exact
@computes_on_a_thread_of_its_own
def test_logits_do_not_depend_on_the_batch_or_the_thread_count(model, flash_attn, kv_type, path):
    """A sequence's logits must be bitwise the same decoded alone, beside other sequences, and
    with 1 or 2 threads, also past 512 tokens of context. Flash attention is exact on the
    row-invariant path (the build's patch: the tiled kernel for every batch) and on ggml's
    reference path (row by row); the last case takes ggml's default to show why: it splits one
    lone query row's KV range between the threads from 512 KV cells on (llama.cpp pads a
    sequence's KV view to 256), so a sequence decoding alone past ~256 tokens gets other logits
    than beside others or on another thread count (measured: up to 0.47 in a logit, 2 of 6
    greedy chat answers changed). If that case fails after a llama.cpp upgrade, ggml changed its
    kernel: rethink the exact paths."""
    import numpy as np

    from engine.llama import Context, ContextConfig
    ctx = Context(model, ContextConfig(n_ctx=1024 * 3, n_seq_max=3, n_batch=64, n_threads=2,
                                       kv_unified=False, flash_attn=flash_attn, kv_type=kv_type))
    try:
        if path is not None:
            ctx.use_attention(path)
        rng = random.Random(3)
        prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (600, 40, 200)]
        for seq, toks in enumerate(prompts):
            for s in range(0, len(toks), 16):
                assert ctx.decode([(seq, toks[s:s + 16], s, False)]) == 0

        def logits_of_0(seqs, threads=2):
            ctx.set_threads(threads)
            return next_logits_of_first(ctx, prompts, seqs)
        alone = logits_of_0([0])
        different = [case for case, logits in [
            ("beside 1", logits_of_0([0, 1])), ("beside 2", logits_of_0([0, 1, 2])),
            ("1 thread", logits_of_0([0], threads=1))] if not np.array_equal(alone, logits)]
        exact = path is not Attention.GGML_DEFAULT
        assert different == ([] if exact else ["beside 1", "beside 2", "1 thread"])
    finally:
        ctx.close()


SHAPE_1B = GEMMA3.parent / "shapes" / "llama-3.2-1b-Q4_K_M.gguf"   # make shapes


def sixteen_prompts_decoded(path, repack: bool, flash_attn: bool, prefilled: int = 16):
    """A 16-sequence context on `path` with the backend's row-invariant switch on, and the
    first `prefilled` of SIXTEEN_TEXTS decoded as prompts: (model, context, their tokens)."""
    from engine.llama import Context, ContextConfig
    m = Model(path, n_gpu_layers=TEST_GPU_LAYERS, repack=repack)
    ctx = Context(m, ContextConfig(n_ctx=256 * 16, n_seq_max=16, n_batch=256, n_threads=2,
                                   kv_unified=False, flash_attn=flash_attn))
    assert ctx.cpu_backend is not None   # the switch is on, flash attention or not
    prompts = [m.tokenize(t) for t in SIXTEEN_TEXTS]
    for seq, toks in enumerate(prompts[:prefilled]):
        assert ctx.decode([(seq, toks, 0, False)]) == 0
    return m, ctx, prompts


def logits_on_threads(ctx, prompts, seqs, threads: int):
    ctx.set_threads(threads)
    return next_logits_of_first(ctx, prompts, seqs)


@cpu_exact
@pytest.mark.parametrize("flash_attn", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("path", [GEMMA3, pytest.param(SHAPE_1B, marks=pytest.mark.skipif(
    not SHAPE_1B.exists(), reason="no 1B-shaped model: run `make shapes`"))],
    ids=["gemma3-q4_k_m", "llama-3.2-1b-shape"])
@computes_on_a_thread_of_its_own
def test_repacked_weights_give_a_row_the_same_numbers_whatever_the_batch(path, flash_attn):
    """Weights in llama.cpp's repacked layouts (PAGEDLLAMA_REPACK_WEIGHTS=1), multiplied by the
    build's patch (scripts/patches/ggml-cpu-repack-row-invariant.patch) with the one-row kernel
    for every row: a sequence's next logits are bitwise the same alone, beside 1, 3, 5 (and 15:
    Gemma) others, and on 1 and 2 threads. With the switch off, ggml's own rule (a 4-row kernel
    from 4 rows up) changes the 1B shape's beside 3 or 5: what the patch is for."""
    import numpy as np

    from engine.llama_tricks import has_row_invariant_repack
    assert has_row_invariant_repack(), "llama.cpp was built without the repack patch"
    m, ctx, prompts = sixteen_prompts_decoded(path, repack=True, flash_attn=flash_attn)
    try:
        def logits(seqs, threads=2):
            return logits_on_threads(ctx, prompts, seqs, threads)
        alone = logits([0])
        # from 8 rows the 1B shape's Q6_K tensors (not repacked) take ggml's tiled matmul,
        # kept exact by the tiled patch (test_a_1b_shape_row_gets_the_same_numbers_whatever_the_batch)
        cases = {f"beside {k - 1}": logits(list(range(k))) for k in (2, 4, 6, 16)}
        cases["1 thread"] = logits([0], threads=1)
        assert [k for k, v in cases.items() if not np.array_equal(alone, v)] == []

        if path == SHAPE_1B:   # on AVX2, Gemma's Q4_K gives the same numbers either way
            ctx.use_attention(Attention.GGML_DEFAULT)   # the switch off: ggml's own kernels
            changed = [k for k in (4, 6) if not np.array_equal(logits([0]), logits(list(range(k))))]
            assert changed, "ggml's 4-row kernel gave the same numbers: is repacking on?"
    finally:
        ctx.close()
        m.close()


@cpu_exact
@pytest.mark.skipif(not SHAPE_1B.exists(), reason="no 1B-shaped model: run `make shapes`")
@pytest.mark.parametrize("repack,flash_attn", [(False, True), (False, False), (True, True)],
                         ids=["plain-flash", "plain-no-flash", "repacked-flash"])
@computes_on_a_thread_of_its_own
def test_a_1b_shape_row_gets_the_same_numbers_whatever_the_batch(repack, flash_attn):
    """At the 1B shape most matrices are Q4_K and Q6_K of widths ggml's tiled K-quant matmul
    takes, from 8 rows of input up, with vec_dot below: two roundings, so a sequence's logits
    changed beside 7 or more others (the small models' tensors hardly take that path). Under
    the row-invariant switch the build's patch (scripts/patches/ggml-cpu-tiled-row-invariant.patch)
    sends every batch through the tiles, fewer than 8 rows through kernels that round as they
    do: bitwise the same logits alone, beside 1, 3, 5, 7 and 15 others, on 1 and 2 threads,
    and for a copy of the sequence's KV (the prefix cache's way of sharing a prompt), flash
    attention on or off, weights plain or repacked. With the switch off, ggml's own rule
    changes them beside 7: what the patch is for."""
    import numpy as np

    from engine.llama_tricks import has_row_invariant_tiled
    assert has_row_invariant_tiled(), "llama.cpp was built without the tiled-matmul patch"
    m, ctx, prompts = sixteen_prompts_decoded(SHAPE_1B, repack, flash_attn, prefilled=15)
    try:
        prompts[15] = prompts[0]
        ctx.seq_cp(0, 15, -1, -1)   # sequence 15 gets a copy of sequence 0's prompt

        def logits(seqs, threads=2):
            return logits_on_threads(ctx, prompts, seqs, threads)
        alone = logits([0])
        cases = {f"beside {k - 1}": logits(list(range(k))) for k in (2, 4, 6, 8, 16)}
        cases["1 thread"] = logits([0], threads=1)
        cases["beside 7, 1 thread"] = logits(list(range(8)), threads=1)
        cases["the KV copy"] = logits([15])
        assert [k for k, v in cases.items() if not np.array_equal(alone, v)] == []

        if flash_attn and not repack:
            ctx.use_attention(Attention.GGML_DEFAULT)   # the switch off: ggml's own kernels
            assert not np.array_equal(logits([0]), logits(list(range(8)))), \
                "ggml's own rule gave the same numbers beside 7: is the 1B shape K-quant?"
    finally:
        ctx.close()
        m.close()


def test_flash_attention_runs_on_the_row_invariant_path(model):
    """The build's patch (scripts/patches/ggml-cpu-fa-row-invariant.patch, applied by make
    setup) is there and a flash-attention context uses it: without it, flash attention falls
    back to ggml's reference path, exact but slow on long prompts."""
    from engine.llama import Context, ContextConfig
    from engine.llama_tricks import has_row_invariant_attention
    assert has_row_invariant_attention(), "llama.cpp was built without the row-invariant patch"
    ctx = Context(model, ContextConfig(n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1,
                                       flash_attn=True))
    try:
        assert ctx.attention is Attention.ROW_INVARIANT
    finally:
        ctx.close()


def test_each_context_finds_its_own_cpu_backend(model):
    """engine.llama_tricks.cpu_backend_of reads a context object's words to find its CPU backend
    (llama.h has no getter): two flash-attention contexts claim two different backends, a
    closed one gives its back, and memory full of words that point nowhere (unmapped
    addresses, odd ones, null) finds nothing and does not crash."""
    import ctypes

    from engine.llama import Context, ContextConfig
    from engine.llama_tricks import _claimed_backends, cpu_backend_of
    config = ContextConfig(n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1, flash_attn=True)
    a, b = Context(model, config), Context(model, config)
    try:
        assert a.cpu_backend and b.cpu_backend and a.cpu_backend != b.cpu_backend
        assert {a.cpu_backend, b.cpu_backend} <= _claimed_backends
        junk = (ctypes.c_uint64 * 512)(*[8, 0x10, 0xdead0000, 7, 2 ** 63 + 8, 0] * 85, 0, 0)
        assert cpu_backend_of(ctypes.cast(junk, ctypes.c_void_p), scan_bytes=4096) is None
    finally:
        backend = a.cpu_backend
        a.close()
        b.close()
    assert backend not in _claimed_backends


# a stop is a CPU fact: llama.cpp's CPU backend calls the abort callback (Context.can_stop)
@pytest.mark.skipif(ON_GPU, reason="a decode on the GPU is not stopped part-way")
def test_a_stoppable_decodes_errors_are_quiet_only_when_it_was_stopped(model, caplog):
    """Stopping a decode makes llama.cpp log errors ("failed to compute graph"): only then are
    they DEBUG (engine/llama_tricks.py, log_level). A stoppable decode that fails on its own (a
    token id past the vocabulary), stop flag clear, logs its error as an ERROR, as a plain
    decode does."""
    import logging

    from engine.llama import Context, ContextConfig
    ctx = Context(model, ContextConfig(n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1))
    caplog.set_level(logging.DEBUG, logger="pagedllama.llama_cpp")
    tokens = model.tokenize("The lighthouse keeper climbed the ninety steps")

    def logged(stoppable: bool, toks: list[int]) -> tuple[int, dict[str, int]]:
        """llama_decode's status, and the level of each line llama.cpp logged that says a
        failure."""
        caplog.clear()
        status = ctx.decode([(0, toks, 0, True)], stoppable=stoppable)
        ctx.seq_rm(0, -1, -1)
        return status, {r.getMessage(): r.levelno for r in caplog.records
                        if r.name == "pagedllama.llama_cpp" and "fail" in r.getMessage()}

    try:
        assert ctx.can_stop
        ctx.request_stop()
        status, failures = logged(True, tokens)
        assert status == 2 and failures and set(failures.values()) == {logging.DEBUG}, failures
        ctx.clear_stop()
        assert logged(True, tokens) == (0, {})
        bad = tokens[:-1] + [model.n_vocab + 5]
        for stoppable in (True, False):
            status, failures = logged(stoppable, bad)
            assert status < 0 and logging.ERROR in failures.values(), (stoppable, failures)
    finally:
        ctx.close()


@cpu_exact
@computes_on_a_thread_of_its_own
def test_flash_attention_computes_every_cut_of_a_prompt_alike(model):
    """Why prefix hits may end on any token and the scheduler may merge prompt cells into one
    piece with flash attention too: a prompt computed in pieces of 2 or more tokens, however
    cut, gives bitwise the same logits, and so do the decode steps after it (the KV it wrote is
    the same), over an f16 and a q8_0 cache, on the row-invariant and the reference path. ggml's
    default kernel over f16 computes 64 or more query rows of one sequence in tiles and fewer
    row by row, other numbers (the last case); engine.Context keeps an exact path."""
    import numpy as np

    from engine.llama import Context, ContextConfig
    contexts = {name: Context(model, ContextConfig(n_ctx=512 * 2, n_seq_max=2, n_batch=256,
                                                   n_threads=2, kv_unified=False,
                                                   flash_attn=True, kv_type=kv))
                for name, kv in (("f16", "f16"), ("q8_0", "q8_0"), ("f16-reference", "f16"),
                                 ("f16-ggml-default", "f16"))}
    contexts["f16-reference"].use_attention(Attention.REFERENCE)
    contexts["f16-ggml-default"].use_attention(Attention.GGML_DEFAULT)
    rng = random.Random(5)
    toks = [rng.randrange(1000, 40000) for _ in range(161)]
    after = [rng.randrange(1000, 40000) for _ in range(3)]

    def run(sizes, ctx):
        ctx.seq_rm(0, -1, -1)
        pos, out, i = 0, [], 0
        while pos < len(toks) - 1:     # the last token alone, as a cold run of 161 tokens has it
            n = min(sizes[i % len(sizes)], len(toks) - 1 - pos)
            assert ctx.decode([(0, toks[pos:pos + n], pos, False)]) == 0
            pos, i = pos + n, i + 1
        for t in [toks[-1]] + after:
            assert ctx.decode([(0, [t], pos, True)]) == 0
            out.append(ctx.logits(0).copy())
            pos += 1
        return out
    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b))
    try:
        for name, ctx in contexts.items():
            ref = run([16], ctx)
            for sizes in ([8], [5, 11, 32, 48], [2, 3, 30, 63], [40]):
                assert same(ref, run(sizes, ctx)), (name, sizes)
            for sizes in ([64], [100, 2, 57]):
                assert same(ref, run(sizes, ctx)) == (name != "f16-ggml-default"), (name, sizes)
    finally:
        for ctx in contexts.values():
            ctx.close()
