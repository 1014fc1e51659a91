"""Qwen3-MoE's config and model: Qwen3's attention (QK-norm, no biases) with routed experts as the MLP.

    x   = embed_tokens(ids)
    h   = x + o(attention(rope(q_norm(q)), rope(k_norm(k)), v))    as Qwen3's (models.qwen3.model)
    y   = RMSNorm(h);  p = softmax(router(y))                       p over the E experts
    w_e = p_e / sum_{top k} p  (norm_topk_prob)   or   p_e  (without)      for e in top_k(p)
    out = h + sum_{e in top_k(p)} w_e down_e(silu(gate_e(y)) * up_e(y))   (core.layers.moe.MoE)
    logits = lm_head(RMSNorm(x))

TP splits every expert along its FFN dim; EP places whole experts per rank (core.layers.moe).
The router stays float under weight quantization (as vLLM builds it, quant_config None).
Sliding window (HF `use_sliding_window: true`): every layer attends to the last `sliding_window`
keys (transformers' Qwen3MoeModel builds one sliding mask for all layers).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import MoEFields, first_present, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.moe import MoE
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.qwen2.model import sliding_window


class Qwen3MoeConfig(MoEFields):
    """DecoderConfig + Qwen3-MoE's experts and window; intermediate_size is the FFN dim of one routed expert."""

    architecture: Literal["Qwen3MoeForCausalLM"] = "Qwen3MoeForCausalLM"
    num_local_experts: int = Field(128, ge=1, description="Routed experts per layer (E, HF num_experts).")
    num_experts_per_tok: int = Field(8, ge=1, description="Experts each token is routed to (top-k).")
    norm_topk_prob: bool = Field(False, description="Renormalise the top-k routing weights to sum to 1.")


# Every published Qwen3-MoE is sparse in every layer (decoder_sparse_step 1, no mlp_only_layers).
from_hf_config = hf_config_reader(
    Qwen3MoeConfig, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768},
    unsupported={"decoder_sparse_step": 1, "mlp_only_layers": []},
    sliding_window=sliding_window, layer_types=None,
    intermediate_size=lambda hf: first_present(hf, ("moe_intermediate_size",)) or 768,  # absent or null: HF's
    num_local_experts=lambda hf: first_present(hf, ("num_experts", "num_local_experts")) or 128)


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B."""

    config: Qwen3MoeConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        assert c.intermediate_size is not None  # an expert's FFN width: the HF reader always sets it
        moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok, c.hidden_act,
                  renormalize=c.norm_topk_prob, ep_size=c.mapping.moe_sizes()[1], **self.placement(device))
        moe.router.keep_float = True  # core.quant.apply skips it: an int8 router flips near-tied top-k choices
        return standard_layer(self, device, mlp=moe, qk_norm=True)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
