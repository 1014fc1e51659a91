"""LLaMA's config and model (LLaMA 1/2/3, SmolLM, Mistral): the shared pre-norm layer (core.layers.builder).

    x   = vocab_embedding(ids)
    h   = x + o(attention(q, k, v of RMSNorm(x)))   neox RoPE (linear / llama3 / yarn scaling), GQA
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))
    logits = lm_head(RMSNorm(x))                    lm_head tied to vocab_embedding when HF ties them

Biases on q, k, v and o with HF `attention_bias`, on the MLP with `mlp_bias`. Mistral is this
model with `sliding_window` W: every layer attends to the last W keys, its own included
(core.kernels.attention_window); W does not cap max_position_embeddings.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import WindowFields, first_present, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM

# HF max_position_embeddings defaults: LlamaConfig 2048, MistralConfig 4096 * 32.
MAX_POSITIONS = {"mistral": 4096 * 32}


class LlamaConfig(WindowFields):
    """DecoderConfig (rotary, biases, tied lm_head) + the attention window Mistral sets on every layer."""

    architecture: Literal["LlamaForCausalLM"] = "LlamaForCausalLM"


def max_positions(hf: dict) -> int:
    """max_position_embeddings, else the default of the HF config class that wrote the file."""
    return first_present(hf, ("max_position_embeddings",)) or MAX_POSITIONS.get(hf.get("model_type", ""), 2048)


from_hf_config = hf_config_reader(LlamaConfig, max_position_embeddings=max_positions)


class LlamaForCausalLM(DecoderLM):
    """One (tp, pp) rank of a LLaMA / Mistral decoder."""

    config: LlamaConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
