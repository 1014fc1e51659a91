"""Qwen2's config and model, composed from bestiary's core layers.

    h   = x + o(attention(q, k, v of RMSNorm(x)))    q, k, v with biases, o without; neox RoPE; GQA
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
    logits = lm_head(RMSNorm(x))
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM


class Qwen2Config(DecoderConfig):
    """DecoderConfig with Qwen2's name and its fixed biases (q/k/v only)."""

    architecture: Literal["Qwen2ForCausalLM"] = "Qwen2ForCausalLM"
    qkv_bias: bool = True


from_hf_config = hf_config_reader(Qwen2Config, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768},
                                  unsupported={"use_sliding_window": False}, qkv_bias=True, dense_bias=False)


class Qwen2ForCausalLM(DecoderLM):
    """One (tp, pp) rank of a Qwen2 decoder; module paths are the checkpoint's canonical names."""

    config: Qwen2Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)  # pre-norm: RMSNorm, attention with the config's RoPE, SwiGLU

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
