"""Mixtral's config and model: LLaMA's attention block with a sparse mixture of experts as the MLP.

    x   = embed_tokens(ids)
    h   = x + o(attention(q, k, v of RMSNorm(x)))        neox RoPE, GQA, optional sliding window
    y   = RMSNorm(h);  p = softmax(router(y))             p over the E experts
    out = h + sum_{e in top_k(p)} p_e / (sum_{top k} p) * down_e(silu(gate_e(y)) * up_e(y))
    logits = lm_head(RMSNorm(x))

TP splits every expert along its FFN dim; EP places whole experts per rank (core.layers.moe.MoE).
`sliding_window` W: every layer attends to the last W keys, its own included.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import MoEFields, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.moe import MoE
from bestiary.core.runtime.model import DecoderLM

# HF MixtralConfig's defaults (Mixtral-8x7B) by bestiary field, where config.json omits a field.
HF_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, max_position_embeddings=4096 * 32, norm_epsilon=1e-5, rotary_base=1e6)


class MixtralConfig(MoEFields):
    """DecoderConfig + Mixtral's experts (E 8, top-2) and attention window."""

    architecture: Literal["MixtralForCausalLM"] = "MixtralForCausalLM"
    rotary_base: float = 1e6


def kv_heads(hf: dict) -> int:
    """HF num_key_value_heads: absent -> MixtralConfig's 8, null -> one per query head."""
    return hf.get("num_key_value_heads", 8) or hf.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])


from_hf_config = hf_config_reader(
    MixtralConfig, defaults=HF_DEFAULTS, num_key_value_heads=kv_heads)


class MixtralForCausalLM(DecoderLM):
    """Mixtral 8x7B / 8x22B and other top-k routed SwiGLU-expert decoders."""

    config: MixtralConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        assert c.intermediate_size is not None  # an expert's FFN width: the HF reader always sets it
        moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok, c.hidden_act,
                  ep_size=c.mapping.moe_sizes()[1], **self.placement(device))
        return standard_layer(self, device, mlp=moe)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
