"""Baichuan's config and model: the shared RMSNorm / SwiGLU layer with RoPE (7B) or ALiBi (13B).

    x   = embed_tokens(ids)
    h   = x + o_proj(attention(W_pack RMSNorm(x)))    W_pack rows [Q; K; V]; RoPE (neox) or ALiBi m_h j
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
    logits = RMSNorm(x) W^T,  W = lm_head rows / ||row||_2 for Baichuan2 (NormHead), as stored for Baichuan 1

Which position scheme: the published 7B configs carry max_position_embeddings (RoPE), the 13B
ones only model_max_length (ALiBi, `_gen_alibi_mask` upstream). NormHead: Baichuan2's 125,696-token
vocabulary (Baichuan 1 has 64,000), the rule vLLM uses too; a config may say `norm_head` itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.alibi import rank_alibi_slopes
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM

BAICHUAN2_VOCAB = 125696


class BaichuanConfig(DecoderConfig):
    """DecoderConfig + Baichuan's position scheme and NormHead switch (MHA, no biases)."""

    architecture: Literal["BaichuanForCausalLM"] = "BaichuanForCausalLM"
    position_embedding_type: Literal["rope_gpt_neox", "alibi"] = "rope_gpt_neox"
    norm_head: bool = Field(True, description="lm_head rows are L2-normalised (Baichuan2's NormHead).")


def _alibi(hf: dict) -> bool:
    return hf.get("max_position_embeddings") is None


from_hf_config = hf_config_reader(
    BaichuanConfig, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 4096},
    max_position_embeddings=lambda hf: hf.get("max_position_embeddings") or hf.get("model_max_length") or 4096,
    position_embedding_type=lambda hf: "alibi" if _alibi(hf) else "rope_gpt_neox",
    norm_head=lambda hf: hf["norm_head"] if hf.get("norm_head") is not None
    else hf.get("vocab_size") == BAICHUAN2_VOCAB)  # absent or null: Baichuan2's vocabulary says


class BaichuanForCausalLM(DecoderLM):
    """Baichuan-7B/13B, Baichuan2-7B/13B (Base and Chat)."""

    config: BaichuanConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        if c.position_embedding_type == "alibi":
            slopes = rank_alibi_slopes(c.num_attention_heads, self.tp_rank, self.tp_size)
            return standard_layer(self, device, rotary=False, alibi=slopes)
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)

