"""Gemma 3's text config and model (transformers' Gemma3ForCausalLM): Gemma 2 with QK-norm and two ropes.

    x   = embed_tokens(ids) * sqrt(hidden)           the scale rounded to the embedding dtype first
    h   = x + N(o(attention(N_q(q), N_k(k), v of N(x))))   scores / sqrt(query_pre_attn_scalar)
    out = h + N(down(gelu_tanh(gate(N(h))) * up(N(h))))
    logits = lm_head(N(x))                            (c tanh(. / c) when final_logit_softcapping is set)

transformers' Gemma3Attention reads no attn_logit_softcapping (it keeps the field and never passes it
on), so a config that sets one is refused rather than run two ways.

N, N_q, N_k: RMSNorm with the scale 1 + w (N_q / N_k over each head's D dims, before RoPE). Local
layers ("sliding_attention"; transformers' rule: every layer but each sliding_window_pattern-th, 6)
attend through the window with RoPE of theta rope_local_base_freq (10^4) and no scaling; global
layers see every key with rope_theta (10^6) and the config's rope scaling (linear for 4B and up).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import hf_config_reader, layer_type_theta, window_layer_types
from bestiary.core.layers.builder import standard_layer
from bestiary.core.layers.rotary import Rotary
from bestiary.models.gemma2.model import (
    CAUSAL_ONLY,
    GEMMA_FIELDS,
    Gemma2ForCausalLM,
    GemmaFields,
    gemma_norm,
    hf_or_default,
    local_window,
)

# transformers' Gemma3TextConfig defaults for what a config.json may leave out (absent, not null).
HF_DEFAULTS: dict[str, Any] = {"attn_logit_softcapping": None,
                               "final_logit_softcapping": None, "query_pre_attn_scalar": 256}
LOCAL = "sliding_attention"


class Gemma3Config(GemmaFields):
    """GemmaFields + the local layers' own RoPE theta; QK-norm always."""

    architecture: Literal["Gemma3ForCausalLM"] = "Gemma3ForCausalLM"
    rotary_local_base: float = Field(10000.0, gt=0, description="RoPE theta of the local (sliding) layers.")


def gemma3_windowed(i: int, hf: dict) -> bool:
    """Gemma3TextConfig's pattern: layer i is global when (i + 1) % sliding_window_pattern == 0 (default 6)."""
    pattern = hf.get("sliding_window_pattern") or 6
    return (i + 1) % pattern != 0


from_hf_config = hf_config_reader(
    Gemma3Config, defaults={"norm_epsilon": 1e-6, "head_size": 256, "max_position_embeddings": 131072,
                            "tie_word_embeddings": True, "rotary_base": 1e6},
    unsupported=CAUSAL_ONLY | {"attn_logit_softcapping": None}, copy_same_named=False, **GEMMA_FIELDS,
    **{n: hf_or_default(n, HF_DEFAULTS) for n in HF_DEFAULTS}, sliding_window=local_window,
    rotary_local_base=lambda hf: layer_type_theta(hf, LOCAL, "rope_local_base_freq", 10000.0),
    layer_types=window_layer_types(local_window, gemma3_windowed))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 1B / 4B / 12B / 27B (the text model)."""

    config: Gemma3Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        rotary: bool | Rotary = True  # global: the config's rope (rotary_base, rotary_scaling)
        if c.layer_types is not None and c.layer_types[layer_idx] == LOCAL:
            d = c.head_size
            assert d is not None, "PretrainedConfig's validator fills head_size in"
            rotary = Rotary(d, d, c.rotary_local_base, None, c.max_position_embeddings or 131072)
        return standard_layer(self, device, layout="sandwich", scale=c.query_pre_attn_scalar**-0.5, rotary=rotary,
                              qk_norm=lambda d: gemma_norm(self, device, d))

    def make_final_norm(self, device) -> nn.Module:
        return gemma_norm(self, device)
