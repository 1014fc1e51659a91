"""LLaMA: RMSNorm, rotary (neox style), GQA attention, SwiGLU MLP, tied or untied lm_head."""

from __future__ import annotations

from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import GatedMLP
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.llama.config import LlamaConfig
from torch import nn


class LlamaForCausalLM(DecoderLM):
    """LLaMA family (LLaMA 1/2/3, SmolLM, Mistral without sliding window)."""

    config: LlamaConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        rotary = Rotary(c.head_size, c.head_size, c.rotary_base, c.rotary_scaling,
                        c.max_position_embeddings or 2048, style="neox")
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                  qkv_bias=c.attn_bias, dense_bias=c.attn_bias, rotary=rotary,
                                  dtype=self.dtype, device=device, **tp)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, dtype=self.dtype, device=device,
                       **tp)
        return PreNormDecoderLayer(self.make_final_norm(device), attention, self.make_final_norm(device), mlp)

    def make_final_norm(self, device) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.norm_epsilon, self.dtype, device)
