"""The shape llama.cpp computes a step's batch in, and the llama_decode calls the worker makes
for it (engine/worker.py): with split KV, micro-batches of consecutive seq ids that take the same
number of tokens from each sequence."""
from __future__ import annotations


def call_groups(chunks: list, unified: bool) -> list[list]:
    """The step's batch in the shape llama.cpp computes it. With split KV, llama.cpp cuts a
    batch into micro-batches of consecutive seq ids that take the same number of tokens from
    each sequence: decode tokens out of seq-id order become several micro-batches (each a
    graph computation of its own), and a 16-token prompt chunk next to decode
    tokens is computed as 1 + 15 tokens, off the prefill grid. So: one call for the one-token
    pieces in seq-id order, then one per chunk length, in seq-id order: every micro-batch is
    then what we asked for. A unified cache computes a batch whole: one call."""
    if unified:
        return [chunks]
    by_len: dict[int, list] = {}
    for c in chunks:
        by_len.setdefault(c.end - c.start, []).append(c)
    return [sorted(by_len[n], key=lambda c: c.seq.seq_id) for n in sorted(by_len)]

def micro_batches(group: list, unified: bool) -> int:
    """How many micro-batches llama.cpp cuts one call of call_groups into: one with a unified
    cache; with split KV one per run of consecutive seq ids (each group's pieces are of one
    length, in seq-id order)."""
    if unified:
        return 1
    ids = [c.seq.seq_id for c in group]
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))
