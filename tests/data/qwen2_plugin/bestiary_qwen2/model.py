"""Qwen2's config and model, composed from bestiary's core layers.

    h   = x + attention(RMSNorm(x))      q, k, v with biases, o without; neox RoPE; GQA
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
"""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import GatedMLP
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from torch import nn


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
        c, place = self.config, self.placement(device)
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                  qkv_bias=c.qkv_bias, dense_bias=c.dense_bias, rotary=self.make_rotary(), **place)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, **place)
        return PreNormDecoderLayer(self.make_final_norm(device), attention, self.make_final_norm(device), mlp)

    def make_final_norm(self, device) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.norm_epsilon, self.dtype, device)
