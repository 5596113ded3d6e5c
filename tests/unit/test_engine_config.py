"""Which attention kernel and KV cache type a context gets, and what that allows the scheduler
(no model loaded: the choices are arithmetic on the settings)."""
import pytest

from engine.worker import FA_TILE_ROWS, EngineConfig
from server.config import engine_from_env


def test_the_default_is_plain_attention_over_an_f16_cache_cut_anywhere():
    cfg = EngineConfig()
    assert not cfg.flash_attn and cfg.cache_type == "f16"
    assert cfg.any_cut_exact and cfg.max_piece is None


def test_flash_attention_comes_with_a_q8_0_cache_cut_anywhere():
    cfg = EngineConfig(flash_attn=True)
    assert cfg.cache_type == "q8_0" and cfg.any_cut_exact and cfg.max_piece is None


def test_flash_attention_over_f16_cuts_only_under_its_tile():
    cfg = EngineConfig(flash_attn=True, kv_type="f16")
    assert cfg.any_cut_exact and cfg.max_piece == FA_TILE_ROWS - 1
    assert not EngineConfig(flash_attn=True, kv_type="f16", prefill_chunk=64).any_cut_exact
    assert not EngineConfig(flash_attn=True, kv_type="f16", kv_unified=True).any_cut_exact


def test_a_quantized_cache_without_flash_attention_is_refused():
    with pytest.raises(ValueError, match="needs flash attention"):
        EngineConfig(flash_attn=False, kv_type="q8_0")
    with pytest.raises(ValueError, match="one of f16, q8_0"):
        EngineConfig(kv_type="q4_0")


def test_the_environment_picks_kernel_and_cache(monkeypatch):
    monkeypatch.delenv("PAGEDLLAMA_FLASH_ATTN", raising=False)
    monkeypatch.delenv("PAGEDLLAMA_KV_TYPE", raising=False)
    assert engine_from_env().cache_type == "f16"
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "1")
    assert engine_from_env().cache_type == "q8_0"
    monkeypatch.setenv("PAGEDLLAMA_KV_TYPE", "f16")
    assert engine_from_env().max_piece == FA_TILE_ROWS - 1
