"""Qwen3's config and model: Qwen2's layer without biases, with an RMSNorm over each q and k head.

    x   = embed_tokens(ids)
    q, k, v = q_proj(y), k_proj(y), v_proj(y),  y = RMSNorm(x)       no biases (HF attention_bias false)
    q_h, k_h = q_norm(q_h), k_norm(k_h)       an RMSNorm (weight [D], rms_norm_eps) over each head's D dims
    h   = x + o(attention(rope(q), rope(k), v))                      neox RoPE, GQA, scale 1/sqrt(D)
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
    logits = lm_head(RMSNorm(x))                                      tied to embed_tokens when HF ties them

head_dim is its own field (Qwen3-8B: 128 with hidden 4096 / 32 heads; absent: transformers' 128).
Sliding window (HF `use_sliding_window: true`): as Qwen2's, the layers i >= max_window_layers (or
as `layer_types` says) attend to the last `sliding_window` keys (models.qwen2.model).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import WindowFields, hf_config_reader, window_layer_types
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.qwen2.model import qwen2_windowed, sliding_window

HEAD_DIM = 128  # transformers' Qwen3Config head_dim default


class Qwen3Config(WindowFields):
    """DecoderConfig with Qwen3's name and its sliding window (QK-norm is always on)."""

    architecture: Literal["Qwen3ForCausalLM"] = "Qwen3ForCausalLM"


from_hf_config = hf_config_reader(
    Qwen3Config, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768, "head_size": HEAD_DIM},
    sliding_window=sliding_window, layer_types=window_layer_types(sliding_window, qwen2_windowed))


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3-0.6B ... Qwen3-32B."""

    config: Qwen3Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device, qk_norm=True)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
