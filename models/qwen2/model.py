"""Qwen2's config and model: the shared RMSNorm / RoPE / GQA / SwiGLU layer with q/k/v biases.

    x   = embed_tokens(ids)
    h   = x + o(attention(q, k, v of RMSNorm(x)))     q, k, v with biases, o without; neox RoPE; GQA
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
    logits = lm_head(RMSNorm(x))                      tied to embed_tokens when HF ties them

Sliding window (HF `use_sliding_window: true`): the layers HF's config marks "sliding_attention"
attend to the last `sliding_window` keys (query included), the others to every key
(DecoderLM.attention_window reads sliding_window and layer_types: core.kernels.attention_window).
Without an explicit `layer_types`, transformers' Qwen2Config windows layer i when
i >= max_window_layers (default 28); Qwen2-MoE has its own rule (models.qwen2_moe.model).
Without use_sliding_window, `sliding_window` is ignored (HF sets it to None), as in every
published Qwen2 / Qwen2.5 config.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import WindowFields, hf_config_reader, window_layer_types
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM

MAX_WINDOW_LAYERS = 28  # HF Qwen2Config / Qwen2MoeConfig max_window_layers default


class Qwen2Config(WindowFields):
    """DecoderConfig with Qwen2's name, its fixed biases (q/k/v only) and its sliding window."""

    architecture: Literal["Qwen2ForCausalLM"] = "Qwen2ForCausalLM"
    qkv_bias: bool = True


def sliding_window(hf: dict) -> int | None:
    """HF sliding_window when use_sliding_window is true, else None (HF: None for Qwen2, 0 for Qwen2-MoE)."""
    return (hf.get("sliding_window") or None) if hf.get("use_sliding_window") else None


def max_window_layers(hf: dict) -> int:
    """HF max_window_layers (absent or null: transformers' default 28)."""
    value = hf.get("max_window_layers")
    return MAX_WINDOW_LAYERS if value is None else int(value)


def qwen2_windowed(i: int, hf: dict) -> bool:
    """transformers' Qwen2Config: layer i is windowed when i >= max_window_layers."""
    return i >= max_window_layers(hf)


from_hf_config = hf_config_reader(Qwen2Config, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768},
                                  qkv_bias=True, dense_bias=False, sliding_window=sliding_window,
                                  layer_types=window_layer_types(sliding_window, qwen2_windowed))


class Qwen2ForCausalLM(DecoderLM):
    """Qwen1.5 / Qwen2 / Qwen2.5 dense decoders."""

    config: Qwen2Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
