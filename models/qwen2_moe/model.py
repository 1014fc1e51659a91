"""Qwen2-MoE's config and model: the shared RMSNorm / RoPE / GQA layer with a shared-expert MoE.

    x   = embed_tokens(ids)
    h   = x + attention(RMSNorm(x))                     q, k, v with biases; neox RoPE; GQA
    out = h + MoE(y) + sigmoid(w_s . y) shared(y),  y = RMSNorm(h)   (core.layers.moe.SharedExpertMoE)
    logits = lm_head(RMSNorm(x))

Routing: softmax over the E router logits, the top-k kept, renormalised only with norm_topk_prob.

Sliding window (HF `use_sliding_window: true`): as Qwen2's (models.qwen2.model), but without an
explicit `layer_types` transformers' Qwen2MoeConfig windows the even layers below max_window_layers:
layer i when (i + 1) % 2 and i < max_window_layers (default 28).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import MoEFields, first_present, hf_config_reader, window_layer_types
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.moe import SharedExpertMoE
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.qwen2.model import max_window_layers, sliding_window


class Qwen2MoeConfig(MoEFields):
    """DecoderConfig + Qwen2-MoE's experts and sliding window; intermediate_size is the FFN dim of one routed expert."""

    architecture: Literal["Qwen2MoeForCausalLM"] = "Qwen2MoeForCausalLM"
    qkv_bias: bool = True
    num_local_experts: int = Field(60, ge=1, description="Routed experts per layer (E, HF num_experts).")
    num_experts_per_tok: int = Field(4, ge=1, description="Experts each token is routed to (top-k).")
    shared_expert_intermediate_size: int = Field(5632, ge=1, description="FFN dim of the shared expert.")
    norm_topk_prob: bool = Field(False, description="Renormalise the top-k routing weights to sum to 1.")


def qwen2_moe_windowed(i: int, hf: dict) -> bool:
    """transformers' Qwen2MoeConfig: layer i is windowed when it is even and i < max_window_layers."""
    return bool((i + 1) % 2) and i < max_window_layers(hf)


# Every published Qwen2-MoE is sparse in every layer (decoder_sparse_step 1, no mlp_only_layers).
from_hf_config = hf_config_reader(
    Qwen2MoeConfig, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768},
    unsupported={"decoder_sparse_step": 1, "mlp_only_layers": []},
    sliding_window=sliding_window, layer_types=window_layer_types(sliding_window, qwen2_moe_windowed),
    qkv_bias=lambda hf: first_present(hf, ("qkv_bias",)) is not False, dense_bias=False,
    intermediate_size=lambda hf: first_present(hf, ("moe_intermediate_size",)) or 1408,  # absent or null: HF's
    num_local_experts=lambda hf: first_present(hf, ("num_experts",)) or 60)


class Qwen2MoeForCausalLM(DecoderLM):
    """Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B."""

    config: Qwen2MoeConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        assert c.intermediate_size is not None  # an expert's FFN width: the HF reader always sets it
        moe = SharedExpertMoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                              c.shared_expert_intermediate_size, c.hidden_act, renormalize=c.norm_topk_prob,
                              ep_size=c.mapping.moe_sizes()[1], **self.placement(device))
        return standard_layer(self, device, mlp=moe)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
