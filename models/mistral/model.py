"""Mistral's config and model: the shared RMSNorm / RoPE / GQA / SwiGLU layer (core.layers.builder)."""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.hf_config import DecoderConfig, first_present, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM
from pydantic import Field
from torch import nn

MAX_POSITIONS = 4096 * 32  # HF MistralConfig's max_position_embeddings default


class MistralConfig(DecoderConfig):
    """DecoderConfig + Mistral's attention window."""

    architecture: Literal["MistralForCausalLM"] = "MistralForCausalLM"
    sliding_window: int | None = Field(
        None, ge=1, description="HF sliding_window: each token attends to the last W tokens (None: all)."
    )


def max_positions(hf: dict) -> int:
    """max_position_embeddings (not capped by sliding_window: attention runs through the window,
    core.kernels.attention_window)."""
    return first_present(hf, ("max_position_embeddings",)) or MAX_POSITIONS


from_hf_config = hf_config_reader(MistralConfig, defaults={"norm_epsilon": 1e-6},
                                  max_position_embeddings=max_positions,
                                  sliding_window=lambda hf: hf.get("sliding_window"))


class MistralForCausalLM(DecoderLM):
    """Mistral 7B v0.1-v0.3, Mistral Nemo (head_dim from the config)."""

    config: MistralConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
