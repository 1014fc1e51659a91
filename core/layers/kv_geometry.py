"""What one token of one layer takes in the paged KV cache of one tensor-parallel rank.

The runtime allocates the pools from it (core.runtime.kv_cache.KVCache.for_model) and `bestiary build`
sizes them from it (core.convert.memory.kv_bytes_per_token): one source of truth for both.

    K pool [layers, blocks, tokens_per_block, kv_heads, k_dim]
    V pool [layers, blocks, tokens_per_block, kv_heads, v_dim]
    bytes per token = layers * kv_heads * (k_dim + v_dim) * element size

Standard attention keeps each rank's kv heads (`kv_heads_of_rank`) with k_dim = v_dim = head_size.
A family whose cache holds something else states it with a `kv_pool_geometry(tp_size, tp_rank)`
method on its config class: multi-head latent attention (DeepSeek-V2 / V3, core.layers.latent_attention)
stores one row [c_kv ; k_pe] of kv_lora_rank + qk_rope_head_dim per token, the same on every rank,
and no V pool (v_dim 0: the values are read from the latent c_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

from bestiary.core.layers.self_attention import kv_heads_of_rank


@dataclass(frozen=True)
class KVPoolGeometry:
    """Per token and layer on one rank: `kv_heads` rows of `k_dim` in the K pool and of `v_dim` in the V pool."""

    kv_heads: int
    k_dim: int
    v_dim: int

    @property
    def elements(self) -> int:
        """Pool elements one token takes in one layer: kv_heads * (k_dim + v_dim)."""
        return self.kv_heads * (self.k_dim + self.v_dim)


def pool_geometry(config, tp_size: int = 1, tp_rank: int = 0) -> KVPoolGeometry:
    """The pool geometry of rank `tp_rank` of `tp_size` for a model config: the config's own
    `kv_pool_geometry(tp_size, tp_rank)` when its class has one, else the rank's kv heads of head_size."""
    own = getattr(config, "kv_pool_geometry", None)
    if callable(own):
        geometry = own(tp_size, tp_rank)
        assert isinstance(geometry, KVPoolGeometry), f"{type(config).__name__}.kv_pool_geometry: {geometry!r}"
        return geometry
    heads = kv_heads_of_rank(config.num_attention_heads, config.num_key_value_heads, tp_size, tp_rank)
    return KVPoolGeometry(len(heads), config.head_size, config.head_size)
