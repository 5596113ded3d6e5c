"""Speculative decoding with a real model: greedy answers are the same with it on, off or
adaptive, alone and beside other streams; drafts are made, and the model accepts them, where an
answer copies its prompt, and the counters show it; every per-token feature
keeps working inside a verification (stop strings, max_tokens, grammars, logprobs, n > 1,
preemption, cancellation, usage); the KV books agree with llama.cpp after rollbacks; and where a
verification piece would compute other numbers than decoding (plain attention) speculation stays
off."""
import asyncio
import json
import time

import pytest

from engine import EngineConfig, Model, Request, SamplingParams, Worker
from engine.llama import Context, ContextConfig
from tests.devices import TEST_GPU_LAYERS, cpu_exact
from tests.engine_helpers import assert_books_match_kv, idle, on_a_thread_of_its_own
from tests.server_proc import SMOLLM2


@pytest.fixture(scope="module")
def model():
    m = Model(SMOLLM2, n_gpu_layers=TEST_GPU_LAYERS)
    yield m
    m.close()


def make_worker(model, speculative="ngram", policy="always", **overrides):
    cfg = dict(n_ctx=1024, max_seqs=8, cache_seqs=8, max_batch_tokens=256, prefill_chunk=16,
               speculative=speculative, spec_policy=policy, max_draft=6)
    cfg.update(overrides)
    worker = Worker("test", model, EngineConfig(**cfg))
    worker.start()
    return worker


def chat(model, text: str) -> list[int]:
    return model.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                          add_special=False)


# an answer that repeats its prompt: what drafts are for
PARAGRAPH = ("The old lighthouse stood at the end of the harbour wall. Every evening the keeper "
             "climbed its ninety steps, wound the clockwork that turned the lens, and lit the "
             "lamp before the fishing boats came home. In winter storms he stayed awake all "
             "night, watching the beam sweep across the dark water, and in the morning he wrote "
             "the weather, the ships he had seen and the hours the lamp had burned in a book "
             "that the harbour master read every Sunday.")
COPY = f"Copy this paragraph exactly, word for word:\n\n{PARAGRAPH}"


# answers that copy text of their prompts, one of each kind of the extractive set
# (benchmarks/data/extractive.jsonl: code, text and JSON edits, quoting answers), short: every
# worker reads its prompts again, at ~3 ms a token
CODE = ('''Here is a python file:

```python
def summarize_orders(orders, tax_rate):
    """Totals per customer, with tax, skipping cancelled orders."""
    totals = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer"]
        total = 0.0
        for item in order["items"]:
            total += item["price"] * item["quantity"]
        total += total * tax_rate
        totals[customer] = totals.get(customer, 0.0) + total
    return totals
```

'''
        "Rename the variable `total` to `running_total` everywhere. Return the function, "
        "complete, in a code block, with no explanation.")
TEXT = ("Paragraph to correct:\n"
        "Each step of a context's worker thread takes new and cancelled requests from its "
        "inbox, asks teh scheduler for a plan, applies its KV operations and runs teh batch "
        "through llama_decode. It then samples every sequnce that produced logits, right after "
        "its call, since the next decode overwrites them.\n\n"
        "Fix the spelling mistakes in the paragraph and return the whole corrected paragraph, "
        "unchanged otherwise, with nothing before or after it.")
CONFIG = ('''This is the configuration of the billing service:

```json
{
  "service": "billing",
  "version": "1.18.1",
  "listen": {"host": "0.0.0.0", "port": 8080, "tls": false},
  "database": {"driver": "sqlite", "host": "db-9.internal", "pool_size": 11},
  "workers": 6
}
```

'''
          "Edit it: set listen.port to 8443. Return the complete edited JSON in a code block "
          "and nothing else.")
QUOTE = ('Source:\n"""\n'
         "Each step of a context's worker thread takes new and cancelled requests from its "
         "inbox, asks the scheduler for a plan, applies its KV operations and runs the batch "
         "through llama_decode. It then samples every sequence that produced logits, right "
         "after its call, since the next decode overwrites them. Prompts are cut on a fixed "
         'grid of sixteen tokens.\n"""\n\n'
         "Question: Why does the worker sample right after each call?\n"
         "Answer by quoting, word for word, the sentences of the source that answer the "
         "question, each in double quotes, then say in one sentence what they mean.")


def extractive_prompts(model, n: int = 4) -> list[list[int]]:
    return [chat(model, text) for text in (CODE, TEXT, CONFIG, QUOTE)[:n]]


async def collect(worker, prompt, **params):
    """(text, token count, finish reason, logprobs, events) of one request."""
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 80)
    priority = params.pop("priority", 0)
    req = Request(list(prompt), SamplingParams(**params), priority=priority)
    queue = worker.submit(req)
    parts, n, logprobs, events = [], 0, [], 0
    while True:
        event = await queue.get()
        events += 1
        parts.append(event.text)
        n += event.num_tokens
        logprobs += event.logprobs or []
        if event.finish_reason:
            assert event.error is None, event.error
            return "".join(parts), n, str(event.finish_reason), logprobs, events, req


def run_all(worker, prompts, **params):
    async def main():
        return await asyncio.gather(*[collect(worker, p, **params) for p in prompts])
    return asyncio.run(main())


def answers(worker, prompts, concurrent=True, **params):
    if concurrent:
        return [r[:3] for r in run_all(worker, prompts, **params)]
    return [run_all(worker, [p], **params)[0][:3] for p in prompts]


@cpu_exact
def test_greedy_answers_are_the_same_with_speculation_on_off_and_adaptive(model):
    """Off, always (every draft verified whole: many piece lengths, rejections, rollbacks) and
    adaptive (the default policy, drafting where this machine's measured costs say it pays),
    each alone and with 4 streams at once: one set of answers."""
    prompts = extractive_prompts(model, 4)
    results, drafted = {}, {}
    for name, speculative, policy in (("off", "off", "adaptive"), ("always", "ngram", "always"),
                                      ("adaptive", "ngram", "adaptive")):
        worker = make_worker(model, speculative, policy)
        try:
            alone = answers(worker, prompts, concurrent=False, max_tokens=48)
            together = answers(worker, prompts, max_tokens=48)
            results[name] = (alone, together)
            counts = worker.speculation.counts
            drafted[name] = (counts.draft_tokens, counts.accepted_tokens)
            idle(worker)
            worker.manager.check_invariants()
        finally:
            worker.stop()
    assert results["always"] == results["off"]
    assert results["adaptive"] == results["off"]
    assert results["off"][0] == results["off"][1]       # alone and together, the same
    tokens, accepted = drafted["always"]
    assert drafted["off"] == (0, 0) and tokens > 100 and 0 < accepted < tokens
    # whether the adaptive policy drafts here depends on the costs this machine measures (on a
    # busy machine it may never pay): the decision itself is tested on recorded costs
    # (tests/unit/test_speculation_policy.py); here only its answers are
    tokens, accepted = drafted["adaptive"]
    assert 0 <= accepted <= tokens


@cpu_exact
def test_a_seeded_sampled_request_gives_the_same_answer_with_speculation_on_and_off(model):
    """Each position of a verification piece is one draw with the request's own generator, in
    order, as decoding one token at a time: drafts change no sampled answer either."""
    prompts = extractive_prompts(model, 4)
    outs = {}
    for speculative in ("off", "ngram"):
        worker = make_worker(model, speculative)
        try:
            outs[speculative] = answers(worker, prompts, temperature=0.7, seed=11, top_k=40,
                                        max_tokens=48)
            if speculative == "ngram":   # drafts verified, some accepted, while sampling
                assert worker.speculation.counts.accepted_tokens > 0
        finally:
            worker.stop()
    assert outs["ngram"] == outs["off"]


@cpu_exact
def test_stop_strings_max_tokens_logprobs_and_grammars_inside_verification(model):
    """Every per-token feature gives what it gives without speculation: a stop string that
    ends inside a verified draft, max_tokens reached inside one, logprobs of every accepted
    token, and a JSON schema whose grammar cuts drafts and masks tokens."""
    prompts = extractive_prompts(model, 4)
    schema = {"type": "object", "properties": {"service": {"type": "string"},
                                               "workers": {"type": "integer"}},
              "required": ["service", "workers"]}
    from engine.grammar import from_json_schema
    cases = [dict(stop=["total", "\n\n"], max_tokens=60), dict(max_tokens=7),
             dict(max_tokens=40, logprobs=3),
             dict(max_tokens=60, grammar=from_json_schema(schema))]
    outs = {}
    for speculative in ("off", "ngram"):
        worker = make_worker(model, speculative)
        try:
            outs[speculative] = []
            for case in cases:
                for r in run_all(worker, prompts, **case):
                    lps = [(lp.token, round(lp.logprob, 6), lp.top) for lp in r[3]]
                    outs[speculative].append((r[0], r[1], r[2], lps))
            if speculative == "ngram":
                assert worker.speculation.counts.accepted_tokens > 0
        finally:
            worker.stop()
    assert outs["ngram"] == outs["off"]
    assert all(o[0].startswith('{"service": ') for o in outs["ngram"][-4:])   # the grammar's
    logprob_answers = outs["ngram"][8:12]
    assert all(len(o[3]) == o[1] for o in logprob_answers)   # one per token


@cpu_exact
def test_n_choices_verify_drafts_each_on_their_own(model):
    prompts = extractive_prompts(model, 2)
    outs = {}
    for speculative in ("off", "ngram"):
        worker = make_worker(model, speculative)
        try:
            async def main(prompt):
                params = SamplingParams(max_tokens=50, temperature=0)
                req = Request(list(prompt), params)
                req.forks = [Request(list(prompt), params, index=i) for i in (1, 2)]
                queue = worker.submit(req)
                texts, done = ["", "", ""], 0
                while done < 3:
                    e = await queue.get()
                    assert e.error is None, e.error
                    texts[e.index] += e.text
                    done += bool(e.finish_reason)
                if speculative == "ngram":   # each choice accepted drafts of its own
                    assert all(r.num_accepted > 0 for r in req.group)
                return texts
            outs[speculative] = [asyncio.run(main(p)) for p in prompts]
            if speculative == "ngram":
                assert worker.speculation.counts.accepted_tokens > 0
        finally:
            worker.stop()
    assert outs["ngram"] == outs["off"]
    assert all(t[0] == t[1] == t[2] for t in outs["ngram"])


@cpu_exact
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_sequence_finishes_with_its_unpreempted_answer(model, mode):
    """A low-priority answer preempted by a high-priority request mid-way (its drafts dropped,
    its KV swapped to RAM or dropped and recomputed as a prompt) finishes with the answer it
    gives unpreempted, with speculation on and off. The bulk answer copies its prompt: with
    speculation it has accepted drafts before it is preempted and accepts more after."""
    bulk_prompt, vip_prompt = chat(model, COPY), chat(model, "Name three colours.")
    outs = {}
    for speculative in ("off", "ngram"):
        worker = make_worker(model, speculative, scheduler="priority", max_seqs=1,
                             preemption=mode, prefix_caching=False)
        try:
            if speculative == "off":   # the unpreempted answer (the same with "ngram": below)
                alone = run_all(worker, [bulk_prompt], max_tokens=64)[0][:3]

            async def main():
                bulk = asyncio.ensure_future(collect(worker, bulk_prompt, max_tokens=64,
                                                     priority=10))
                deadline = time.monotonic() + 60
                while not worker.scheduler.running or worker.scheduler.running[0].num_output < 12:
                    assert not bulk.done() and time.monotonic() < deadline, "bulk never ran"
                    await asyncio.sleep(0.002)
                accepted = worker.scheduler.running[0].owner.num_accepted
                vip = await collect(worker, vip_prompt, max_tokens=8, priority=0)
                bulk = await bulk
                return bulk[:3], vip[:3], accepted, bulk[-1].num_accepted
            preempted, vip, accepted_before, accepted = asyncio.run(main())
            assert worker.scheduler.num_preemptions >= 1
            if speculative == "ngram":
                assert 0 < accepted_before < accepted
            outs[speculative] = (preempted, vip)
        finally:
            worker.stop()
    assert outs["ngram"] == outs["off"]
    assert outs["ngram"][0] == alone


def test_the_default_policy_drafts_and_accepts_where_an_answer_copies_its_prompt(model):
    """The shipped settings (speculation on, the adaptive policy: drafts only where the
    measured step costs say they pay) draft for one stream that copies a paragraph, and the
    model accepts drafted tokens."""
    config = EngineConfig(n_ctx=1024, max_seqs=8, cache_seqs=8, max_batch_tokens=256,
                          prefill_chunk=16)
    assert config.speculative == "ngram" and config.spec_policy == "adaptive"
    worker = Worker("test", model, config)
    worker.start()
    try:
        *_, req = run_all(worker, [chat(model, COPY)], max_tokens=120)[0]
        counts = worker.speculation.counts
        assert req.num_accepted > 0 and req.num_drafted >= req.num_accepted
        assert (counts.draft_tokens, counts.accepted_tokens) == (req.num_drafted,
                                                                 req.num_accepted)
    finally:
        worker.stop()


def test_a_request_cancelled_while_it_verifies_drafts_frees_everything(model):
    worker = make_worker(model)
    try:
        async def main():
            req = Request(list(extractive_prompts(model, 1)[0]),
                          SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
            queue = worker.submit(req)
            while req.num_accepted < 5:
                await queue.get()
            worker.cancel(req)
            return req
        req = asyncio.run(main())
        idle(worker)
        assert req.finished and str(req.finish_reason) == "abort"
        assert_books_match_kv(worker)
    finally:
        worker.stop()


def test_usage_counts_every_token_and_events_carry_several(model):
    """A step that accepts drafted tokens hands them over as one event (one SSE chunk) whose
    token count is theirs; the counts add up to the answer's tokens."""
    worker = make_worker(model)
    try:
        prompt = extractive_prompts(model, 1)[0]
        text, n, reason, _, events, req = run_all(worker, [prompt], max_tokens=120)[0]
        assert n == req.num_output and req.num_accepted > 0 and events < n
        assert req.num_drafted >= req.num_accepted
    finally:
        worker.stop()


@pytest.mark.parametrize("unified", [False, True])
def test_manager_view_agrees_with_llama_cpp_after_rollbacks(model, unified):
    worker = make_worker(model, kv_unified=unified, n_ctx=1024, cache_seqs=4)
    try:
        run_all(worker, extractive_prompts(model, 4), max_tokens=60)
        idle(worker)
        counts = worker.speculation.counts
        assert counts.accepted_tokens < counts.draft_tokens   # rejections happened
        assert_books_match_kv(worker)
    finally:
        worker.stop()


@cpu_exact
@pytest.mark.parametrize("flash_attn,kv_type,exact", [
    (True, "f16", True), (True, "q8_0", True), (False, "f16", False)],
    ids=["flash-f16", "flash-q8_0", "plain"])
def test_a_verification_piece_computes_what_decoding_computes_except_with_plain_attention(
        model, flash_attn, kv_type, exact):
    """The fact speculation's exactness rests on, per attention kernel: a token inside a piece
    of 2, 3, 5 or 9 tokens gets bitwise the logits (and writes the KV) it gets decoded alone,
    with flash attention on its exact paths. With plain attention it does not (the Q·K products
    of 2+ query rows of a sequence go through llamafile's tinyBLAS), so a worker with plain
    attention keeps speculation off, and says so."""
    ctx = Context(model, ContextConfig(n_ctx=512, n_seq_max=1, n_batch=64, n_threads=2,
                                       kv_unified=False, flash_attn=flash_attn, kv_type=kv_type))
    try:
        assert on_a_thread_of_its_own(ctx.pieces_match_decoding) == exact
    finally:
        ctx.close()
    worker = make_worker(model, flash_attn=flash_attn, kv_type=kv_type)
    try:
        assert worker.speculative == exact
        assert worker.speculative_note.startswith("ngram" if exact else "off:")
    finally:
        worker.stop()


@cpu_exact
def test_the_probe_runs_once_per_model_file_and_kernel_and_is_kept_on_disk(model, monkeypatch,
                                                                             tmp_path):
    """A model loaded again, or a second context of it, does not decode the start-up probe
    again (it costs ~1.5-2 s for this model, more for larger ones); another KV type does. A
    process started later reads the answers from disk; an unreadable file is probed again."""
    from engine import speculation
    monkeypatch.setattr(speculation, "_probed", {})
    calls = []
    probe = Context.pieces_match_decoding

    def counted(self, *args, **kwargs):
        calls.append(self.config.kv_type)
        return probe(self, *args, **kwargs)
    monkeypatch.setattr(Context, "pieces_match_decoding", counted)

    def make(kv_type):   # drafts of 1 token: the probe's shortest form, one piece length
        return make_worker(model, flash_attn=True, kv_type=kv_type, max_draft=1,
                           probe_dir=str(tmp_path))
    for kv_type, probes in (("f16", 1), ("f16", 1), ("q8_0", 2)):
        worker = make(kv_type)
        try:
            assert worker.speculative and len(calls) == probes
        finally:
            worker.stop()
    assert calls == ["f16", "q8_0"]
    saved = json.loads((tmp_path / speculation.PROBE_FILE).read_text())
    assert sorted(saved.values()) == [True, True]
    for contents, probes in ((None, 2), ("{not json", 3)):   # a new process: from disk, once
        monkeypatch.setattr(speculation, "_probed", {})
        if contents is not None:
            (tmp_path / speculation.PROBE_FILE).write_text(contents)
        worker = make("f16")
        try:
            assert worker.speculative and len(calls) == probes
        finally:
            worker.stop()


def test_health_metrics_and_stats_show_speculation():
    """/health names the mode and the bound; with the default policy, an answer that copies its
    prompt moves /metrics' vLLM counters, whose values agree with /stats and with each other
    (a token accepted at position i was accepted at every position before it)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server_proc import SMOLLM2_NAME, running_server

    def counters(base):
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
            for s in family.samples:
                samples[(s.name, s.labels.get("position"))] = s.value
        p = "pagedllama:spec_decode_"
        return (samples[(p + "num_drafts_total", None)], samples[(p + "num_draft_tokens_total", None)],
                samples[(p + "num_accepted_tokens_total", None)],
                [samples[(p + "num_accepted_tokens_per_pos_total", str(i))] for i in range(6)])

    # the adaptive policy; make_worker's bound, whose probe answer this process has on disk (the
    # server does not probe again)
    env = {"PAGEDLLAMA_SPECULATIVE": "ngram", "PAGEDLLAMA_MAX_DRAFT": "6"}
    with running_server(env) as base:
        _, drafted_before, accepted_before, _ = counters(base)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": SMOLLM2_NAME, "max_tokens": 120, "temperature": 0,
            "messages": [{"role": "user", "content": COPY}]})
        assert r.status_code == 200, r.text
        health = httpx.get(f"{base}/health", timeout=10).json()["models"][SMOLLM2_NAME]
        assert health["speculative"] == "ngram" and health["max_draft"] == 6
        stats = httpx.get(f"{base}/stats", timeout=10).json()
        drafts, drafted, accepted, per_pos = counters(base)
    assert drafted > drafted_before and accepted > accepted_before
    assert drafted == stats["spec_draft_tokens"] and accepted == stats["spec_accepted_tokens"]
    assert 0 < accepted <= drafted <= 6 * drafts and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
