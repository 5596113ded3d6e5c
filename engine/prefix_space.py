"""A context's space in the prefix cache's RAM and disk tiers (kvcache/snapshots/): everything
that decides the numbers of its KV, so that two contexts share saved prefix states only when
their numbers are equal."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.llama import Context
from engine.model import Model, build_identity
from kvcache import PrefixStore, Space, space_identity
from kvcache.snapshots import file_digest


def tier_space(store: PrefixStore, model: Model, context: Context,
               config: EngineConfig) -> Space:
    """The context's space in the tiers: everything that decides the numbers of its KV."""
    memo = store.disk_dir / "models.json" if store.disk_dir is not None else None
    identity = space_identity(
        model=file_digest(model.path, memo), llama_cpp=build_identity(), kv_type=config.kv_type,
        flash_attn=bool(config.flash_attn), attention=str(context.attention),
        kv_unified=config.kv_unified, n_ctx_seq=context.n_ctx_seq, repack=model.repack,
        on_gpu=model.on_gpu)
    return store.space(identity, config.block_size, whole_only=model.n_swa > 0)
