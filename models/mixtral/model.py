"""Mixtral: LLaMA's attention block (RMSNorm, neox RoPE, GQA) with a sparse MoE as the MLP."""

from __future__ import annotations

from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.moe import MoE
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.mixtral.config import MixtralConfig
from torch import nn


class MixtralForCausalLM(DecoderLM):
    """Mixtral 8x7B / 8x22B and other top-k routed SwiGLU-expert decoders."""

    config: MixtralConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size, dtype=self.dtype, device=device)
        rotary = Rotary(c.head_size, c.head_size, c.rotary_base, c.rotary_scaling,
                        c.max_position_embeddings or 2048, style="neox")
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                  rotary=rotary, **tp)
        moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                  c.hidden_act, **tp, ep_size=c.mapping.moe_ep_size)
        return PreNormDecoderLayer(self.make_final_norm(device), attention, self.make_final_norm(device), moe)

    def make_final_norm(self, device) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.norm_epsilon, self.dtype, device)
