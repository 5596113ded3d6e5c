"""Which attention kernel and KV cache type a context gets (no model loaded: the choices are
arithmetic on the settings)."""
import pytest

from engine import config as config_module
from engine.config import EngineConfig
from server.config import engine_from_env


class FakeModel:
    def __init__(self, has_k_quants, on_gpu=False):
        self.has_k_quants, self.on_gpu = has_k_quants, on_gpu


def test_by_default_flash_attention_on_its_row_invariant_path_for_any_weights(monkeypatch):
    monkeypatch.setattr(config_module, "has_row_invariant_attention", lambda: True)
    cfg = EngineConfig()
    assert cfg.flash_attn is None and cfg.kv_type == "f16"
    assert cfg.resolved_for(FakeModel(False)).flash_attn is True
    assert cfg.resolved_for(FakeModel(True)).flash_attn is True


def test_without_the_row_invariant_path_k_quant_models_get_plain_attention(monkeypatch):
    monkeypatch.setattr(config_module, "has_row_invariant_attention", lambda: False)
    cfg = EngineConfig()
    assert cfg.resolved_for(FakeModel(False)).flash_attn is True
    assert cfg.resolved_for(FakeModel(True)).flash_attn is False
    # a q8_0 cache needs flash attention whatever the weights
    assert EngineConfig(kv_type="q8_0").resolved_for(FakeModel(True)).flash_attn is True
    # a setting is kept as it is
    for setting in (True, False):
        for k_quants in (True, False):
            assert (EngineConfig(flash_attn=setting).resolved_for(FakeModel(k_quants)).flash_attn
                    is setting)


def test_a_quantized_cache_without_flash_attention_is_refused():
    with pytest.raises(ValueError, match="needs flash attention"):
        EngineConfig(flash_attn=False, kv_type="q8_0")
    with pytest.raises(ValueError, match="one of f16, q8_0"):
        EngineConfig(kv_type="q4_0")


def test_the_environment_picks_kernel_and_cache(monkeypatch):
    monkeypatch.delenv("PAGEDLLAMA_FLASH_ATTN", raising=False)
    monkeypatch.delenv("PAGEDLLAMA_KV_TYPE", raising=False)
    cfg = engine_from_env()
    assert (cfg.flash_attn, cfg.kv_type) == (None, "f16")
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "auto")
    assert engine_from_env().flash_attn is None
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "0")
    assert (engine_from_env().flash_attn, engine_from_env().kv_type) == (False, "f16")
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "1")
    assert engine_from_env().flash_attn is True
    monkeypatch.setenv("PAGEDLLAMA_KV_TYPE", "q8_0")
    assert engine_from_env().kv_type == "q8_0"
    monkeypatch.setenv("PAGEDLLAMA_KV_TYPE", "")
    assert engine_from_env().kv_type == "f16"


def test_prompt_chunks_and_step_budget_follow_the_device(monkeypatch):
    """Where a model computes on a GPU, prompts go in larger chunks within a larger step
    budget; each model by its own device (a models file may keep one on the CPU), and explicit
    settings win."""
    for name in ("PREFILL_CHUNK", "MAX_BATCH_TOKENS", "FLASH_ATTN", "KV_TYPE"):
        monkeypatch.delenv(f"PAGEDLLAMA_{name}", raising=False)
    cfg = engine_from_env()
    assert (cfg.prefill_chunk, cfg.max_batch_tokens) == (None, None)   # left to the model
    cpu, gpu = cfg.resolved_for(FakeModel(False)), cfg.resolved_for(FakeModel(False, True))
    assert (cpu.prefill_chunk, cpu.max_batch_tokens) == (16, 256)
    assert (gpu.prefill_chunk, gpu.max_batch_tokens) == (256, 1024)
    assert gpu.flash_attn is True and gpu.n_threads == cfg.n_threads
    monkeypatch.setenv("PAGEDLLAMA_PREFILL_CHUNK", "64")
    cfg = engine_from_env()
    assert (cfg.prefill_chunk, cfg.max_batch_tokens) == (64, None)
    gpu = cfg.resolved_for(FakeModel(False, True))
    assert (gpu.prefill_chunk, gpu.max_batch_tokens) == (64, 1024)
    monkeypatch.setenv("PAGEDLLAMA_MAX_BATCH_TOKENS", "")
    assert engine_from_env().max_batch_tokens is None
    assert EngineConfig(max_batch_tokens=512).resolved_for(
        FakeModel(True, True)).max_batch_tokens == 512


def test_threads_default_to_the_cores_this_process_may_use(monkeypatch):
    from server import config

    monkeypatch.delenv("PAGEDLLAMA_THREADS", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {3, 5, 7})
    assert engine_from_env().n_threads == 3 == config.usable_cores()


def test_a_context_has_a_logits_row_for_every_token_a_verification_piece_checks():
    # one sequence, prompts in pieces of 8: without speculation 8 rows are enough, with it a
    # piece of the last token and max_draft drafted ones wants a row each
    small = dict(max_seqs=1, prefill_chunk=8, max_batch_tokens=64)
    off = EngineConfig(speculative="off", **small).resolved_for(FakeModel(False))
    on = EngineConfig(speculative="ngram", max_draft=8, **small).resolved_for(FakeModel(False))
    assert off.n_outputs_max == 8
    assert on.n_outputs_max == on.n_seq_max * 9
    # never more rows than a step has tokens
    tight = EngineConfig(speculative="ngram", max_draft=8, max_seqs=1, prefill_chunk=4,
                         max_batch_tokens=4).resolved_for(FakeModel(False))
    assert tight.n_outputs_max <= tight.step_tokens
