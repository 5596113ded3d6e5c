"""benchmarks/tools/shapes.py writes random-weight GGUFs in the shapes of real models, which
llama.cpp loads as `llama` models; benchmarks/sizes.py's settings and table."""
import gguf
import numpy as np
import pytest

from benchmarks import sizes
from benchmarks.tools import shapes
from engine.gguf_info import read_header
from tests.engine_helpers import computes_on_a_thread_of_its_own
from tests.server_proc import SMOLLM2

TINY = shapes.Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=4096)


@pytest.mark.parametrize(("name", "published"), [
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824),
    ("llama-3.1-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512 - 28 * (3584 + 2 * 512)),   # without its Q/K/V biases
])
def test_with_its_own_vocabulary_each_shape_has_the_models_parameter_count(name, published):
    shape = shapes.SHAPES[name]
    assert shape.parameters(shape.real_vocab) == published
    # with SmolLM2's vocabulary only the embedding (and an untied output) is smaller
    less = (shape.real_vocab - 49152) * shape.hidden * (1 if shape.tied else 2)
    assert shape.parameters(49152) == published - less


def test_the_tensors_are_llama_cpps_names_and_sizes():
    tensors = dict(shapes.SHAPES["llama-3.2-1b"].tensors(49152))
    assert tensors["token_embd.weight"] == (49152, 2048) and "output.weight" not in tensors
    assert tensors["blk.15.attn_q.weight"] == (2048, 2048)
    assert tensors["blk.0.attn_k.weight"] == tensors["blk.0.attn_v.weight"] == (512, 2048)
    assert tensors["blk.0.ffn_down.weight"] == (2048, 8192)
    assert len(tensors) == 1 + 16 * 9 + 1
    assert dict(shapes.SHAPES["llama-3.1-8b"].tensors(10))["output.weight"] == (10, 4096)


def test_random_values_are_small_and_norms_are_ones():
    rng = np.random.default_rng(0)
    norm = shapes.tensor_values("blk.0.ffn_norm.weight", (64,), rng)
    assert norm.dtype == np.float32 and (norm == 1).all()
    matrix = shapes.tensor_values("blk.0.ffn_up.weight", (300, 64), rng, rows_at_once=128)
    assert matrix.dtype == np.float16 and matrix.shape == (300, 64)
    assert 0.015 < float(matrix.astype(np.float32).std()) < 0.025
    assert np.isfinite(matrix).all() and (matrix[256:] != 0).any()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny shape made once: F16 written, quantized to Q4_K_M, the F16 file deleted."""
    folder = tmp_path_factory.mktemp("shapes")
    return folder, shapes.make(TINY, "Q4_K_M", folder, SMOLLM2)


def test_a_made_file_is_quantized_atomically_and_skipped_once_there(tiny):
    folder, r = tiny
    path = folder / "tiny-Q4_K_M.gguf"
    assert r["made"] and r["path"] == str(path) and r["bytes"] < r["f16_bytes"]
    assert r["parameters"] == TINY.parameters(49152) and r["n_vocab"] == 49152
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-Q4_K_M.gguf"]   # no F16 left
    assert shapes.make(TINY, "Q4_K_M", folder, SMOLLM2)["made"] is False     # there: skipped


def test_the_file_declares_the_shape_and_carries_the_tokenizer(tiny):
    folder, _ = tiny
    meta, tensors = (lambda h: (h.metadata, h.tensors))(read_header(folder / "tiny-Q4_K_M.gguf"))
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "tiny (random weights)"
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert (meta["llama.embedding_length"], meta["llama.block_count"],
            meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"],
            meta["llama.feed_forward_length"], meta["llama.rope.dimension_count"],
            meta["llama.context_length"], meta["llama.vocab_size"]) == (
        64, 2, 4, 2, 128, 16, 4096, 49152)
    assert meta["llama.rope.freq_base"] == 500000.0
    source = read_header(SMOLLM2).metadata
    tokenizer = {k for k in source if k.startswith("tokenizer.")}
    assert tokenizer >= {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"}
    assert {k for k in meta if k.startswith("tokenizer.")} == tokenizer
    assert all(meta[k] == source[k] for k in tokenizer), "the tokenizer is copied as it is"
    kinds = {t.name: t.type_name for t in tensors}
    assert sorted(kinds) == sorted(name for name, _ in TINY.tensors(49152))
    assert kinds["blk.1.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    assert next(t for t in tensors if t.name == "token_embd.weight").n_elements == 49152 * 64


@computes_on_a_thread_of_its_own
def test_llama_cpp_loads_the_file_as_a_llama_model_and_its_logits_are_finite(tiny):
    from engine.llama import Context, ContextConfig
    from engine.model import Model
    folder, _ = tiny
    model = Model(folder / "tiny-Q4_K_M.gguf")
    try:
        assert model.n_vocab == 49152 and model.n_ctx_train == 4096
        assert model.chat_template and "im_start" in model.chat_template
        ctx = Context(model, ContextConfig(n_ctx=256, n_seq_max=1, n_threads=1))
        try:
            tokens = model.tokenize("The capital of France is")
            assert ctx.decode([(0, tokens, 0, 1)]) == 0
            assert np.isfinite(ctx.logits(len(tokens) - 1)).all()
        finally:
            ctx.close()
    finally:
        model.close()


def test_unknown_shapes_are_refused():
    with pytest.raises(SystemExit, match="unknown shape"):
        shapes.main(["llama-9b"])


# ---- benchmarks/sizes.py ----------------------------------------------------------------------
def test_the_long_setting_holds_the_deepest_prompt_within_the_trained_context():
    args = sizes.parse_args(["--models", str(SMOLLM2), "--depths", "1500,8000,20000"])
    assert args.depths == [1500, 8000, 20000] and args.servers == ["ours", "peer"]
    fits, beyond = sizes.depths_held(args, 8192)
    assert (fits, beyond) == ([1500, 8000], [20000])
    long, conc = sizes.settings(args, 8192, fits)
    assert (long.parallel, long.n_ctx) == (1, 8192)                 # 8000 + 128 + 64, capped
    assert (conc.parallel, conc.n_ctx) == (16, 2048)
    long, _ = sizes.settings(args, 131072, [1500, 8000, 20000])
    assert long.n_ctx == 20224 and long.n_ctx >= 20000 + 128 + 64
    only = sizes.parse_args(["--models", str(SMOLLM2), "--parts", "concurrent"])
    assert [s.name for s in sizes.settings(only, 8192, [1500])] == ["concurrent"]


def test_quick_is_small_but_what_the_command_line_says_stays():
    args = sizes.parse_args(["--models", str(SMOLLM2), "--quick", "--depths", "100,300"])
    assert (args.depths, args.prompt_len, args.decode_tokens, args.streams) == ([100, 300], 200, 16, 4)


def test_sizes_refuses_unknown_parts_and_servers():
    for bad in (["--parts", "speed"], ["--servers", "vllm"]):
        with pytest.raises(SystemExit):
            sizes.parse_args(["--models", str(SMOLLM2), *bad])


def _run(ttft, rates, chat, peak_long, peak_conc):
    return ({"prompt": {"prompt_tokens": 1501, "ttft_s": ttft, "prompt_tok_s": 1501 / ttft},
             "decode": [{"prompt_tokens": n, "decode_tok_s": r}
                        for n, r in zip((65, 1501, 8001), rates)],
             "memory": {"peak": peak_long * sizes.MiB}},
            {"concurrent": {"output_throughput": chat, "median_ttft_ms": 500.0},
             "memory": {"peak": peak_conc * sizes.MiB}})


def _result(peer=True):
    ours_long, ours_conc = _run(10.0, (20.0, 18.0, 15.0), 80.0, 900, 1200)
    peer_long, peer_conc = _run(12.5, (25.0, 18.0, 12.0), 100.0, 800, 1000)
    long = {"parallel": 1, "n_ctx": 8448, "ours": ours_long}
    conc = {"parallel": 16, "n_ctx": 2048, "ours": ours_conc}
    if peer:
        long["peer"], conc["peer"] = peer_long, peer_conc
    return {"name": "llama-3.2-1b-Q4_K_M.gguf", "random_weights": True,
            "facts": {"parameters": 1_070_000_000, "file_size": 700 * sizes.MiB,
                      "context_length": 131072},
            "started": "2026-12-02 10:00 UTC", "finished": "2026-12-02 10:30 UTC",
            "depths_beyond_context": [], "settings": {"long": long, "concurrent": conc}}


def test_the_table_shows_ours_the_peers_and_their_ratio():
    rows = {r["label"]: r for r in sizes.comparison_rows(_result())}
    ttft = rows["prompt of 1,501 tokens: TTFT s"]
    assert (ttft["ours"], ttft["peer"], ttft["ratio"], ttft["lower_is_better"]) == (
        10.0, 12.5, 0.8, True)
    assert rows["decode, 1 stream, after 65 tokens: tok/s"]["ratio"] == 0.8
    assert rows["decode, 1 stream, after 8,001 tokens: tok/s"]["ratio"] == 1.25
    assert rows["16 chat streams: total tok/s"]["ratio"] == 0.8
    assert rows["peak memory MiB, 1 sequence of 8,448"]["ratio"] == 1.125
    assert rows["peak memory MiB, 16 sequences of 2,048"]["ratio"] == 1.2
    text = sizes.table(_result())
    assert "random weights: the text is meaningless" in text
    assert "2026-12-02 10:00 UTC – 2026-12-02 10:30 UTC" in text and "1.07 B parameters" in text
    line = next(x for x in text.splitlines() if x.startswith("prompt of 1,501 tokens"))
    assert line.split()[-3:] == ["10.00", "12.50", "0.80×"] and "(lower is better)" in line
    line = next(x for x in text.splitlines() if x.startswith("peak memory MiB, 1 sequence"))
    assert line.split()[-3:] == ["900", "800", "1.12×"]


def test_the_table_of_ours_alone_has_no_ratios():
    rows = sizes.comparison_rows(_result(peer=False))
    assert rows and all(r["peer"] is None and r["ratio"] is None for r in rows)
    assert all(r["ours"] is not None for r in rows)
    line = sizes.table(_result(peer=False)).splitlines()[-1]
    assert line.split()[-2:] == ["-", "-"]
