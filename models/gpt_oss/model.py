"""gpt-oss's config and model (transformers' GptOssForCausalLM).

    x   = embed_tokens(ids)
    h   = x + o(attention(q, k, v of RMSNorm(x)))        q/k/v/o with biases, neox RoPE (YaRN-scaled), GQA
          attention_i = sum_j exp(s_ij) / (exp(a_h) + sum_j' exp(s_ij')) v_j    a_h: head h's sink logit
          over every earlier key (full layers) or the last `sliding_window` ones (sliding layers, layer_types)
    y   = RMSNorm(h);  l = router(y) (with bias);  w = softmax over the top-k l
    out = h + sum_{e in top_k(l)} w_e (down_e(glu(gate_e(y), up_e(y))))    every expert linear with a bias
          glu(g, u) = (clamp(u, -L, L) + 1) * g' sigmoid(alpha g'),  g' = min(g, L)
    logits = lm_head(RMSNorm(x))

alpha swiglu_alpha (1.702), L swiglu_limit (7.0): core.layers.moe.ClampedSwiGLU. Sink logits:
core.layers.attention.PagedAttention.sink_logits (the torch attention path; a tp rank holds its heads').
TP splits every expert along its FFN dim (the proj bias added once); EP places whole experts per rank.
The router stays float under weight quantization; the experts are not quantized (ExpertLinear).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import MoEFields, hf_config_reader, window_layer_types
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.moe import ClampedSwiGLU, MoE
from bestiary.core.runtime.model import DecoderLM

THETA = 150000.0  # transformers' GptOssConfig.default_theta
# transformers' GptOssConfig rope scaling when a config.json names none (read_rope's default_scaling).
HF_YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}


class GptOssConfig(MoEFields):
    """MoEFields + gpt-oss's clamped SwiGLU; q/k/v/o biases (HF attention_bias, true by default)."""

    architecture: Literal["GptOssForCausalLM"] = "GptOssForCausalLM"
    qkv_bias: bool = True
    dense_bias: bool = True
    rotary_base: float = THETA
    swiglu_alpha: float = Field(1.702, gt=0, description="Sigmoid gain alpha of the experts' clamped SwiGLU.")
    swiglu_limit: float = Field(7.0, gt=0, description="Clamp L of the experts' gate (above) and up (both sides).")


def window(hf: dict) -> int | None:
    """sliding_window (absent: transformers' 128; null: no banded layers)."""
    return hf.get("sliding_window", 128)


def banded(i: int, hf: dict) -> bool:
    """transformers' GptOssConfig: layer i is sliding (banded) when i is even."""
    return i % 2 == 0


from_hf_config = hf_config_reader(
    GptOssConfig, defaults={"norm_epsilon": 1e-5, "max_position_embeddings": 131072, "rotary_base": THETA,
                            "rotary_scaling": HF_YARN},
    sliding_window=window, layer_types=window_layer_types(window, banded),
    num_local_experts=lambda hf: hf.get("num_local_experts", hf.get("num_experts", 128)),
    num_experts_per_tok=lambda hf: hf.get("num_experts_per_tok", 4))


class GptOssForCausalLM(DecoderLM):
    """gpt-oss-20b, gpt-oss-120b."""

    config: GptOssConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c, place = self.config, self.placement(device)
        assert c.intermediate_size is not None  # an expert's FFN width (read_common always sets it)
        moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok, renormalize=True,
                  ep_size=c.mapping.moe_sizes()[1], glu=ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit),
                  expert_bias=True, **place)
        moe.router = Linear(c.hidden_size, c.num_local_experts, bias=True, parallel=Parallel.REPLICATED,
                            dtype=self.dtype, device=device)
        moe.router.keep_float = True  # core.quant.apply skips it: an int8 router flips near-tied top-k choices
        return standard_layer(self, device, mlp=moe, sink_logits=True)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
