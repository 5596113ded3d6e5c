"""Which attention kernel and KV cache type a context gets (no model loaded: the choices are
arithmetic on the settings)."""
import pytest

from engine.worker import EngineConfig
from server.config import engine_from_env


def test_the_default_is_flash_attention_over_an_f16_cache():
    cfg = EngineConfig()
    assert cfg.flash_attn and cfg.kv_type == "f16"
    assert EngineConfig(kv_type="q8_0").kv_type == "q8_0"
    assert not EngineConfig(flash_attn=False).flash_attn


def test_a_quantized_cache_without_flash_attention_is_refused():
    with pytest.raises(ValueError, match="needs flash attention"):
        EngineConfig(flash_attn=False, kv_type="q8_0")
    with pytest.raises(ValueError, match="one of f16, q8_0"):
        EngineConfig(kv_type="q4_0")


def test_the_environment_picks_kernel_and_cache(monkeypatch):
    monkeypatch.delenv("PAGEDLLAMA_FLASH_ATTN", raising=False)
    monkeypatch.delenv("PAGEDLLAMA_KV_TYPE", raising=False)
    cfg = engine_from_env()
    assert (cfg.flash_attn, cfg.kv_type) == (True, "f16")
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "0")
    assert (engine_from_env().flash_attn, engine_from_env().kv_type) == (False, "f16")
    monkeypatch.setenv("PAGEDLLAMA_FLASH_ATTN", "1")
    monkeypatch.setenv("PAGEDLLAMA_KV_TYPE", "q8_0")
    assert engine_from_env().kv_type == "q8_0"
    monkeypatch.setenv("PAGEDLLAMA_KV_TYPE", "")
    assert engine_from_env().kv_type == "f16"
