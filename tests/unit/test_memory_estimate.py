"""A model's memory from its GGUF header and settings (engine/memory.py), before loading: the
KV cache as llama.cpp allocates it for split and unified caches, sliding windows and q8_0; the
defaults' KV no larger than llama-server's for the same slots. What a load really takes is
checked against the estimate by tests/test_models_on_demand.py."""
import pytest

from engine import EngineConfig
from engine.memory import ContextShape, estimate, kv_bytes, read_shape
from tests.server_proc import GEMMA3, SMOLLM2

MiB = 2**20


def shape(n_ctx=2048, max_seqs=16, n_seq_max=16, unified=False, kv_type="f16", ubatch=2048):
    return ContextShape(n_ctx=n_ctx, max_seqs=max_seqs, n_seq_max=n_seq_max, kv_unified=unified,
                        kv_type=kv_type, flash_attn=True, n_ubatch=ubatch, n_outputs_max=256,
                        swap_tokens=n_ctx)


def test_smollm2_takes_22_5_kib_a_cell_and_the_defaults_reserve_llama_servers_16_slots():
    smol = read_shape(SMOLLM2)
    assert (smol.n_layer, smol.k_width[0], smol.v_width[0]) == (30, 192, 192)
    assert smol.kv_cell_bytes("f16") == 30 * 384 * 2 == 23040
    config = EngineConfig().resolved_for(type("M", (), {"on_gpu": False, "has_k_quants": False}))
    assert config.n_seq_max == config.max_seqs == 16     # no seq ids kept for the cache
    llama_server = 16 * 2048 * 23040                       # -np 16 -c 32768
    assert kv_bytes(smol, config.memory_shape()) == llama_server
    # the previous default: 16 running + 16 cache streams, twice over
    assert kv_bytes(smol, shape(n_seq_max=32)) == 2 * llama_server


def test_a_q8_0_cache_takes_17_32nds_of_f16():
    smol = read_shape(SMOLLM2)
    assert kv_bytes(smol, shape(kv_type="q8_0")) == kv_bytes(smol, shape()) * 17 // 32


def test_gemma3_keeps_window_plus_batch_cells_in_its_sliding_window_layers():
    gemma = read_shape(GEMMA3)
    assert gemma.n_swa == 512 and sum(gemma.swa_layers) == 15 and len(gemma.swa_layers) == 18
    assert [i for i, s in enumerate(gemma.swa_layers) if not s] == [5, 11, 17]
    per_layer_cell = (256 + 256) * 2
    # split: 16 streams; a global layer keeps 2,048 cells, a windowed one 512 + 256 padded = 768
    assert kv_bytes(gemma, shape(ubatch=256)) == 16 * per_layer_cell * (3 * 2048 + 15 * 768)
    # with 2,048-token batches the window is the whole stream
    assert kv_bytes(gemma, shape(ubatch=2048)) == 16 * per_layer_cell * 18 * 2048
    # unified: one pool of 16 x 2,048; windows of 512 per sequence + the batch
    assert kv_bytes(gemma, shape(unified=True, ubatch=256)) == per_layer_cell * (
        3 * 32768 + 15 * (16 * 512 + 256))


def test_the_estimate_counts_the_weights_once_and_the_contexts_each():
    smol = read_shape(SMOLLM2)
    one, two = estimate(smol, shape()), estimate(smol, shape(), contexts=2)
    assert one.weights == two.weights == smol.weight_bytes
    assert 90e6 < smol.weight_bytes < SMOLLM2.stat().st_size
    assert two.kv == 2 * one.kv and two.compute == 2 * one.compute
    assert one.total == one.weights + one.kv + one.compute + one.swap + one.python
    assert one.swap == 2048 * 23040 and one.embedding > 0


@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3])
def test_the_vocabulary_comes_from_the_header(path):
    assert read_shape(path).n_vocab == {SMOLLM2: 49152, GEMMA3: 262144}[path]


def test_speculation_adds_its_shared_ngram_table_to_each_context():
    import tracemalloc
    from dataclasses import replace

    from engine.drafting import SharedTable
    smol = read_shape(SMOLLM2)
    off, on = shape(), replace(shape(), speculative=True)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = SharedTable()
        allocated = tracemalloc.get_traced_memory()[0] - before   # what the table really holds
    finally:
        tracemalloc.stop()
    added = estimate(smol, on).python - estimate(smol, off).python
    assert len(table.values) == 1 << 20 and added == 12 * MiB
    assert added <= allocated < added + 16 * 1024
    assert (estimate(smol, on, contexts=2).python
            - estimate(smol, off, contexts=2).python) == 24 * MiB
    config = EngineConfig().resolved_for(type("M", (), {"on_gpu": False, "has_k_quants": False}))
    assert config.memory_shape().speculative   # on by default
    assert not replace(config, speculative="off").memory_shape().speculative


def test_the_embedding_context_is_sized_by_the_longest_embedding_input_not_the_context():
    """An agent's server (N_CTX 32,768) keeps a 2,048-token embedding context: estimated as a
    2,048-token server's, not the tens of GiB a whole-context batch would take."""
    from dataclasses import replace
    smol = read_shape(SMOLLM2)
    agent, small = shape(n_ctx=32768, max_seqs=2, n_seq_max=2), shape()
    assert estimate(smol, replace(agent, embed_ctx=2048)).embedding == \
        estimate(smol, small).embedding < 1536 * MiB
    assert estimate(smol, agent).embedding > 16 * 1024 * MiB     # the whole context: refused
    config = EngineConfig(n_ctx=32768, embed_tokens=2048)
    assert config.embed_ctx == 2048 and EngineConfig(n_ctx=512).embed_ctx == 512
